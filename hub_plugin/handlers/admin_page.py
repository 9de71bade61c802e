"""The page at ``/services/gpupool/`` (under JupyterHub): the pool at a glance.

Browsers log in through the hub with OAuth (``HubOAuthenticated``): the
first visit is sent to the hub's authorize URL and comes back to
``oauth_callback`` with a cookie. What the page shows is
:func:`..dashboard.dashboard` for the caller: everything for a holder of
``custom:gpupool:admin``, their own leases and usage for anyone else.
Standalone (no hub) the page answers 404: the API and ``gpupool status``
serve the same data there.
"""

from __future__ import annotations

import html
import logging
from pathlib import Path
from typing import Any

from tornado import template, web

from gpupool.errors import GPUPoolError
from gpupool.quota_cli import limit_words
from gpupool.units import format_bytes, format_duration, format_gpu_hours

from ..auth import identity_from_hub_model
from ..dashboard import dashboard

log = logging.getLogger("gpupool.service.page")

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
_loader = template.Loader(str(TEMPLATES), autoescape="xhtml_escape")

#: Colours of the usage chart's users, in turn.
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f")


def _hub_oauthenticated():
    # Imported lazily: jupyterhub is needed only by a service that runs under the hub.
    from jupyterhub.services.auth import HubOAuthenticated

    return HubOAuthenticated


class _PageBase(web.RequestHandler):
    """HTML errors instead of the API's JSON ones."""

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, GPUPoolError):
            status_code, message = exc.status, exc.message
        elif isinstance(exc, web.HTTPError) and exc.log_message:
            message = exc.log_message
        else:
            message = "the gpupool service hit an unexpected error; an admin can find it in its log"
        self.set_status(status_code)
        self.finish(f"<!doctype html><title>gpupool: {status_code}</title><h1>gpupool</h1>"
                    f"<p class='error'>{html.escape(message)}</p>")


def make_handlers() -> list[tuple[str, type]]:
    """The page's routes; built at start-up, only under JupyterHub."""
    from jupyterhub.services.auth import HubOAuthCallbackHandler

    class AdminPageHandler(_hub_oauthenticated(), _PageBase):
        """``GET /services/gpupool/``: the dashboard for the logged-in user."""

        @property
        def hub_auth(self):
            return self.settings["hub_auth"]

        async def prepare(self) -> None:
            # The async form of HubAuthenticated.get_current_user: no blocking thread.
            model = await self.hub_auth.get_user(self, sync=False)
            self._hub_auth_user_cache = self.check_hub_user(model) if model else None

        @web.authenticated
        async def get(self) -> None:
            who = identity_from_hub_model(self.current_user)
            ctx = self.settings["gpupool"]
            now = ctx.pool.state.now()

            def read() -> dict:  # on a store thread (storework)
                with ctx.pool.state.reading() as session:
                    return dashboard(session, who, context_overhead=ctx.settings.nodes.context_overhead, now=now,
                                     quota_book=ctx.pool.quotas)

            data = await ctx.work.read(read)
            colours = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(data["usage"]["users"])}
            self.set_header("Cache-Control", "no-store")
            self.finish(_loader.load("admin.html").generate(
                who=who, d=data, now=now, colours=colours, base_url=ctx.settings.service.base_url,
                format_bytes=format_bytes, format_duration=format_duration, limit_words=limit_words,
                format_gpu_hours=format_gpu_hours))

    class CallbackHandler(HubOAuthCallbackHandler):
        @property
        def hub_auth(self):
            return self.settings["hub_auth"]

    return [(r"/", AdminPageHandler), (r"/oauth_callback", CallbackHandler)]


def routes_for(hub_auth: Any) -> list[tuple[str, type]]:
    """The page's routes when ``hub_auth`` is set (under JupyterHub), else none."""
    return make_handlers() if hub_auth is not None else []

