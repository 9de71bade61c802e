"""The service's settings classes (``c.GPUPool``, ``c.PoolNodes``, ``c.PoolLeases``,
``c.PoolPressure``, ``c.PoolQuotas``): each listed with its own settings, and a
moved setting written the old way (``c.GPUPool.idle_timeout``) still read, with
a warning that names the new spelling."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest

from gpupool import demo_pool
from gpupool.errors import GPUPoolError
from gpupool.hub_plugin import app as service_app
from gpupool.hub_plugin.app import ServiceApp
from gpupool.hub_plugin.config import GPUPool, PoolLeases, PoolNodes, PoolPressure, PoolQuotas
from gpupool.moved_settings import new_homes
from gpupool.wire.leases import LeaseRequest

MOVED = new_homes([PoolNodes, PoolLeases, PoolPressure, PoolQuotas])
OLD_IDLE_TIMEOUT = ("c.GPUPool.idle_timeout is now c.PoolLeases.idle_timeout; the old spelling is read for now, "
                    "please change it")


@pytest.fixture
def service(monkeypatch, caplog):
    """``initialize(argv)`` of a ServiceApp that logs to ``caplog`` (and leaves the
    ``gpupool`` logger of this process alone); returns the app."""
    monkeypatch.setattr(service_app, "_setup_logging", lambda level: None)
    caplog.set_level(logging.WARNING, logger="test.service_settings")

    def initialize(*argv: str) -> ServiceApp:
        app = ServiceApp()
        app.log = logging.getLogger("test.service_settings")
        app.initialize(list(argv))
        return app

    return initialize


def test_an_old_spelling_in_the_config_file_is_read_by_its_new_class(service, caplog, tmp_path):
    config = tmp_path / "jupyterhub_config.py"  # under JupyterHub the service reads the hub's file
    config.write_text('c.GPUPool.idle_timeout = "1h"\nc.GPUPool.base_url = "/services/gpupool"\n')
    app = service(f"--config={config}", f"--state-dir={tmp_path}")
    assert app.settings.leases.idle_timeout == 3600.0
    assert app.settings.service.base_url == "/services/gpupool/"  # a GPUPool setting stays where it is
    assert caplog.messages == [OLD_IDLE_TIMEOUT]


def test_an_old_spelling_on_the_command_line_is_read_by_its_new_class(service, caplog, tmp_path):
    app = service("--GPUPool.max_wait=2h", "--GPUPool.quotas={'*': {'max_gpus': 1}}", f"--state-dir={tmp_path}")
    assert app.settings.leases.max_wait == 7200.0
    assert app.settings.quotas.quotas == {"*": {"max_gpus": 1.0}}
    assert sorted(caplog.messages) == [
        "c.GPUPool.max_wait is now c.PoolLeases.max_wait; the old spelling is read for now, please change it",
        "c.GPUPool.quotas is now c.PoolQuotas.quotas; the old spelling is read for now, please change it"]


def test_the_command_line_beats_the_file_whichever_the_spelling(service, caplog, tmp_path):
    config = tmp_path / "gpupool_config.py"
    config.write_text('c.GPUPool.idle_timeout = "1h"\nc.PoolLeases.heartbeat_ttl = "2m"\n')
    app = service(f"--config={config}", "--PoolLeases.idle_timeout=10m", "--GPUPool.heartbeat_ttl=30",
                  f"--state-dir={tmp_path}")
    assert (app.settings.leases.idle_timeout, app.settings.leases.heartbeat_ttl) == (600.0, 30.0)
    assert "c.GPUPool.idle_timeout is now c.PoolLeases.idle_timeout, which is also set: c.GPUPool.idle_timeout " \
           "is ignored" in caplog.messages


def test_an_idle_timeout_above_the_maximum_stops_the_start_naming_both(service, tmp_path):
    config = tmp_path / "gpupool_config.py"
    config.write_text('c.PoolLeases.max_idle_timeout = "2h"\nc.GPUPool.idle_timeout = "3h"\n')
    with pytest.raises(GPUPoolError) as refused:
        service(f"--config={config}", f"--state-dir={tmp_path}")
    assert refused.value.message == ("c.PoolLeases.idle_timeout (10800s) is above c.PoolLeases.max_idle_timeout "
                                     f"(7200s) (set in {config})")


@pytest.mark.parametrize("tokens, words", [
    ({"abc-token-of-nobody": ""}, "c.GPUPool.api_tokens: a token's user name must be 1 to 200 characters, not "
                                  "blank, got ''"),
    ({"abc-token-of-blank": "  "}, "a token's user name must be 1 to 200 characters, not blank, got '  '"),
    ({"abc-token-of-long": "a" * 201}, "a token's user name must be 1 to 200 characters"),
    ({"": "ann"}, "c.GPUPool.api_tokens: a token is empty (for user 'ann')"),
])
def test_a_token_of_no_user_stops_the_start(service, tmp_path, tokens, words):
    """An empty user name was accepted, and refused only at the first worker start (its owner)."""
    config = tmp_path / "gpupool_config.py"
    config.write_text(f"c.GPUPool.api_tokens = {tokens!r}\n")
    with pytest.raises(GPUPoolError) as refused:
        service(f"--config={config}", f"--state-dir={tmp_path}")
    assert words in refused.value.message and refused.value.message.endswith(f"(set in {config})")
    assert not any(token and token in refused.value.message for token in tokens)  # a token is a secret


def test_a_service_started_with_an_old_spelling_runs_with_it_and_says_the_new_one(tmp_path):
    config = tmp_path / "gpupool_config.py"
    config.write_text('c.GPUPool.idle_timeout = "1h"\n')
    service = demo_pool.start_service(tmp_path / "service", config_file=config)
    try:
        # No node: the request waits, with the idle timeout the service gives a lease that names none.
        lease = service.client().create_lease(LeaseRequest(fraction=0.5, wait=60))
        assert (lease.state.value, lease.idle_timeout) == ("queued", 3600.0)
    finally:
        assert service.stop() == 0
    assert OLD_IDLE_TIMEOUT in service.log.read_text()


def test_each_class_lists_its_own_settings_once():
    text = ServiceApp().generate_config_file()
    settings = re.findall(r"^# c\.(\w+)\.(\w+) =", text, re.M)
    assert settings.count(("PoolQuotas", "quotas")) == 1
    assert sorted(name for cls, name in settings if cls == "GPUPool") == sorted(
        GPUPool.class_trait_names(config=True))
    assert {name: cls for cls, name in settings if name in MOVED} == MOVED


def test_help_all_lists_each_class_with_its_own_settings():
    shown = subprocess.run([sys.executable, "-m", "gpupool.cli", "service", "--help-all"], capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    options = re.findall(r"^--(\w+)\.(\w+)=", shown.stdout, re.M)
    assert options.count(("PoolQuotas", "quotas")) == 1
    assert [name for cls, name in options if cls == "GPUPool" and name in MOVED] == []
    for cls in ("GPUPool", "PoolNodes", "PoolLeases", "PoolPressure", "PoolQuotas"):
        assert f"{cls}(Configurable) options" in shown.stdout
