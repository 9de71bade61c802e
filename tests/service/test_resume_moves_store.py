"""A move in the store (revision 0013, ``c.PoolLeases.resume_moves``), with the service's
own objects over a store whose agents cannot be reached (their addresses refuse connections): a
resume that finds no room on its node is placed on another node, and a move whose new agent
cannot be reached goes back ``parked`` on its old node with its old GPUs, the new node's share
free again (the move through the old node's disk, whose failure the same words say:
tests/service/test_resume_moves.py); with moves off it waits; the old node's reports of a moving lease are not stopped until
the move ends. The move with real agents: tests/service/test_resume_moves.py."""

from __future__ import annotations

import asyncio
import socket
from datetime import datetime, timedelta, timezone

import pytest
import stores

GiB = 1024**3
T0 = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)
PARKED = "L-0000000000a1"


@pytest.fixture
def store(tmp_path):
    """Nodes n1 and n2, one A100 each, agents that refuse connections; on n1 a lease parked in memory
    (a whole GPU) whose GPU another lease now holds."""
    from gpupool.hub_plugin.db import Store
    from gpupool.hub_plugin.models import GPU, Lease, LeaseGPU, Node

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    store = Store(f"sqlite:///{tmp_path}/moves.sqlite")
    store.migrate()
    with store.write() as session:
        for name in ("n1", "n2"):
            session.add(Node(name=name, url=f"http://127.0.0.1:{port}/{name}", inventory="simulated", state="up",
                             registered_at=T0, last_heartbeat_at=T0,
                             checkpointer={"name": "simulated", "mid_cell": True, "remap": True},
                             gpus=[GPU(uuid=f"G-{name}", name="A100", index=0, memory_total=80 * GiB,
                                       memory_reserved=0, healthy=True)]))
        session.flush()
        common = {"owner": "ann", "fraction": 1.0, "gpu_count": 1, "memory": 70 * GiB, "node_name": "n1",
                  "idle_timeout": 600, "heartbeat_ttl": 600, "created_at": T0, "started_at": T0,
                  "last_heartbeat_at": T0, "usage_gpu_seconds": 0.0, "groups": [], "worker_state": "idle",
                  "idle_since": T0, "connection": {"key": "k"}}
        session.add(Lease(id=PARKED, state="parked", park_tier="memory", park_code="owner",
                          park_reason="parked by its owner", parked_at=T0, parked_host_bytes=GiB,
                          gpus=[LeaseGPU(gpu_uuid="G-n1", name="A100", index=0)], **common))
        session.add(Lease(id="L-0000000000b1", state="active", held_since=T0,
                          gpus=[LeaseGPU(gpu_uuid="G-n1", name="A100", index=0)], **{**common, "owner": "bob"}))
    yield store
    store.close()


def get(store, lease_id: str):
    from sqlalchemy.orm import selectinload

    from gpupool.hub_plugin.models import Lease

    with store.read() as session:
        return session.get(Lease, lease_id, options=[selectinload(Lease.events), selectinload(Lease.gpus)])


def in_pool(store, body, **leases):
    """Run ``body(pool)`` 10 s after T0 with ``leases`` settings (``c.PoolLeases``)."""
    from gpupool.hub_plugin.config import PoolLeases, PoolNodes, ServiceSettings

    settings = ServiceSettings(nodes=PoolNodes(worker_stop_timeout=2.0, node_ttl=3600), leases=PoolLeases(**leases))
    return stores.in_pool(store, body, lambda: T0 + timedelta(seconds=10), settings)


def ann():
    from gpupool.hub_plugin.auth import Identity

    return Identity("ann")


def free_on(store) -> dict[str, float]:
    from gpupool.hub_plugin.capacity import gpu_states

    with store.read() as session:
        return {g.uuid: round(g.allocated_fraction + g.parked_fraction, 3) for g in gpu_states(session, 0)}


async def move_fails(pool, store) -> None:
    """Resume PARKED: it is placed on n2 at once, then n2's agent is not there to take it."""
    await pool.parking.resume_by(ann(), PARKED)
    for _ in range(100):
        await asyncio.sleep(0.05)
        if get(store, PARKED).events[-1].state == "parked":
            return


