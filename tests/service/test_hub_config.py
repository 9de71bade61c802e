"""``configure(c)`` for jupyterhub_config.py, and identities from hub user models
(pure: no hub running)."""

from __future__ import annotations

import asyncio

import pytest
from traitlets.config import Config

from hubprocs import resolved
from gpupool.errors import GPUPoolError
from gpupool.hub_plugin.auth import identity_from_hub_model
from gpupool.hub_plugin.hub import ADMIN_SCOPE, USE_SCOPE, configure


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "jupyterhub_config.py"
    path.write_text("# test\n")
    return path


def test_configure_wires_service_scopes_roles_tokens_env_and_hook(config_file, tmp_path):
    c = Config()
    c.JupyterHub.load_roles = [{"name": "mine", "scopes": ["read:users"]}]
    service = configure(c, port=9999, config_file=config_file, admin_group="gpu-admins", admin_users=["root"],
                        quotas={"*": {"max_gpus": 1}})
    assert c.GPUPool.base_url == "/services/gpupool/"
    assert c.PoolQuotas.quotas == {"*": {"max_gpus": 1}}
    assert service["url"] == "http://127.0.0.1:9999"
    assert service["command"][-4:] == [f"--config={config_file}", "--ip=127.0.0.1", "--port=9999",
                                       f"--state-dir={tmp_path / 'gpupool-state'}"]
    assert (tmp_path / "gpupool-state" / "hub_service_token").read_text().strip() == service["api_token"]
    assert set(resolved(c.JupyterHub.custom_scopes, {})) == {USE_SCOPE, ADMIN_SCOPE}
    roles = {role["name"]: role for role in resolved(c.JupyterHub.load_roles, [])}
    assert set(roles) == {"mine", "user", "gpupool-admin"}  # extended, not replaced
    assert roles["user"]["scopes"] == ["self", f"{USE_SCOPE}!user", "access:services!service=gpupool"]
    assert roles["gpupool-admin"]["groups"] == ["gpu-admins"] and roles["gpupool-admin"]["users"] == ["root"]
    assert c.Spawner.server_token_scopes == ["users:activity!user", "access:servers!server", f"{USE_SCOPE}!user"]
    assert resolved(c.Spawner.environment, {})["GPUPOOL_URL"] == "http://127.0.0.1:9999/services/gpupool"
    assert callable(c.Spawner.post_stop_hook)


def test_configure_keeps_existing_server_scopes_and_hook(config_file):
    c = Config()
    c.Spawner.server_token_scopes = ["users:activity!user", "read:users:name!user"]
    seen = []
    c.Spawner.post_stop_hook = seen.append
    configure(c, config_file=config_file, user_groups=["physics"])
    assert c.Spawner.server_token_scopes == ["users:activity!user", "read:users:name!user", f"{USE_SCOPE}!user"]
    roles = {role["name"]: role for role in resolved(c.JupyterHub.load_roles, [])}
    assert "user" not in roles and roles["gpupool-users"]["groups"] == ["physics"]

    class Spawner:  # what the hook reads of a JupyterHub Spawner
        name = ""
        log = __import__("logging").getLogger("test")

    spawner = Spawner()
    spawner.user = type("User", (), {"name": "ann", "spawners": {"": spawner}})()
    spawner.active = False
    # The service is not running: the hook logs and returns, after the previous hook ran.
    asyncio.run(c.Spawner.post_stop_hook(spawner))
    assert seen == [spawner]


@pytest.mark.parametrize(("scopes", "admin"), [
    ([f"{USE_SCOPE}!user=ann"], False),
    ([USE_SCOPE], False),
    ([ADMIN_SCOPE, f"{USE_SCOPE}!user=ann"], True),
])
def test_identity_from_filtered_scopes(scopes, admin):
    who = identity_from_hub_model({"kind": "user", "name": "ann", "groups": ["physics", "b"], "scopes": scopes})
    assert (who.name, who.admin, who.groups) == ("ann", admin, ("b", "physics"))


@pytest.mark.parametrize("model", [
    {"kind": "user", "name": "ann", "groups": [], "scopes": [f"{USE_SCOPE}!user=bob"]},
    {"kind": "user", "name": "ann", "groups": [], "scopes": ["read:users:name!user=ann"]},
    {"kind": "service", "name": "x", "scopes": [USE_SCOPE]},
])
def test_identity_refused_without_the_scope_for_this_user(model):
    with pytest.raises(GPUPoolError) as err:
        identity_from_hub_model(model)
    assert err.value.status == 403
