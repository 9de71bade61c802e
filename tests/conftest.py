"""Fixtures named for what they give: a running pool service and agents, the
store's databases. The helpers they and the tests share live in tests/support/
(on ``sys.path`` by pyproject.toml's ``pythonpath``)."""

from __future__ import annotations

import uuid

import pytest

from frontend import install_kernelspec, start_gpupool_kernel
from procs import start_agent, start_service
from stores import postgres_url, store_url  # noqa: F401 (fixtures for every test)
from worker_account import python_reachable, shared_root  # noqa: F401 (fixtures for every test)

from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest


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


@pytest.fixture
def busy_pool(tmp_path):
    """A service (users tester and ann; requests may queue 10 min; Prometheus's token,
    ``service.metrics_token``, in a file) and an agent whose two GPUs tester holds
    whole: ``(service, [the two active leases])``."""
    metrics_token = tmp_path / "metrics_token"
    metrics_token.write_text(uuid.uuid4().hex + "\n")
    svc = start_service(tmp_path, tokens={"ann": "ann-" + uuid.uuid4().hex},
                        config={"max_wait": "10m", "metrics_token_file": str(metrics_token)})
    svc.metrics_token = metrics_token.read_text().strip()
    agent = start_agent(tmp_path, svc)
    try:
        client = svc.client()
        holders = [client.create_lease(LeaseRequest(fraction=1.0)) for _ in range(2)]
        holders = [client.get_lease(lease.id, wait=60, state="starting") for lease in holders]
        assert [lease.state for lease in holders] == [LeaseState.active] * 2
        yield svc, holders
    finally:
        agent.stop()
        svc.stop()


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


@pytest.fixture(scope="module")
def e2e_pool(tmp_path_factory):
    """Service (heartbeat TTL 3 s), one agent with 2 simulated A100s and the gpupool
    kernelspec installed for it: ``(service, agent, kernels dir)``, shared by a test module."""
    root = tmp_path_factory.mktemp("e2e")
    service = start_service(root, config={"heartbeat_ttl": 3.0})
    agent = start_agent(root, service)
    kernels = install_kernelspec(root / "prefix", service.url, service.user_token)
    yield service, agent, kernels
    agent.stop()
    service.stop()


@pytest.fixture
def kernel(e2e_pool, tmp_path):
    """A notebook kernel on the gpupool kernelspec: ``(km, kc)``; shut down after."""
    km, kc = start_gpupool_kernel(e2e_pool[2], tmp_path)
    yield km, kc
    kc.stop_channels()
    if km.is_alive():
        km.shutdown_kernel(now=False)