def test_a_move_whose_new_agent_cannot_be_reached_goes_back_parked_on_its_old_node(store):
    """No disk helps a move whose new node's agent cannot be reached: the lease is parked again on n1, in
    memory, at once (the move through n1's disk is not tried)."""
    async def body(pool):
        await move_fails(pool, store)

    in_pool(store, body)
    lease = get(store, PARKED)
    assert [e.state for e in lease.events] == ["starting", "parked"]
    assert lease.events[0].reason == ("moving to n2 (GPU 0 (A100)): n1 has no room; its state goes from its worker on "
                                      "n1 to a new worker on n2, worker to worker (what cannot be moved is named)")
    assert lease.events[1].reason.startswith("its move to n2 failed (the node agent at http://127.0.0.1:"), \
        lease.events[1].reason
    assert "/n2/workers/L-0000000000a1/resume could not be reached" in lease.events[1].reason, lease.events[1].reason
    assert lease.events[1].reason.endswith("it stays parked on n1: resume again to retry")
    assert (lease.state, lease.node_name, [g.gpu_uuid for g in lease.gpus]) == ("parked", "n1", ["G-n1"])
    assert lease.moved_from is None and lease.resume_requested_at is None and lease.park_tier == "memory"
    assert free_on(store) == {"G-n1": 2.0, "G-n2": 0.0}, "its claim back on n1, n2's share free again"


def test_without_moves_a_resume_waits_for_its_own_node(store):
    async def body(pool):
        return await pool.parking.resume_by(ann(), PARKED)

    shown = in_pool(store, body, resume_moves=False)
    assert shown["state"] == "parked" and shown["parked"]["resume_requested"] is True
    lease = get(store, PARKED)
    assert lease.events == [] and lease.node_name == "n1"
    assert free_on(store) == {"G-n1": 2.0, "G-n2": 0.0}


def test_a_resume_asked_ahead_of_a_cell_waits_for_its_own_node_until_a_cell_asks(store):
    """The JupyterLab extension asks a resume in place when the user is back at the notebook: a move
    would lose what cannot be saved to disk before any cell needs the worker, so it waits for n1
    though n2 is free (the words and ``may_move`` say so); a cell's resume (no ``in_place``) since
    moves it, and an in-place ask after that does not take the move back."""
    async def ahead(pool):
        return await pool.parking.resume_by(ann(), PARKED, in_place=True)

    shown = in_pool(store, ahead)
    assert shown["state"] == "parked" and shown["parked"]["resume_requested"] is True
    assert shown["parked"]["may_move"] is False, "the lease JSON says it waits for its own node"
    assert get(store, PARKED).events == [] and free_on(store) == {"G-n1": 2.0, "G-n2": 0.0}

    async def a_cell(pool):
        await pool.parking.resume_by(ann(), PARKED, in_place=True)
        await pool.parking.resume_by(ann(), PARKED)
        return await pool.parking.resume_by(ann(), PARKED, in_place=True)

    shown = in_pool(store, a_cell)
    lease = get(store, PARKED)
    assert lease.events and lease.events[0].reason.startswith("moving to n2 "), [e.reason for e in lease.events]
    assert lease.resume_in_place is False


def test_a_park_asked_of_a_parked_lease_withdraws_its_resume_in_line(store):
    """``POST /leases/{id}/park`` on a parked lease whose resume waits for room (an interrupted
    ``%gpu release`` sends it): the resume leaves the queue, and the lease stays parked on n1."""
    async def body(pool):
        await pool.parking.resume_by(ann(), PARKED, in_place=True)
        return await pool.parking.park_by(ann(), PARKED)

    shown = in_pool(store, body)
    assert shown["state"] == "parked" and shown["parked"]["resume_requested"] is False
    assert shown.get("queue_position") is None
    lease = get(store, PARKED)
    assert (lease.resume_requested_at, lease.resume_in_place, lease.node_name) == (None, False, "n1")


def test_a_cell_frozen_mid_way_waits_for_its_own_node_instead_of_moving(store):
    """A preempted lease parked in memory with its cell frozen mid-way (its worker busy): a move's
    spill would interrupt that cell, so it waits for n1 though n2 is free, and goes on where it was."""
    from gpupool.hub_plugin.models import Lease

    with store.write() as session:
        frozen = session.get(Lease, PARKED)
        frozen.worker_state, frozen.park_code = "busy", "preemption"

    async def body(pool):
        return await pool.parking.resume_by(ann(), PARKED)

    shown = in_pool(store, body)
    assert shown["state"] == "parked" and shown["parked"]["resume_requested"] is True
    assert shown["parked"]["may_move"] is False, "the lease JSON says it waits for its own node"
    assert get(store, PARKED).events == [] and free_on(store) == {"G-n1": 2.0, "G-n2": 0.0}


