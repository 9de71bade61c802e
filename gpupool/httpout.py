"""JSON calls out over HTTP, for every part of gpupool (the counterpart of
:mod:`.httpin`, which bounds what comes in): :func:`prepare` builds a call,
:class:`Answer` and :class:`NoAnswer` say how it went, and two thin transports
send it, :class:`BlockingJSONClient` (urllib) and :class:`JSONClient`
(tornado). Why urllib for the blocking one: docs/code.md, "JSON calls out".
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, NamedTuple

from .errors import GPUPoolError, Reason, is_error_body
from .tls import untrusted, untrusted_message


class Request(NamedTuple):
    """A call as both transports send it."""

    method: str
    url: str
    body: bytes | None
    headers: dict[str, str]


def prepare(method: str, url: str, body: Any = None, *, token: str | None = None,
            params: dict[str, Any] | None = None) -> Request:
    """The request for ``method`` on ``url``: ``params`` (None values left
    out) as its query, ``body`` as JSON (None: no body), ``token`` (None or
    empty: none) as ``Authorization: token ...``."""
    if params:
        url += "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
    data = None if body is None else json.dumps(body).encode()
    headers = {"Accept": "application/json"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    if token:
        headers["Authorization"] = f"token {token}"
    return Request(method, url, data, headers)


class Answer(NamedTuple):
    """An HTTP answer to ``request``: its status, reason phrase and body."""

    request: Request
    status: int
    reason: str
    body: bytes

    def json(self) -> Any:
        """The body's JSON (None for an empty body). Raises ValueError."""
        return json.loads(self.body) if self.body else None

    def object(self) -> dict[str, Any]:
        """The body's JSON object, ``{}`` for a body that is not one."""
        try:
            reply = json.loads(self.body or b"{}")
        except ValueError:
            return {}
        return reply if isinstance(reply, dict) else {}

    def error(self, whom: str, token_hint: str) -> GPUPoolError:
        """The GPUPoolError this failed answer of ``whom`` (words: "the gpupool
        service") stands for: the one in a gpupool error body
        (:func:`~gpupool.errors.is_error_body`; another server's, such as
        JupyterHub's ``{"status": 404, "message": null}``, is not one); else
        ``unauthorized`` for 401/403, naming ``token_hint`` (what to check);
        else ``http_error`` naming the URL tried."""
        body = self.object()
        if is_error_body(body):
            return GPUPoolError.from_json(self.status, body)
        if self.status in (401, 403):
            return GPUPoolError(Reason.unauthorized, f"{whom} refused the token (HTTP {self.status}); "
                                f"check {token_hint}", self.status)
        return GPUPoolError(Reason.http_error, f"{whom} answered HTTP {self.status} {self.reason} for "
                            f"{self.request.url}", self.status)

    def is_ours(self) -> bool:
        """Whether the body is a gpupool error (:func:`~gpupool.errors.is_error_body`)."""
        return is_error_body(self.object())


class NoAnswer(OSError):
    """The call got no HTTP answer: refused, no route, timed out, or a
    certificate not trusted. ``cause`` is the transport's error (for
    :func:`gpupool.tls.untrusted`); the words are its words. ``request``:
    the call that got none."""

    def __init__(self, cause: BaseException | None, request: Request) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.request = request

    @property
    def reason(self) -> Any:
        """The cause's own reason (urllib's URLError wraps one), else the cause."""
        return getattr(self.cause, "reason", self.cause)

    def untrusted_words(self, whom: str) -> str | None:
        """Words for a certificate of ``whom`` ("the gpupool service at URL")
        that did not verify; None when that was not why."""
        why = untrusted(self.cause)
        return untrusted_message(whom, why) if why else None

    def error(self, whom: str, hint: str) -> GPUPoolError:
        """A 503 GPUPoolError for ``whom``: ``untrusted_certificate``, or
        ``service_unavailable`` ending with ``hint`` (what to check), whose
        log names the call and the cause."""
        words = self.untrusted_words(whom)
        if words:
            return GPUPoolError(Reason.untrusted_certificate, words, 503)
        return GPUPoolError(Reason.service_unavailable, f"cannot reach {whom} ({self.reason}); {hint}", 503,
                            log_message=f"{self.request.method} {self.request.url}: {self.cause!r}")


class BadURL(ValueError):
    """The URL is not one a call can be made to (no ``http://``, say)."""


class BlockingJSONClient:
    """Blocking JSON over HTTP (urllib), for the kernel's main thread and the
    command line. ``tls``: the client context that verifies https servers
    (None: urllib's default)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls

    def call(self, method: str, url: str, body: Any = None, *, token: str | None, timeout: float,
             params: dict[str, Any] | None = None) -> Answer:
        """One call (:func:`prepare`), bounded by ``timeout`` seconds; returns
        the answer, whatever its status. Raises :class:`BadURL` and
        :class:`NoAnswer`."""
        request = prepare(method, url, body, token=token, params=params)
        parts = urllib.parse.urlsplit(request.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:  # urllib would say "unknown url type"
            raise BadURL(request.url)
        try:
            req = urllib.request.Request(request.url, data=request.body, headers=request.headers, method=method)
        except ValueError as exc:
            raise BadURL(str(exc)) from None
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.tls) as resp:
                return Answer(request, resp.status, resp.reason, resp.read())
        except urllib.error.HTTPError as exc:
            return Answer(request, exc.code, str(exc.reason), exc.read())
        except OSError as exc:  # URLError too: refused, no route, timed out, a certificate not trusted
            raise NoAnswer(exc, request) from None


class JSONClient:
    """Async JSON over HTTP (tornado), for the daemons. ``tls``: the client
    context that verifies https servers (None: the system's CAs);
    ``max_clients``: calls at once (None: tornado's default, 10)."""

    def __init__(self, tls: ssl.SSLContext | None = None, max_clients: int | None = None) -> None:
        from tornado.httpclient import AsyncHTTPClient  # here: the CLI and the magics load no tornado

        self.tls = tls
        limits = {} if max_clients is None else {"max_clients": max_clients}
        self.http = AsyncHTTPClient(force_instance=True, **limits)

    async def call(self, method: str, url: str, body: Any = None, *, token: str | None, timeout: float,
                   connect_timeout: float | None = None, params: dict[str, Any] | None = None) -> Answer:
        """One call (:func:`prepare`); returns the answer, whatever its
        status. ``timeout`` seconds for the whole call, ``connect_timeout``
        (default: the same) to connect. Raises :class:`NoAnswer`."""
        from tornado.httpclient import HTTPClientError, HTTPRequest

        request = prepare(method, url, body, token=token, params=params)
        fetch = HTTPRequest(request.url, method=method, body=request.body, headers=request.headers,
                            connect_timeout=timeout if connect_timeout is None else connect_timeout,
                            request_timeout=timeout, ssl_options=self.tls)
        try:
            response = await self.http.fetch(fetch, raise_error=False)
        except (OSError, HTTPClientError) as exc:  # refused, a certificate not trusted
            raise NoAnswer(exc, request) from None
        if response.code == 599:  # tornado's code for no HTTP answer (timeout)
            raise NoAnswer(response.error, request)
        return Answer(request, response.code, response.reason or "", response.body or b"")

    def close(self) -> None:
        self.http.close()
