"""The one error type that crosses the wire.

Every expected failure is a :class:`GPUPoolError` with separate parts, as
JupyterHub's ``SpawnException`` does: the message for a person, a reason code
for machines and metrics, the HTTP status, and optional extra fields. The
service sends it as ``{"error": code, "message": ..., **extra}``; the client
raises it again from that JSON, and the magics print only ``message``.
"""

from __future__ import annotations

from typing import Any


class GPUPoolError(Exception):
    """An expected failure, told to a person in words.

    Parameters: ``code`` (str, stable machine reason such as ``pool_full``),
    ``message`` (str, shown to the user as is, and logged: it never holds a
    secret), ``status`` (int, HTTP status), ``extra`` (dict of JSON values
    sent beside the message).
    """

    def __init__(self, code: str, message: str, status: int = 400, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.extra = extra

    def to_json(self) -> dict[str, Any]:
        """The wire shape: ``{"error": code, "message": message, **extra}``."""
        return {"error": self.code, "message": self.message, **self.extra}

    @classmethod
    def from_json(cls, status: int, body: dict[str, Any]) -> "GPUPoolError":
        """Rebuild the error the service sent with HTTP ``status``."""
        extra = {k: v for k, v in body.items() if k not in ("error", "message")}
        return cls(str(body.get("error", "error")), str(body.get("message", "unknown error")), status, **extra)

    def __str__(self) -> str:
        return self.message


def bad_request(message: str, **extra: Any) -> GPUPoolError:
    """A 400 ``bad_request``: the input was wrong and nothing changed."""
    return GPUPoolError("bad_request", message, 400, **extra)


def not_found(what: str) -> GPUPoolError:
    """A 404 ``not_found`` for ``what`` (e.g. ``"lease L-12"``)."""
    return GPUPoolError("not_found", f"{what} not found", 404)
