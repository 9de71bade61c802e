"""Synchronous HTTP client of the pool service, for the magics, the CLI and
the kernel provisioner.

It speaks the REST API of ``docs/api.md`` and turns every failure into a
:class:`~gpupool.errors.GPUPoolError` whose message a person can act on.
Blocking by design: the magics run in the kernel's main thread and must stay
interruptible, so each call has a timeout and no event loop is involved.
The call itself, and the decoding of its answer and its errors, is
:mod:`gpupool.httpout`'s, shared with the daemons' async calls.
"""

from __future__ import annotations

import os
import urllib.parse
from typing import TYPE_CHECKING, Any

from .errors import GPUPoolError, Reason
from .httpout import BadURL, BlockingJSONClient, NoAnswer
from .tls import ENV_CA_FILE, client_context
from .wire.leases import Lease, LeaseRequest

if TYPE_CHECKING:
    import argparse
    from collections.abc import Mapping

ENV_URL = "GPUPOOL_URL"
ENV_TOKEN = "GPUPOOL_TOKEN"
#: The token a JupyterHub single-user server (its kernels and terminals) holds; used when GPUPOOL_TOKEN is unset.
ENV_HUB_TOKEN = "JUPYTERHUB_API_TOKEN"
#: How a command-line user passes a token, as the help and a refused call name it.
TOKEN_ADVICE = f"pass --token-file FILE or set {ENV_TOKEN} (in a JupyterHub server, {ENV_HUB_TOKEN}) to your token"
#: Where a user sets the service's URL, as failures name it.
URL_HINT = f"{ENV_URL} or --url"