def test_the_old_nodes_reports_of_a_moving_lease_are_left_alone_until_the_move_ends(store):
    from gpupool.hub_plugin.models import Lease, LeaseGPU, Node
    from gpupool.hub_plugin.nodes import NodeBook
    from gpupool.wire.nodes import WorkerReport

    with store.write() as session:
        lease = session.get(Lease, PARKED)
        lease.state, lease.node_name = "starting", "n2"
        lease.moved_from = {"node": "n1", "gpus": [{"uuid": "G-n1", "name": "A100", "index": 0}]}
        lease.gpus = [LeaseGPU(gpu_uuid="G-n2", name="A100", index=0)]
    spilled = WorkerReport(PARKED, None, "dead", parked="disk", parked_host_bytes=0)

    async def body(pool):
        def beat():
            with pool.state.writing() as tx:
                return NodeBook._apply_reports(tx, tx.session.get(Node, "n1"), [spilled], T0)

        moving = await pool.state.work.write(beat)
        with store.write() as session:
            session.get(Lease, PARKED).moved_from = None  # the move ended
        return moving, await pool.state.work.write(beat)

    moving, moved = in_pool(store, body)
    assert moving == ([], []), "its spill waits there for the new node to fetch it"
    assert moved == ([PARKED], []), "a spill left behind is stopped by the old node's agent"


def test_a_failed_move_keeps_the_time_the_lease_was_parked(store):
    """"parked for" (the lease JSON's ``parked.since``, which ``%gpu status`` and ``gpupool status``
    count from) stays the park's, not the failed move's; ``parked_seconds`` counts the park once
    at its end, the failed try included."""
    from gpupool.hub_plugin.config import PoolLeases, PoolNodes, ServiceSettings
    from gpupool.tables import parked_words
    from gpupool.wire.leases import Lease

    clock = {"now": T0 + timedelta(seconds=600)}

    async def body(pool):
        await move_fails(pool, store)
        clock["now"] = T0 + timedelta(seconds=900)
        shown = await pool.views.get(ann(), PARKED)
        await pool.leases.release_by(ann(), PARKED, None)
        return shown

    settings = ServiceSettings(nodes=PoolNodes(worker_stop_timeout=2.0, node_ttl=3600), leases=PoolLeases())
    shown = stores.in_pool(store, body, lambda: clock["now"], settings)
    assert [e["state"] for e in shown["events"]] == ["starting", "parked"], shown["events"]
    assert shown["parked"]["since"].startswith("2026-12-02T12:00:00"), shown["parked"]
    words = parked_words(Lease.from_json(shown), now=T0 + timedelta(seconds=900))
    assert words.startswith("parked in memory on n1 for 15m "), words
    lease = get(store, PARKED)
    assert lease.state == "released" and lease.parked_seconds == 900.0, lease.parked_seconds


