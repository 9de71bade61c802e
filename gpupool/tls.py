"""TLS for the service's and the agents' HTTP: server contexts from a
certificate and key file, client contexts that verify, and the words for a
certificate that does not verify.

Clients always verify: against the system's CAs, or against the CA bundle in
``GPUPOOL_CA_FILE`` (``--ca-file``, ``c.NodeAgent.ca_file``,
``c.GPUPool.ca_file``) for a deployment with its own CA or a self-signed
certificate. docs/security.md, "Transport", says when to use what.
"""

from __future__ import annotations

import os
import ssl
from typing import Mapping

from .errors import GPUPoolError, Reason

#: Environment variable naming a CA bundle (PEM) that clients trust besides the system's CAs.
ENV_CA_FILE = "GPUPOOL_CA_FILE"


def server_context(cert: str, key: str, settings: str) -> ssl.SSLContext | None:
    """An ``ssl.SSLContext`` serving ``cert`` (PEM, the chain) with ``key``
    (PEM, unencrypted); None when both are empty (plain HTTP).

    ``settings`` names the options in messages (e.g. ``"c.GPUPool.ssl_cert /
    ssl_key"``). Raises GPUPoolError ``not_configured`` when only one is set,
    a file cannot be read, or the key does not match the certificate.
    """
    if not cert and not key:
        return None
    if not cert or not key:
        raise GPUPoolError(Reason.not_configured, f"TLS needs both a certificate and its key ({settings}); "
                           f"only the {'certificate' if cert else 'key'} is set")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:  # before OSError, its base class: readable files that do not fit
        raise GPUPoolError(Reason.not_configured, f"the TLS certificate {cert} and key {key} cannot be used together "
                           f"({settings}): {exc.reason or exc}") from None
    except OSError as exc:
        raise GPUPoolError(Reason.not_configured, f"cannot read the TLS certificate or key ({settings}): "
                           f"{exc.strerror or exc}: {exc.filename or cert}") from None
    return context


def client_context(ca_file: str | None = None, environ: Mapping[str, str] | None = None) -> ssl.SSLContext:
    """A verifying client context: the system's CAs plus ``ca_file`` (default:
    ``$GPUPOOL_CA_FILE``), host names checked. Raises GPUPoolError
    ``not_configured`` when the CA file cannot be read."""
    env = os.environ if environ is None else environ
    ca_file = ca_file or env.get(ENV_CA_FILE) or None
    context = ssl.create_default_context()
    if ca_file:
        try:
            context.load_verify_locations(cafile=ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise GPUPoolError(Reason.not_configured,
                               f"cannot read the CA file {ca_file} ({ENV_CA_FILE} or --ca-file): "
                               f"{getattr(exc, 'strerror', None) or exc}") from None
    return context


def untrusted(exc: BaseException | None) -> str | None:
    """Why a TLS peer was not trusted, when ``exc`` is a certificate
    verification failure or wraps one (``URLError.reason``, ``__cause__``);
    else None."""
    reason = getattr(exc, "reason", None)
    for candidate in (exc, reason, getattr(exc, "__cause__", None)):
        if isinstance(candidate, ssl.SSLCertVerificationError):
            return candidate.verify_message or "certificate verify failed"
    return None


def untrusted_message(url: str, why: str) -> str:
    """Words for a certificate of ``url`` that did not verify (``why``)."""
    return (f"the TLS certificate of {url} is not trusted ({why}); if it is signed by your own CA or "
            f"self-signed, set {ENV_CA_FILE} (or --ca-file) to that CA's certificate file")
