"""What the tests of cold moves share: a service with two one-A100 nodes (``two_nodes``,
``two_nodes_beating``), the workers' simulated GPU memory in a folder of the test's own
(``simgpu_root``), a lease acquired or awaited, and a gpupool kernel on the pool."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from frontend import install_kernelspec, run, start_gpupool_kernel
from jupyter_client import KernelManager
from procs import start_agent, start_service
from service_api import wait_state
from statuscomm import StatusComm

from gpupool.schema import LeaseState
from gpupool.wire.leases import Lease, LeaseRequest

AGENT_ARGS = ["--transport-encryption=none", "--warm-workers=0"]
#: A state of 400 MiB, a value and a lock: its move takes long enough to be caught in the middle.
BIG_STATE = ("import numpy as np, threading\nbig = np.random.default_rng(0).integers(0, 255, 400 * 2**20, "
             "dtype=np.uint8)\nx = 41\nlock = threading.Lock()\nprint('set')")


@pytest.fixture
def simgpu_root():
    """The workers' simulated GPU memory, in a folder of this test's own (removed after)."""
    root = Path("/dev/shm") / f"gpupool-test-moves-{uuid.uuid4().hex[:8]}"
    was = os.environ.get("GPUPOOL_SIMGPU_ROOT")
    os.environ["GPUPOOL_SIMGPU_ROOT"] = str(root)
    yield root
    if was is None:
        os.environ.pop("GPUPOOL_SIMGPU_ROOT", None)
    else:
        os.environ["GPUPOOL_SIMGPU_ROOT"] = was
    shutil.rmtree(root, ignore_errors=True)


@contextmanager
def two_node_pool(tmp_path: Path, node_2_args: tuple[str, ...] = (), **config) -> Iterator[tuple]:
    """A service (leases and nodes never lost by silence here; more ``config``) with node-1 and
    node-2, one A100 each, both up (node-2's agent with ``node_2_args`` more)."""
    svc = start_service(tmp_path, config={"node_ttl": 3600, "heartbeat_ttl": 600, "worker_stop_timeout": 5.0,
                                          **config})
    agents = []
    try:
        agents.append(start_agent(tmp_path, svc, name="node-1", simulate="1xA100-80GB", extra_args=AGENT_ARGS))
        agents.append(start_agent(tmp_path, svc, name="node-2", simulate="1xA100-80GB",
                                  extra_args=[*AGENT_ARGS, *node_2_args]))
        yield svc, agents[0], agents[1]
    finally:
        for agent in reversed(agents):
            agent.stop()
        svc.stop()


@pytest.fixture
def two_nodes(tmp_path, simgpu_root):
    with two_node_pool(tmp_path) as pool:
        yield pool


@pytest.fixture
def two_nodes_beating(request, tmp_path, simgpu_root):
    """:func:`two_node_pool` with agents heartbeating every ``request.param`` seconds (indirect), not
    the tests' 0.2 s: what changes on a node between two beats is not reported in between."""
    with two_node_pool(tmp_path, node_heartbeat_interval=request.param) as pool:
        yield pool


def acquire(svc, **request) -> Lease:
    lease = wait_state(svc, svc.client().create_lease(LeaseRequest(**{"fraction": 1.0, **request})).id, "starting")
    assert lease.state is LeaseState.active, lease.reason
    return lease


def until(svc, lease_id: str, state: str, timeout: float = 90) -> Lease:
    client = svc.client()
    deadline = time.monotonic() + timeout
    lease = client.get_lease(lease_id)
    while lease.state.value != state and not lease.state.ended and time.monotonic() < deadline:
        lease = client.get_lease(lease_id, wait=min(10, deadline - time.monotonic()), state=lease.state.value)
    assert lease.state.value == state, (lease.state, lease.reason, lease.events)
    return lease


@contextmanager
def notebook(svc, tmp_path: Path) -> Iterator[tuple[KernelManager, StatusComm]]:
    """A gpupool kernel on ``svc``'s pool: ``(km, a front end's status comm open on it)``; its lease
    given up after."""
    kernels = install_kernelspec(tmp_path / "prefix", svc.url, svc.user_token)
    km, kc = start_gpupool_kernel(kernels, tmp_path)
    try:
        yield km, StatusComm(kc)
    finally:
        run(kc, "%gpu release --discard")
        kc.stop_channels()
        km.shutdown_kernel(now=True)
