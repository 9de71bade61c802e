"""A worker start whose node's agent cannot be reached (``agent_unreachable``) is not the
request's fault: the lease is placed on another node with room, or queued again in its
place, each node tried once (hub_plugin/replacing.py). A real ``gpupool service`` on
SQLite, real agents (one killed with SIGKILL before its heartbeats stop, so its node is
still ``up``) and, for nodes that are only addresses, registrations at a port where
nothing listens."""

from __future__ import annotations

import signal
from datetime import datetime

import pytest
from procs import free_port, start_agent, start_service, wait_for
from service_api import gpu_allocations, http, register, wait_ended, wait_state

from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest


@pytest.fixture
def two_nodes(tmp_path):
    """A service (nodes never lost by silence here) with node-1 (one A100, no warm workers:
    nothing is left behind when its agent is killed) and node-2 (one H100), both up."""
    svc = start_service(tmp_path, config={"node_ttl": 3600})
    agents = [start_agent(tmp_path, svc, name="node-1", simulate="1xA100-80GB", extra_args=["--warm-workers=0"])]
    try:
        agents.append(start_agent(tmp_path, svc, name="node-2", simulate="1xH100-80GB"))
        yield svc, agents[0], agents[1]
    finally:
        for agent in reversed(agents):
            agent.stop()
        svc.stop()


def kill_agent(agent) -> None:
    """SIGKILL: no last heartbeat saying it leaves, so the service still has its node ``up``."""
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait()


def node_states(svc) -> dict[str, str]:
    return {node["name"]: node["state"] for node in svc.client().pool()["nodes"]}


def fill_the_live_node(svc):
    """node-2's one GPU (its H100) taken by an active lease, so only node-1 has room; returns that lease."""
    filler = svc.client().create_lease(LeaseRequest(fraction=1.0, model="H100"))
    assert wait_state(svc, filler.id, "starting").state is LeaseState.active
    return filler


def test_a_lease_placed_on_a_dead_agent_starts_on_another_node(two_nodes):
    svc, dead, _ = two_nodes
    kill_agent(dead)
    assert node_states(svc) == {"node-1": "up", "node-2": "up"}
    client = svc.client()
    lease = client.create_lease(LeaseRequest(fraction=0.5))  # node-1 first: the emptier GPU ties, by name
    lease = wait_state(svc, lease.id, "starting")
    assert lease.state is LeaseState.active, lease.reason
    assert lease.node == "node-2" and lease.connection is not None
    placed, again, active = lease.events
    assert (placed["state"], placed["reason"]) == ("starting", "placed on node-1: GPU 0 (NVIDIA A100-SXM4-80GB)")
    assert again["state"] == "starting"
    assert again["reason"].startswith(f"the worker could not start on node-1: the node agent at {dead.url}/workers "
                                      "could not be reached"), again["reason"]
    assert again["reason"].endswith("; placed on node-2: GPU 0 (NVIDIA H100 80GB HBM3)"), again["reason"]
    assert active["state"] == "active"
    # No GPU time for the start that failed: its span begins at the start on node-2.
    assert datetime.fromisoformat(lease.started_at) >= datetime.fromisoformat(again["at"])
    assert node_states(svc) == {"node-1": "lost", "node-2": "up"}  # its agent refused: nothing new goes there
    assert gpu_allocations(svc) == [0.0, 0.5]  # node-1's share given back, node-2's taken
    ended = client.release(lease.id)
    assert ended.state is LeaseState.released and ended.usage_gpu_seconds > 0
    assert gpu_allocations(svc) == [0.0, 0.0]


