"""JSON calls out over HTTP between gpupool's daemons: the service's calls to
its agents and an agent's calls to the service (the counterpart of
:mod:`.httpin`, which bounds what comes in).

One tornado client per caller, ``Authorization: token ...`` on every call,
JSON in and out, and one exception for "no HTTP answer" so each caller says
in its own words whom it could not reach. (:class:`gpupool.api.ServiceClient`
stays on blocking urllib: the magics call it from the kernel's main thread.)
"""

from __future__ import annotations

import json
import ssl
from typing import Any

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest


class NoAnswer(OSError):
    """The call got no HTTP answer: refused, no route, timed out, or a
    certificate not trusted. ``cause`` is tornado's error (for
    :func:`gpupool.tls.untrusted`); the words are its words."""

    def __init__(self, cause: BaseException | None) -> None:
        super().__init__(str(cause))
        self.cause = cause


class JSONClient:
    """Async JSON over HTTP with a token. ``tls``: the client context that
    verifies https servers (None: the system's CAs); ``max_clients``: calls
    at once (None: tornado's default, 10)."""

    def __init__(self, tls: ssl.SSLContext | None = None, max_clients: int | None = None) -> None:
        self.tls = tls
        limits = {} if max_clients is None else {"max_clients": max_clients}
        self.http = AsyncHTTPClient(force_instance=True, **limits)

    async def call(self, method: str, url: str, body: Any, *, token: str | None, timeout: float,
                   connect_timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        """One call; returns ``(HTTP status, the reply's JSON object)``, ``{}``
        for a reply that is not one. ``body`` None sends none. ``timeout``
        seconds for the whole call, ``connect_timeout`` (default: the same)
        to connect. Raises :class:`NoAnswer`."""
        request = HTTPRequest(url, method=method, body=None if body is None else json.dumps(body),
                              headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
                              connect_timeout=timeout if connect_timeout is None else connect_timeout,
                              request_timeout=timeout, ssl_options=self.tls)
        try:
            response = await self.http.fetch(request, raise_error=False)
        except (OSError, HTTPClientError) as exc:  # refused, a certificate not trusted
            raise NoAnswer(exc) from None
        if response.code == 599:  # tornado's code for no HTTP answer (timeout)
            raise NoAnswer(response.error)
        try:
            reply = json.loads(response.body or b"{}")
        except ValueError:
            reply = {}
        return response.code, reply if isinstance(reply, dict) else {}

    def close(self) -> None:
        self.http.close()