class ServiceClient:
    """Client of ``{url}/api/v1``.

    ``url`` is the service's base URL (``http://127.0.0.1:8765`` standalone,
    ``http://hub:8000/services/gpupool`` behind JupyterHub); ``token`` is sent
    as ``Authorization: token ...``; ``timeout`` is seconds per call (long
    polls add their wait to it). An ``https://`` service's certificate is
    verified against the system's CAs plus ``ca_file`` (default:
    ``$GPUPOOL_CA_FILE``); GPUPoolError ``not_configured`` when that file
    cannot be read. ``token_advice``: how this caller's user passes a token
    (the command line's options); with it a 401 is worded for that user
    (:meth:`token_refused`), else it keeps the service's words for API callers;
    ``url_hint``: where this caller's user sets the URL, as failures name it.
    """

    def __init__(self, url: str, token: str | None, timeout: float = 30.0, ca_file: str | None = None,
                 token_advice: str | None = None, url_hint: str = URL_HINT) -> None:
        self.url = url.rstrip("/")
        self.url_hint = url_hint
        self.token = token
        self.token_advice = token_advice
        self.timeout = timeout
        self._http = BlockingJSONClient(client_context(ca_file) if self.url.lower().startswith("https:") else None)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "ServiceClient":
        """Build from ``GPUPOOL_URL`` and ``GPUPOOL_TOKEN`` (falling back to
        ``JUPYTERHUB_API_TOKEN``, which kernels under JupyterHub inherit).

        Raises GPUPoolError ``not_configured`` when no URL is set.
        """
        env = os.environ if environ is None else environ
        url = env.get(ENV_URL)
        if not url:
            raise GPUPoolError(Reason.not_configured, f"no gpupool service configured: set {ENV_URL} "
                               "(the gpupool kernelspec sets it for you; see `gpupool kernelspec install --help`)", 503)
        return cls(url, token_from_env(env), url_hint=f"{ENV_URL}, which the gpupool kernelspec sets")

    def request(self, method: str, path: str, body: Any = None, params: dict[str, Any] | None = None,
                timeout: float | None = None) -> Any:
        """One call; returns the decoded JSON body. Raises GPUPoolError."""
        try:
            answer = self._http.call(method, f"{self.url}/api/v1{path}", body, token=self.token,
                                     timeout=timeout or self.timeout, params=params)
        except BadURL:
            raise GPUPoolError(Reason.not_configured, f"{self.url!r} is not a service URL; it should look like "
                               f"http://HOST:PORT (check {self.url_hint})", 400) from None
        except NoAnswer as exc:
            raise exc.error(f"the gpupool service at {self.url}",
                            f"is it running? Check the URL ({self.url_hint})") from None
        if answer.status == 404 and not answer.is_ours():  # gpupool's own 404s say what was not found
            raise self.not_a_service(f"HTTP 404 {answer.reason}".rstrip(), 404)
        if not 200 <= answer.status < 300:  # what urllib did not follow (redirects) is a failure
            error = answer.error("the gpupool service", ENV_TOKEN)
            raise self.token_refused(error) if error.status == 401 and self.token_advice else error
        try:
            return answer.json()
        except ValueError:  # a web page (a hub's login page, say): the URL is another server's
            raise self.not_a_service(f"HTTP {answer.status}, not JSON", 502) from None

    def not_a_service(self, answered: str, status: int) -> GPUPoolError:
        """An ``http_error`` with ``status`` for an answer that is not gpupool's
        (``answered``: "HTTP 404 Not Found"): a plausible wrong URL, such as
        JupyterHub's own instead of its ``/services/gpupool``."""
        return GPUPoolError(Reason.http_error, f"{self.url} is not a gpupool service ({answered}): check the URL "
                            f"({self.url_hint})", status)

    def token_refused(self, error: GPUPoolError) -> GPUPoolError:
        """The service's 401 ``error`` in :attr:`token_advice`'s words: whether a token
        was sent, how to pass one, and where the service says tokens come from
        (its ``token_hint``, where it sends one)."""
        sent = "the token sent is not one it knows" if self.token else "no token was sent"
        hint = error.extra.get("token_hint")
        where = f" ({hint})" if isinstance(hint, str) and hint else ""
        return GPUPoolError(error.code, f"the gpupool service at {self.url} refused the call: {sent}; "
                            f"{self.token_advice}{where}", error.status, **error.extra)

    # -- leases ---------------------------------------------------------------

    def create_lease(self, request: LeaseRequest, *, start_wait: float | None = None) -> Lease:
        """``POST /leases``: returns the new lease (state ``starting``, or
        ``queued`` when nothing fits and the request has a ``wait``). With
        ``start_wait`` seconds, the service answers once a placed lease's
        worker started (``active``, with its connection) or could not
        (``failed``), or ``starting`` after that time."""
        params = {"start_wait": start_wait} if start_wait else None
        return Lease.from_json(self.request("POST", "/leases", request.to_json(), params=params,
                                            timeout=self.timeout + (start_wait or 0)))

    def get_lease(self, lease_id: str, *, wait: float | None = None, state: str | None = None,
                  timeout: float | None = None) -> Lease:
        """``GET /leases/{id}``; with ``wait`` seconds and ``state``, long-polls
        until the lease leaves ``state`` or the wait ends. ``timeout``: seconds
        for the call instead of the client's (the wait comes on top)."""
        params = {"wait": wait, "state": state} if wait else None
        timeout = (timeout or self.timeout) + (wait or 0)
        return Lease.from_json(self.request("GET", f"/leases/{_quote(lease_id)}", params=params, timeout=timeout))

    def list_leases(self, *, kernel_id: str | None = None, active: bool = True,
                    all_users: bool = False) -> list[Lease]:
        """``GET /leases``: the caller's own leases (only those holding capacity
        or queued, unless ``active=False``); ``all_users``: every user's (admins
        only: GPUPoolError 403 otherwise)."""
        params = {"kernel_id": kernel_id, "active": int(active), "all_users": 1 if all_users else None}
        body = self.request("GET", "/leases", params=params)
        return [Lease.from_json(item) for item in body["leases"]]

    def heartbeat(self, lease_id: str) -> Lease:
        """``POST /leases/{id}/heartbeat``: renews the lease, returns it."""
        return Lease.from_json(self.request("POST", f"/leases/{_quote(lease_id)}/heartbeat", {}))

    def release(self, lease_id: str, reason: str | None = None) -> Lease:
        """``DELETE /leases/{id}``: stops the worker, records usage; idempotent
        for a lease that already ended."""
        return Lease.from_json(self.request("DELETE", f"/leases/{_quote(lease_id)}", params={"reason": reason}))

    def park(self, lease_id: str) -> Lease:
        """``POST /leases/{id}/park``: park the lease in place (its worker frozen on its node,
        its GPU share back in the pool); returns it, ``parked`` (or still ``parking``)."""
        return Lease.from_json(self.request("POST", f"/leases/{_quote(lease_id)}/park", {}))

    def resume(self, lease_id: str, in_place: bool = False) -> Lease:
        """``POST /leases/{id}/resume``: resume a parked lease once there is room (idempotent);
        ``in_place``: asked ahead of a cell, so it waits for its own node and never moves (a
        move loses what cannot be saved to disk). Returns it, waiting (``parked`` with a place in
        line), ``starting`` or ``active``."""
        body = {"in_place": True} if in_place else {}
        return Lease.from_json(self.request("POST", f"/leases/{_quote(lease_id)}/resume", body))

    def pool(self) -> dict[str, Any]:
        """``GET /pool``: nodes, GPUs and their allocation."""
        return self.request("GET", "/pool")

    # -- quotas and usage -----------------------------------------------------------

    def quota(self) -> dict[str, Any]:
        """``GET /quota``: the caller's limits and usage."""
        return self.request("GET", "/quota")

    def admin_quotas(self) -> dict[str, Any]:
        """``GET /admin/quotas`` (admins): configured, overrides, effective."""
        return self.request("GET", "/admin/quotas")

    def set_quota(self, scope: str, limits: dict[str, Any]) -> dict[str, Any]:
        """``PUT /admin/quotas/{scope}`` (admins): merge ``limits`` into the scope's override."""
        return self.request("PUT", f"/admin/quotas/{_quote(scope)}", limits)

    def clear_quota(self, scope: str) -> dict[str, Any]:
        """``DELETE /admin/quotas/{scope}`` (admins): back to the configured limits."""
        return self.request("DELETE", f"/admin/quotas/{_quote(scope)}")

    def admin_usage(self, days: int = 7) -> dict[str, Any]:
        """``GET /admin/usage`` (admins): GPU-hours per user and group."""
        return self.request("GET", "/admin/usage", params={"days": days})