def test_with_no_other_room_it_waits_in_its_place_and_starts_when_room_frees(two_nodes):
    svc, dead, _ = two_nodes
    client = svc.client()
    filler = fill_the_live_node(svc)
    kill_agent(dead)
    lease = client.create_lease(LeaseRequest(fraction=0.5, wait=600))
    assert lease.state is LeaseState.starting and lease.node == "node-1"  # the only room
    queued = wait_state(svc, lease.id, "starting")
    assert queued.state is LeaseState.queued, queued.reason
    why = queued.events[-1]["reason"]  # a lease's own reason is its end's
    assert why.startswith("the worker could not start on node-1: "), why
    assert "back in the queue, in its place" in why and "(nodes tried: node-1)" in why, why
    assert queued.created_at == lease.created_at and queued.wait_until == lease.wait_until  # its place, its wait
    assert queued.queue_position == 1 and queued.node is None and queued.gpus == []
    assert gpu_allocations(svc) == [0.0, 1.0]  # nothing held on the dead node while it waits
    client.release(filler.id)
    started = wait_state(svc, lease.id, "queued")
    assert started.state is LeaseState.starting or started.state is LeaseState.active, started.reason
    started = wait_state(svc, lease.id, "starting")
    assert (started.state, started.node) == (LeaseState.active, "node-2"), started.reason
    assert client.release(lease.id).usage_gpu_seconds > 0


def test_without_a_wait_and_no_other_room_it_fails_naming_the_node(two_nodes):
    svc, dead, _ = two_nodes
    client = svc.client()
    filler = fill_the_live_node(svc)
    kill_agent(dead)
    lease = client.create_lease(LeaseRequest(fraction=0.5))
    ended = wait_ended(svc, lease.id)
    assert ended.state is LeaseState.failed
    assert ended.reason.startswith(f"the worker could not start on node-1: the node agent at {dead.url}/workers "
                                   "could not be reached"), ended.reason
    assert "no other node has room for it now and it asked not to wait (nodes tried: node-1)" in ended.reason
    assert ended.usage_gpu_seconds == 0 and ended.started_at is None
    assert gpu_allocations(svc) == [0.0, 1.0]
    client.release(filler.id)


def test_each_node_is_tried_once(service):
    """Nodes whose agents are not running (nothing listens at their URLs, their nodes still
    ``up``): a request tries each once. Without a wait it then fails; with one it waits, and a
    node the queue places it on again that refuses again ends it, naming the nodes tried."""
    gone = {name: f"http://127.0.0.1:{free_port()}" for name in ("node-a", "node-b")}
    for name, url in gone.items():
        register(service, name, gpus=1, url=url)
    client = service.client()
    first = wait_ended(service, client.create_lease(LeaseRequest(fraction=0.5)).id)
    assert first.state is LeaseState.failed
    assert first.reason.startswith("the worker could not start on node-b: "), first.reason
    assert "it asked not to wait (nodes tried: node-a, node-b)" in first.reason, first.reason
    assert [e["reason"].split(": ")[0] for e in first.events if e["state"] == "starting"] == [
        "placed on node-a", "the worker could not start on node-a"]
    assert node_states(service) == {"node-a": "lost", "node-b": "lost"}

    lease = client.create_lease(LeaseRequest(fraction=0.5, wait=600))
    assert lease.state is LeaseState.queued  # no node is up

    def heartbeat_then_queued_again(name: str, tried: str) -> None:
        assert http(service, "POST", f"/nodes/{name}/heartbeat", {"workers": []}, token="agent")[0] == 200
        wait_for(lambda: (seen := client.get_lease(lease.id)).state is LeaseState.queued
                 and f"(nodes tried: {tried})" in seen.events[-1]["reason"], 30, f"queued again after {tried}")

    heartbeat_then_queued_again("node-a", "node-a")  # back up: the queue places it there, refused again
    heartbeat_then_queued_again("node-b", "node-a, node-b")
    assert http(service, "POST", "/nodes/node-a/heartbeat", {"workers": []}, token="agent")[0] == 200
    ended = wait_ended(service, lease.id)
    assert ended.state is LeaseState.failed
    assert ended.reason.startswith(f"the worker could not start on node-a: the node agent at {gone['node-a']}"), \
        ended.reason
    assert ended.reason.endswith("; node-a was tried before (nodes tried: node-a, node-b)"), ended.reason
    assert ended.usage_gpu_seconds == 0 and gpu_allocations(service) == [0.0, 0.0]
