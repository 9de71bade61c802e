"""The one base of the service's and the agent's JSON handlers (tornado).

Both servers speak the same way (docs/api.md, "Error codes"): bodies bounded and
read only once the token was checked (:mod:`.httpin`), JSON in and out, and
every exception answered in the one error shape ``{"error", "message", ...}``:
a :class:`GPUPoolError` as it is, a tornado ``HTTPError`` by its status, and
anything unexpected as a 500 whose words name no internals (the traceback
goes to the log only). After JupyterHub's ``apihandlers/base.py``.

A subclass sets :attr:`JSONHandler.log` and :attr:`JSONHandler.failure`,
checks its token in ``prepare`` and then calls :meth:`start_body`
(decorate it with ``tornado.web.stream_request_body``).
"""

from __future__ import annotations

import json
import logging
from http.client import responses
from typing import Any

from tornado import web

from . import httpin
from .errors import GPUPoolError, Reason, bad_request


class JSONHandler(httpin.BoundedBody, web.RequestHandler):
    """JSON in and out, errors as JSON; see the module docstring."""

    #: Where expected failures are logged (one line each, no traceback).
    log = logging.getLogger("gpupool")
    #: What a 500 says to the caller.
    failure = "the server hit an unexpected error; an admin can find the details in its log"
    #: Whether a body sent as another media type than JSON is refused (415).
    json_media_type_only = True

    def start_body(self) -> None:
        """Begin reading the body (call at the end of ``prepare``); 400 when it is too large."""
        try:
            super().start_body()
        except httpin.TooLarge as exc:
            raise bad_request(str(exc)) from None

    def json_body(self, *, optional: bool = False) -> Any:
        """The request body as JSON; 400 when it is not JSON (or missing,
        unless ``optional``, which gives ``{}`` for an empty body), 415 when
        its ``Content-Type`` names another format (no header: read as JSON;
        with :attr:`json_media_type_only` false, whatever it says).
        ``NaN`` and ``Infinity`` are not JSON and are refused too."""
        try:
            raw = self.body()
        except httpin.TooLarge as exc:
            raise bad_request(str(exc)) from None
        if not raw.strip():
            if optional:
                return {}
            raise bad_request("the request needs a JSON body")
        if self.json_media_type_only:
            _check_json_media_type(self.request.headers.get("Content-Type"))
        try:
            return httpin.loads(raw)
        except ValueError as exc:  # UnicodeDecodeError is one
            raise bad_request(f"the request body is not valid JSON ({str(exc):.200})") from None

    def write_json(self, body: Any, status: int = 200) -> None:
        """Answer ``body`` as JSON with ``status``; never cached (answers hold leases and keys)."""
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(body))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        error = self._error(status_code, kwargs.get("exc_info", (None, None, None))[1])
        self.set_status(error.status)
        if error.status == 405:  # RFC 9110: a 405 lists what the resource does allow
            self.set_header("Allow", ", ".join(self.allowed_methods()))
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(error.to_json()))

    def _error(self, status_code: int, exc: BaseException | None) -> GPUPoolError:
        if isinstance(exc, GPUPoolError):
            return exc
        if isinstance(exc, web.HTTPError) or exc is None:
            code = exc.status_code if isinstance(exc, web.HTTPError) else status_code
            words = getattr(exc, "log_message", None) or responses.get(code, "error")
            return GPUPoolError(_http_code(code), words.lower(), code)
        return GPUPoolError(Reason.internal_error, self.failure, 500)

    def send_error(self, status_code: int = 500, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        super().send_error(exc.status if isinstance(exc, GPUPoolError) else status_code, **kwargs)

    def allowed_methods(self) -> list[str]:
        """The HTTP methods this handler implements, e.g. ``["GET", "DELETE"]``."""
        return [m for m in self.SUPPORTED_METHODS
                if getattr(type(self), m.lower(), None) is not getattr(web.RequestHandler, m.lower(), None)]

    def log_exception(self, typ, value, tb) -> None:
        if isinstance(value, GPUPoolError):
            # Expected: one line, no traceback. 5xx ones are worth a warning.
            level = logging.WARNING if value.status >= 500 else logging.DEBUG
            self.log.log(level, "%s %s -> %d %s: %s", self.request.method, self.request.path,
                         value.status, value.code, value.log_message)
        else:
            super().log_exception(typ, value, tb)

    def check_xsrf_cookie(self) -> None:
        """Token auth only, no cookies: XSRF does not apply."""


def _http_code(status: int) -> Reason:
    return {400: Reason.bad_request, 401: Reason.unauthorized, 403: Reason.forbidden, 404: Reason.not_found,
            405: Reason.method_not_allowed}.get(status, Reason.http_error)


def _check_json_media_type(header: str | None) -> None:
    """415 unless ``header`` (a request's Content-Type) is absent or names JSON."""
    if header is None:
        return
    media = header.partition(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise GPUPoolError(Reason.unsupported_media_type, f"the request body must be JSON sent with "
                           f"'Content-Type: application/json', not {header[:80]!r}", 415)
