"""The base of every REST handler: auth, JSON in and out, errors as JSON.

Bodies are streamed (``stream_request_body``): ``prepare`` checks the token
as soon as the headers are in, so an unauthenticated request is answered 401
and its connection closed before a byte of its body is read, and no body over
1 MiB is ever buffered (:mod:`gpupool.httpin`). Store work runs off the event
loop, in the caller's turn (:mod:`..storework`).

Every exception becomes the one error shape ``{"error", "message", ...}``:
a :class:`GPUPoolError` as it is, a tornado ``HTTPError`` by its status, and
anything unexpected as a 500 with a generic message (the traceback goes to
the log only): :class:`gpupool.jsonhandler.JSONHandler`, the agent's base too. Store sessions are opened per operation by :mod:`..leases`
and :mod:`..nodes` as context managers, which roll back on any exception,
so a failed request never leaves a half-written change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tornado import web

from gpupool import httpin
from gpupool.errors import GPUPoolError, Reason, bad_request
from gpupool.jsonhandler import JSONHandler

from ..auth import Authenticator, Identity, forbidden, token_from_header, unauthorized
from ..config import ServiceSettings
from ..metrics import Metrics
from ..pool import Pool
from ..storework import CALLER, StoreWork

log = logging.getLogger("gpupool.service.api")

#: Largest request body accepted, in bytes (a registration of 64 GPUs is a few KiB).
MAX_BODY = httpin.MAX_BODY


@dataclass
class ServiceContext:
    """What handlers reach, passed in the tornado settings as ``gpupool``."""

    #: The service's settings, one of each class: ``settings.service.base_url``, ``settings.leases.max_wait``, ...
    settings: ServiceSettings
    authenticator: Authenticator
    #: The service's parts (:mod:`..pool`): ``pool.intake``, ``pool.leases``, ``pool.views``, ``pool.nodes``, ...
    pool: Pool
    metrics: Metrics
    #: The token that may read ``/metrics`` with its per-user series (``c.GPUPool.metrics_token_file``); "" for none.
    metrics_token: str = ""

    @property
    def work(self) -> StoreWork:
        """The store threads (:mod:`..storework`): ``await ctx.work.read(fn, ...)``."""
        return self.pool.state.work


@web.stream_request_body
class APIHandler(JSONHandler):
    """The service's API base (JSON in and out, errors as JSON:
    :class:`gpupool.jsonhandler.JSONHandler`). Subclasses set
    ``auth_required = False`` to skip auth, and call :meth:`require_user` or
    :meth:`require_agent` in their methods. Subclasses that override
    ``prepare`` call :meth:`start_body` at its end (after their own token
    check) before reading :meth:`json_body`."""

    log = log
    failure = "the gpupool service hit an unexpected error; an admin can find the details in its log"
    auth_required = True
    identity: Identity | None = None

    @property
    def ctx(self) -> ServiceContext:
        return self.settings["gpupool"]

    async def prepare(self) -> None:
        if self.auth_required:
            token = token_from_header(self.request.headers.get("Authorization"))
            identity = await self.ctx.authenticator.authenticate(token) if token else None
            if identity is None:
                raise unauthorized(self.ctx.authenticator.token_hint)
            self.identity = identity
            # Store work of this request takes turns with other callers' (storework).
            CALLER.set(f"agent {self.request.remote_ip}" if identity.agent else f"user {identity.name}")
        self.start_body()

    def require_user(self) -> Identity:
        """The calling user; 403 for an agent token."""
        if self.identity is None or self.identity.agent:
            raise forbidden("an agent token cannot call this endpoint; use a user's token")
        return self.identity

    def require_agent(self) -> Identity:
        """The calling agent; 403 for a user token."""
        if self.identity is None or not self.identity.agent:
            raise forbidden("only node agents (with the agent token) may call /nodes")
        return self.identity

    def json_object_body(self, *, optional: bool = False) -> dict[str, Any]:
        """:meth:`json_body` that must be a JSON object; 400 otherwise."""
        body = self.json_body(optional=optional)
        if not isinstance(body, dict):
            raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
        return body

    def empty_body(self) -> None:
        """A request that takes no fields: no body, or ``{}``; 400 naming any
        field sent (it would be ignored, and a caller would think it did something)."""
        body = self.json_object_body(optional=True)
        if body:
            raise bad_request(f"this request takes no fields; got {', '.join(sorted(map(repr, body)))}")

    def float_argument(self, name: str, default: float | None = None) -> float | None:
        """A query argument as a finite number of seconds >= 0 (``default``
        when absent); 400 otherwise, also for an empty one."""
        text = self.get_query_argument(name, None)
        if text is None:
            return default
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value >= 0 or value == float("inf"):
            raise bad_request(f"'{name}' must be a number of seconds >= 0, got {text!r:.80}")
        return value


class NotFoundHandler(APIHandler):
    """JSON 404 for every path no route matches; the service's root and ``admin`` (where a person
    opens it in a browser) say where the API and the admin page are."""

    auth_required = False

    def prepare(self) -> None:
        path, base = self.request.path, self.ctx.settings.service.base_url
        hint = ""
        if path.rstrip("/") in (base.rstrip("/"), base + "admin"):
            hint = (f"; the REST API is under {base}api/v1/ (docs/api.md); the admin page is served only under "
                    "JupyterHub (its /services/gpupool/); here gpupool status --all-users and gpupool quota list "
                    "show the pool to an admin")
        raise GPUPoolError(Reason.not_found, f"no such endpoint: {path}{hint}", 404)