def token_from_env(environ: "Mapping[str, str] | None" = None) -> str | None:
    """The user's token from the environment: ``GPUPOOL_TOKEN``, else
    ``JUPYTERHUB_API_TOKEN`` (a JupyterHub single-user server's, which its
    kernels and terminals inherit and the service accepts under the hub);
    None when neither is set. Read by :meth:`ServiceClient.from_env` and by
    every command's :func:`client_from_arguments`, so both agree."""
    env = os.environ if environ is None else environ
    return env.get(ENV_TOKEN) or env.get(ENV_HUB_TOKEN) or None


def _quote(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def add_client_arguments(parser: "argparse.ArgumentParser") -> None:
    """``--url``, ``--token-file`` and ``--ca-file`` for a command that calls the service.

    The token comes from a file or from the environment (:func:`token_from_env`),
    never from the command line, where every user of the host can read it
    (``ps``). ``--token`` is still accepted for old scripts, but hidden from the help."""
    import argparse

    parser.add_argument("--url", default=os.environ.get(ENV_URL), help=f"service URL (default: ${ENV_URL})")
    parser.add_argument("--ca-file", default=os.environ.get(ENV_CA_FILE),
                        help=f"CA bundle (PEM) that signed an https service's certificate (default: ${ENV_CA_FILE})")
    parser.add_argument("--token-file", help=f"read the API token from this file (default: the token in ${ENV_TOKEN}, "
                        f"else ${ENV_HUB_TOKEN}, which a JupyterHub server's terminals hold)")
    parser.add_argument("--token", help=argparse.SUPPRESS)


def client_from_arguments(parser: "argparse.ArgumentParser", args: "argparse.Namespace") -> ServiceClient:
    """The client those arguments name; a missing URL or an unreadable token
    file ends the command with one line (``parser.error``)."""
    if not args.url:
        parser.error(f"no service URL: pass --url or set {ENV_URL}")
    token = args.token or token_from_env()
    if args.token_file:
        try:
            with open(args.token_file) as handle:
                token = handle.read().strip()
        except OSError as exc:
            parser.error(f"cannot read the token file {args.token_file}: {exc.strerror}")
    return ServiceClient(args.url, token, ca_file=args.ca_file,
                         token_advice=TOKEN_ADVICE)
