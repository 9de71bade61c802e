"""The service's side of JupyterHub auth without a hub: a 403 to a user who is not a pool
admin names what makes one in the mode the service runs in (the hub's admin scope under
JupyterHub, ``c.GPUPool.admin_users`` standalone), and ``c.GPUPool.hub_auth_cache_max_age``
is the HubAuth cache's age (a revoked hub token works at the pool until it runs out)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port
from traitlets.config import Config, Configurable

from gpupool.hub_plugin import hub_service
from gpupool.hub_plugin.app import make_web_app
from gpupool.hub_plugin.auth import ADMIN_SCOPE, USE_SCOPE, HubAuthenticator, TokenAuthenticator
from gpupool.hub_plugin.config import GPUPool, ServiceSettings
from gpupool.hub_plugin.handlers.base import ServiceContext

AGENT_TOKEN = "agent-token-hub-auth"


class StandInHubAuth:
    """What HubAuthenticator asks of a ``HubAuth``: ann's token is a user's, with the use scope only."""

    api_token = "the-service-own-hub-token"
    api_url = "http://127.0.0.1:1/hub/api"

    async def user_for_token(self, token: str, sync: bool = True) -> dict[str, Any] | None:
        if token != "ann-hub-token":
            return None
        return {"kind": "user", "name": "ann", "groups": ["physics"], "scopes": [f"{USE_SCOPE}!user=ann"]}


def refusals(authenticator, token: str) -> dict[str, tuple[int, str]]:
    """``(status, message)`` of ``GET /admin/quotas`` and ``GET /leases?all_users=1`` as ``token``,
    against the service's routes in this process (nothing behind them: both are refused first)."""
    settings = ServiceSettings.configured(Configurable(config=Config()))
    app = make_web_app(ServiceContext(settings=settings, authenticator=authenticator, pool=None, metrics=None))

    async def ask() -> dict[str, tuple[int, str]]:
        sock, port = bind_unused_port()
        server = HTTPServer(app)
        server.add_sockets([sock])
        client = AsyncHTTPClient(force_instance=True)
        try:
            out = {}
            for path in ("/api/v1/admin/quotas", "/api/v1/leases?all_users=1"):
                answer = await client.fetch(f"http://127.0.0.1:{port}{path}", raise_error=False,
                                            headers={"Authorization": f"token {token}"})
                out[path.split("/")[3].split("?")[0]] = (answer.code, json.loads(answer.body)["message"])
            return out
        finally:
            client.close()
            server.stop()

    return asyncio.run(ask())


def test_under_the_hub_a_non_admin_is_told_the_hub_admin_scope():
    got = refusals(HubAuthenticator(StandInHubAuth(), AGENT_TOKEN), "ann-hub-token")
    where = (f"the hub's {ADMIN_SCOPE} scope: the admin_group or admin_users of gpupool.hub_plugin.hub.configure(c, "
             "...) in jupyterhub_config.py")
    assert got == {"admin": (403, f"only pool admins may call /admin ({where})"),
                   "leases": (403, f"only pool admins may list every user's leases ({where}); without all_users "
                                   "you get your own")}
    assert not any("c.GPUPool.admin_users" in message for _, message in got.values())


def test_standalone_a_non_admin_is_told_the_admin_users_setting():
    got = refusals(TokenAuthenticator({"bob-token": "bob"}, {"boss"}, AGENT_TOKEN), "bob-token")
    assert got == {"admin": (403, "only pool admins may call /admin (c.GPUPool.admin_users)"),
                   "leases": (403, "only pool admins may list every user's leases (c.GPUPool.admin_users); "
                                   "without all_users you get your own")}


@pytest.fixture
def hub_environment(monkeypatch):
    """What JupyterHub gives a managed service, for HubOAuth to read."""
    for name, value in {"JUPYTERHUB_API_TOKEN": "the-service-own-hub-token",
                        "JUPYTERHUB_API_URL": "http://127.0.0.1:1/hub/api",
                        "JUPYTERHUB_SERVICE_PREFIX": "/services/gpupool/", "JUPYTERHUB_SERVICE_NAME": "gpupool",
                        "JUPYTERHUB_CLIENT_ID": "service-gpupool", "JUPYTERHUB_BASE_URL": "/",
                        "JUPYTERHUB_OAUTH_CALLBACK_URL": "/services/gpupool/oauth_callback"}.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("configured, seconds", [(None, 30), ("45s", 45), ("2m", 120), (0.5, 1)])
def test_the_configured_cache_age_is_hubauths(hub_environment, configured, seconds):
    """HubAuth's own default (300 s) let a revoked hub token keep working at the pool for
    five minutes; c.GPUPool.hub_auth_cache_max_age (30 s) bounds it."""
    config = Config() if configured is None else Config({"GPUPool": {"hub_auth_cache_max_age": configured}})
    service = GPUPool(config=config)
    authenticator, web_settings = hub_service.authentication(AGENT_TOKEN, service.base_url,
                                                             service.hub_auth_cache_max_age)
    assert authenticator.hub_auth.cache_max_age == seconds
    assert web_settings["hub_auth"] is authenticator.hub_auth
    assert authenticator.hub_auth.cache.max_age == seconds  # the cache user_for_token reads
