"""The address a service binds and the URL kernels and agents use are separate
(``configure(c, public_url=...)``, ``c.GPUPool.public_url``); plain HTTP across hosts is
warned about (TLS is the documented default there)."""

from __future__ import annotations

import json

import pytest
from traitlets import TraitError
from traitlets.config import Config

from hubprocs import resolved
from gpupool.hub_plugin.hub import configure, service_url
from procs import start_service


def test_configure_gives_kernels_the_public_url_not_the_bind_address(tmp_path):
    config_file = tmp_path / "jupyterhub_config.py"
    config_file.write_text("# test\n")
    c = Config()
    service = configure(c, ip="0.0.0.0", port=8765, public_url="https://hub.example.org:8765/ignored/path",
                        config_file=config_file)
    assert "--ip=0.0.0.0" in service["command"] and "--port=8765" in service["command"]
    assert service["url"] == "https://hub.example.org:8765"  # where the proxy forwards /services/gpupool/
    assert resolved(c.Spawner.environment, {})["GPUPOOL_URL"] == "https://hub.example.org:8765/services/gpupool"
    assert c.GPUPool.public_url == "https://hub.example.org:8765/services/gpupool/"
    # Without one: the bound address, a wildcard read as loopback (one host only).
    c2 = Config()
    configure(c2, ip="0.0.0.0", port=9999, config_file=config_file)
    assert resolved(c2.Spawner.environment, {})["GPUPOOL_URL"] == "http://127.0.0.1:9999/services/gpupool"
    with pytest.raises(ValueError, match="public_url"):
        service_url("0.0.0.0", 1, "hub.example.org:8765")


def test_service_writes_its_public_url_and_warns_of_plain_http(tmp_path):
    from gpupool.hub_plugin.config import GPUPool

    with pytest.raises(TraitError, match="public_url"):
        GPUPool(public_url="ftp://x")
    assert GPUPool(public_url="https://pool.example.org:8765").public_url == "https://pool.example.org:8765/"
    svc = start_service(tmp_path, config={"public_url": "http://pool.example.org:8765/"}, ip="0.0.0.0")
    try:
        info = json.loads((svc.state_dir / "service.json").read_text())
        assert info["public_url"] == "http://pool.example.org:8765/"
        assert info["url"].startswith("http://127.0.0.1:")  # this host's own way in, for its local clients
        log = svc.log.read_text()
        assert f"listening on http://0.0.0.0:{info['url'].rsplit(':', 1)[1]} " in log  # what it binds
        assert "kernels and agents use http://pool.example.org:8765/" in log
        assert "plain HTTP" in log and "--ssl-cert" in log
    finally:
        svc.stop()
