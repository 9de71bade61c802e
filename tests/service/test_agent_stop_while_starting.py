"""An agent stopped (SIGTERM: ``systemctl restart gpupool-agent``, an upgrade) while a new lease's
worker is still starting there (docs/parking.md, "Agent restarts"): nothing of the user's was on
the node yet, so the lease does not fail; it goes back to the queue, ahead of newer requests, and is
placed again: once its node's agent is back, or at once on another node with room. A real ``gpupool
service`` and real agents on simulated GPUs; the worker's start is made slow by a worker environment
whose Python waits before it runs.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
from procs import start_agent, start_service
from service_api import wait_state

from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest

pytestmark = pytest.mark.timeout(240)

#: Seconds a worker of the slow environment waits before its kernel starts.
SLOW_S = 12


def slow_python(folder: Path) -> Path:
    """A Python whose kernels start ``SLOW_S`` seconds late (the agent's probe of it runs at once)."""
    folder.mkdir(parents=True, exist_ok=True)
    python = folder / "slow-python"
    python.write_text(f'#!/bin/sh\n[ "$1" = "-c" ] || sleep {SLOW_S}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def slow_config(folder: Path, python: Path | None = None) -> Path:
    """An agent config whose default worker environment, ``slow``, is :func:`slow_python`
    (or ``python``: the same name where workers start at the usual speed)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "agent_config.py"
    where = str(python or slow_python(folder))
    config.write_text(f"c = get_config()\nc.AgentWorkers.environments = {{'slow': {where!r}}}\n"
                      "c.AgentWorkers.default_environment = 'slow'\n")
    return config


def test_a_lease_starting_on_an_agent_stopped_meanwhile_is_queued_again_and_starts_once_it_is_back(tmp_path):
    """SIGTERM to the agent while the lease's worker starts: the lease is ``queued`` again (not
    ``failed``), saying why, and ``active`` once the agent runs again on its folder and port."""
    svc = start_service(tmp_path, config={"node_ttl": 3.0, "heartbeat_ttl": 600.0})
    args = ["--transport-encryption=none", "--warm-workers=0", f"--config={slow_config(tmp_path / 'slow')}"]
    agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=args)
    client = svc.client()
    try:
        lease = client.create_lease(LeaseRequest(fraction=0.5, idle_timeout=600))
        assert lease.state is LeaseState.starting, lease.events
        time.sleep(2)  # the agent is starting the worker
        port = int(agent.url.rsplit(":", 1)[1])
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.stop() == 0  # waits for it; raises if a worker's process survived
        again = client.get_lease(lease.id)
        assert again.state is LeaseState.queued, again.events
        said = again.events[-1]["reason"]
        assert "its node node-1's agent stopped while its worker started; queued again, in its place" in said, said
        assert again.connection is None and again.node is None, again
        agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=args, port=port)
        started = wait_state(svc, lease.id, "queued", timeout=30)
        started = wait_state(svc, lease.id, "starting", timeout=60)
        assert started.state is LeaseState.active, started.events
        client.release(lease.id)
    finally:
        agent.stop()
        svc.stop()


def test_a_lease_starting_on_an_agent_stopped_meanwhile_starts_on_another_node(tmp_path):
    """The same stop with a second node that has room: the lease is placed there at once and
    becomes ``active`` on it; the worker the stopping agent started meanwhile is not its worker."""
    svc = start_service(tmp_path, config={"node_ttl": 3.0, "heartbeat_ttl": 600.0})
    base = ["--transport-encryption=none", "--warm-workers=0"]
    agents = [start_agent(tmp_path, svc, simulate="1xA100-80GB",
                          extra_args=[*base, f"--config={slow_config(tmp_path / 'slow')}"])]
    client = svc.client()
    try:
        lease = client.create_lease(LeaseRequest(fraction=0.5, idle_timeout=600))
        assert lease.state is LeaseState.starting and lease.node == "node-1", lease.events
        fast = slow_config(tmp_path / "fast", Path(sys.executable))
        agents.append(start_agent(tmp_path, svc, name="node-2", simulate="1xA100-80GB",
                                  extra_args=[*base, f"--config={fast}"]))
        agents[0].proc.send_signal(signal.SIGTERM)
        assert agents[0].stop() == 0
        moved = client.get_lease(lease.id)
        for state in ("queued", "starting"):
            moved = wait_state(svc, lease.id, state, timeout=60)
        assert moved.state is LeaseState.active and moved.node == "node-2", moved.events
        # Never active on node-1: the stopping agent answers the start 503 agent_stopping, not 201 for a
        # worker it then stops (the notebook would attach to it, and fail).
        states = [e["state"] for e in moved.events]
        assert states == ["starting", "queued", "starting", "active"], moved.events
        queued = moved.events[states.index("queued")]["reason"]
        assert "its node node-1's agent stopped while its worker started; queued again" in queued, queued
        client.release(lease.id)
    finally:
        for agent in agents:
            agent.stop()
        svc.stop()
