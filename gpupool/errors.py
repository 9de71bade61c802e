"""The one error type that crosses the wire.

Every expected failure is a :class:`GPUPoolError` with separate parts, as
JupyterHub's ``SpawnException`` does: the message for a person, the message
for the log, a reason code (:class:`Reason`) for machines and metrics, the
HTTP status, and optional extra fields. The service sends it as
``{"error": code, "message": ..., **extra}``; the client raises it again from
that JSON, and the magics print only ``message``.
"""

from __future__ import annotations

from .strenum import StrEnum
from typing import Any


class Reason(StrEnum):
    """Every reason code gpupool sends or raises: the wire's ``"error"``.

    A ``str``: a member equals its value (``Reason.pool_full == "pool_full"``),
    formats as it and is written to JSON as it. Codes are stable: a new one
    may be added, none is renamed. What each one means, and its HTTP status:
    docs/api.md, "Error codes" (a test checks that table against this enum).
    """

    bad_request = "bad_request"
    unauthorized = "unauthorized"
    forbidden = "forbidden"
    not_found = "not_found"
    method_not_allowed = "method_not_allowed"
    unsupported_media_type = "unsupported_media_type"
    http_error = "http_error"
    internal_error = "internal_error"
    pool_full = "pool_full"
    quota_exceeded = "quota_exceeded"
    unknown_environment = "unknown_environment"
    node_name_taken = "node_name_taken"
    store_busy = "store_busy"
    store_unavailable = "store_unavailable"
    hub_unavailable = "hub_unavailable"
    service_unavailable = "service_unavailable"
    untrusted_certificate = "untrusted_certificate"
    not_configured = "not_configured"
    agent_unreachable = "agent_unreachable"
    agent_stopping = "agent_stopping"
    worker_start_failed = "worker_start_failed"
    worker_stop_failed = "worker_stop_failed"
    worker_user_unknown = "worker_user_unknown"
    worker_busy = "worker_busy"
    park_failed = "park_failed"
    no_inventory = "no_inventory"
    inventory_unavailable = "inventory_unavailable"
    lease_failed = "lease_failed"
    start_timeout = "start_timeout"
    lease_lost = "lease_lost"
    worker_unreachable = "worker_unreachable"
    worker_timeout = "worker_timeout"
    worker_unresponsive = "worker_unresponsive"
    invalid_state = "invalid_state"
    cannot_park = "cannot_park"
    transfer_failed = "transfer_failed"
    no_lease = "no_lease"
    start_failed = "start_failed"
    leak = "leak"
    install_failed = "install_failed"

    @classmethod
    def parse(cls, code: str) -> "Reason | str":
        """The member whose value is ``code``, or ``code`` itself (a plain
        ``str``) when this version does not know it (a newer service's)."""
        try:
            return cls(code)
        except ValueError:
            return code


class GPUPoolError(Exception):
    """An expected failure, told to a person in words.

    Parameters: ``code`` (a :class:`Reason`: the machine reason, also the
    metrics label; a ``str`` is taken as its member, and kept as it is when no
    member has that value, as :meth:`from_json` needs for a newer service's
    code), ``message`` (str, shown to the user as is: it never holds a
    secret), ``status`` (int, HTTP status), ``log_message`` (str, what the log
    says: where the message is not enough, the URL tried or the underlying
    exception; default ``message``; never sent on the wire), ``extra`` (dict of
    JSON values sent beside the message).
    """

    def __init__(self, code: Reason | str, message: str, status: int = 400, *, log_message: str | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.code = Reason.parse(code)
        self.message = message
        self.status = status
        self.log_message = log_message or message
        self.extra = extra

    def to_json(self) -> dict[str, Any]:
        """The wire shape: ``{"error": code, "message": message, **extra}``."""
        return {"error": str(self.code), "message": self.message, **self.extra}

    @classmethod
    def from_json(cls, status: int, body: dict[str, Any]) -> "GPUPoolError":
        """Rebuild the error the service sent with HTTP ``status``. An unknown
        code stays as it came (a plain ``str``: compare with ``==``). Never
        raises for a body that is not ours (JupyterHub's ``{"status": 404,
        "message": null}``, say): a field that is not text is left out, and a
        key that is one of this class's own parameters (``status``) or not a
        name is not taken as an extra. Whether a body is one of ours:
        :func:`is_error_body`."""
        code, message = body.get("error"), body.get("message")
        extra = {k: v for k, v in body.items()
                 if isinstance(k, str) and k.isidentifier() and k not in ("error", "message", "status", "log_message")}
        return cls(code if isinstance(code, str) and code else "error",
                   message if isinstance(message, str) and message else "unknown error", status, **extra)

    def __str__(self) -> str:
        return self.message


def is_error_body(body: Any) -> bool:
    """Whether ``body`` (decoded JSON) is an error as gpupool sends it: an
    object whose ``error`` and ``message`` are text. Another server's error
    (a proxy's, JupyterHub's ``{"status": 404, "message": null}``) is not."""
    return isinstance(body, dict) and isinstance(body.get("error"), str) and isinstance(body.get("message"), str)


def bad_request(message: str, **extra: Any) -> GPUPoolError:
    """A 400 ``bad_request``: the input was wrong and nothing changed."""
    return GPUPoolError(Reason.bad_request, message, 400, **extra)


def not_found(what: str) -> GPUPoolError:
    """A 404 ``not_found`` for ``what`` (e.g. ``"lease L-12"``)."""
    return GPUPoolError(Reason.not_found, f"{what} not found", 404)
