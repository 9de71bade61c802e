"""Fixtures named for what they give: a running pool service and agents."""

from __future__ import annotations

import pytest

from procs import start_agent, start_service


@pytest.fixture
def service(tmp_path):
    """A fresh ``gpupool service`` (SQLite under tmp_path), stopped after the test."""
    svc = start_service(tmp_path)
    yield svc
    svc.stop()


@pytest.fixture
def agent(tmp_path, service):
    """One agent with two simulated A100-80GB GPUs registered with ``service``."""
    node = start_agent(tmp_path, service)
    yield node
    node.stop()


@pytest.fixture
def pool(service, agent):
    """A ready pool: ``(service, agent)``."""
    return service, agent


@pytest.fixture(scope="session")
def jupyterhub(tmp_path_factory):
    """A real JupyterHub running deploy/jupyterhub/jupyterhub_config.py (proxy, pool
    service and agent as managed services), shared by the hub tests, with the
    servers of ann and bob starting (``hub.wait_server(user)``); skipped with
    the reason when jupyterhub or configurable-http-proxy is missing."""
    import hubprocs

    why = hubprocs.missing()
    if why:
        pytest.skip(why)
    hub = hubprocs.start_hub(tmp_path_factory.mktemp("jupyterhub"), servers=("ann", "bob"))
    yield hub
    hub.stop()