def test_a_moving_lease_holds_its_host_memory_on_its_old_node_until_its_spill(store):
    """Between a move's placement (``starting`` on n2 at once) and its end, the parked worker still holds
    its host RAM on n1: n1's host counts it as parked bytes (placement, ``GET /pool``), n2 its new host
    reservation. n2's agent here accepts the connection and never answers, so the move never ends."""
    from gpupool.hub_plugin.capacity import host_states
    from gpupool.hub_plugin.models import Lease, Node
    from gpupool.hub_plugin.views import pool_json

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # never accepted: the spill's call waits
    with store.write() as session:
        for name in ("n1", "n2"):
            node = session.get(Node, name)
            node.host_cpus, node.host_memory = 16.0, 256 * GiB
        session.get(Node, "n2").url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        session.get(Lease, PARKED).parked_host_bytes = 3 * GiB

    async def body(pool):
        await pool.parking.resume_by(ann(), PARKED)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if get(store, PARKED).state == "starting":
                break
        await asyncio.sleep(0.3)  # the move is asked of n2 (and never answered)
        moving = get(store, PARKED)
        with store.read() as session:
            seen = moving, host_states(session), pool_json(session, 0)
        silent.close()  # the waiting call is reset: the move fails, back parked on n1
        for _ in range(100):
            await asyncio.sleep(0.05)
            if get(store, PARKED).state == "parked":
                break
        return seen

    try:
        moving, hosts, shown = in_pool(store, body)
    finally:
        silent.close()
    assert (moving.state, moving.node_name, moving.moved_from["node"]) == ("starting", "n2", "n1")
    assert (hosts["n1"].memory_parked, hosts["n1"].memory_allocated) == (3 * GiB, 3 * GiB), \
        "its frozen worker's RAM still on n1"
    assert hosts["n2"].memory_parked == 0 and hosts["n2"].memory_allocated == moving.host_memory, \
        "n2 counts the new host reservation only"
    assert {n["name"]: n["parked_host_bytes"] for n in shown["nodes"]} == {"n1": 3 * GiB, "n2": 0}
    with store.read() as session:
        assert get(store, PARKED).state == "parked" and host_states(session)["n1"].memory_parked == 3 * GiB, \
            "back parked on n1, where it is counted as any parked lease"


def test_a_moves_spill_gives_its_old_nodes_host_memory_back(store):
    """Once the move's spill is recorded (:func:`parked.spilled`), n1 counts the moving lease's RAM no more, and
    the capacity index (its change set names n1's GPUs) sees it too."""
    from gpupool.hub_plugin import parked
    from gpupool.hub_plugin.capacity import host_states
    from gpupool.hub_plugin.models import Lease, LeaseGPU, Node
    from gpupool.hub_plugin.rules.workload import DEFAULT_WORKLOAD
    from gpupool.wire.parking import WorkerParked

    with store.write() as session:
        for name in ("n1", "n2"):
            node = session.get(Node, name)
            node.host_cpus, node.host_memory = 16.0, 256 * GiB
        lease = session.get(Lease, PARKED)
        lease.state, lease.node_name, lease.parked_host_bytes = "starting", "n2", 3 * GiB
        lease.moved_from = {"node": "n1", "gpus": [{"uuid": "G-n1", "name": "A100", "index": 0}]}
        lease.gpus = [LeaseGPU(gpu_uuid="G-n2", name="A100", index=0)]

    async def body(pool):
        def index_host():
            with pool.state.writing() as tx:
                return pool.state.capacity.get(tx.session, DEFAULT_WORKLOAD).hosts["n1"].memory_parked

        before = await pool.state.work.write(index_host)

        def spill():
            with pool.state.writing() as tx:
                parked.spilled(tx, tx.session.get(Lease, PARKED), WorkerParked("disk", disk_bytes=GiB))

        await pool.state.work.write(spill)
        return before, await pool.state.work.write(index_host)

    before, after = in_pool(store, body)
    assert (before, after) == (3 * GiB, 0)
    with store.read() as session:
        assert host_states(session)["n1"].memory_parked == 0


@pytest.mark.parametrize(("remap", "moves", "room"), [
    (False, False, (0,)),  # its own GPU only
    (True, False, (0, 1)),  # then its node's other A100
    (False, True, (0, 3)),  # then the other nodes' A100s (an H100 is no room for its arrays)
    (True, True, (0, 1, 3)),
])
def test_a_resume_in_line_is_estimated_over_the_gpus_it_may_take(remap, moves, room):
    """``queue_estimate_s`` of a parked lease's resume counts the GPUs the sweep may give it: with
    ``resume_moves``, other nodes' GPUs of its model after its own node's."""
    from types import SimpleNamespace

    from gpupool.hub_plugin.config import PoolNodes, PoolPressure
    from gpupool.hub_plugin.pressure import EtaInputs, Pressure

    pressure = Pressure(PoolPressure(), PoolNodes(), None)
    pressure._eta = EtaInputs(gpus={"g0": (0, "n1", "A100"), "g1": (1, "n1", "A100"), "g2": (2, "n2", "H100"),
                                    "g3": (3, "n2", "A100")})
    lease = SimpleNamespace(gpus=[SimpleNamespace(gpu_uuid="g0", name="A100")], node_name="n1")
    assert pressure.resume_room(lease, remap, moves) == room
