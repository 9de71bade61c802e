"""Park in place in the store (revision 0011) and the service's park path
against it, on SQLite and PostgreSQL (``GPUPOOL_TEST_POSTGRES_URL``): the
migration keeps what was there (running leases hold their share since they
started; the ledger becomes one row per span) and comes back down; then the
service's own objects (:class:`~gpupool.hub_plugin.pool.Pool`, its clock
moved by hand) over a store with a node whose agent address refuses
connections: what cannot be parked is refused or released in words, a
parked lease's release ends it at once, its kernel's heartbeats still
count, a resume the agent cannot do leaves it parked, a service restart
picks up a resume half-done, and parked leases count against ``max_gpus``.
"""

from __future__ import annotations

import asyncio
import socket
from datetime import datetime, timedelta, timezone

import pytest
import stores
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError

from gpupool.errors import GPUPoolError
from gpupool.schema import LeaseState

GiB = 1024**3
T0 = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)


def test_revision_0011_keeps_what_was_there_and_comes_back_down(store_url):
    from alembic import command

    from gpupool.hub_plugin.db import Store
    from gpupool.hub_plugin.migrations import config, upgrade
    from gpupool.hub_plugin.models import Lease, Node, UsageRecord

    store = Store(store_url)
    lease_row = ("INSERT INTO leases (id, owner, state, fraction, gpu_count, memory, idle_timeout, heartbeat_ttl, "
                 "created_at, started_at, ended_at, usage_gpu_seconds) VALUES (:id, 'ann', :state, 0.5, 1, 1024, 60, "
                 "60, '2026-12-01 11:00:00', :started, :ended, 0)")
    try:
        with store.engine.begin() as connection:
            upgrade(connection, "0010")
            for lease_id, state, started, ended in (("L-000000000001", "active", "2026-12-01 12:00:00", None),
                                                    ("L-000000000002", "released", "2026-12-01 12:00:00",
                                                     "2026-12-01 13:00:00"),
                                                    ("L-000000000003", "queued", None, None)):
                connection.execute(text(lease_row), {"id": lease_id, "state": state, "started": started,
                                                     "ended": ended})
            connection.execute(text("INSERT INTO usage_ledger (lease_id, owner, gpus, started_at, ended_at, "
                                    "gpu_seconds) VALUES ('L-000000000002', 'ann', 0.5, '2026-12-01 12:00:00', "
                                    "'2026-12-01 13:00:00', 1800)"))
            connection.execute(text("INSERT INTO nodes (name, url, inventory, state, registered_at, "
                                    "last_heartbeat_at) VALUES ('n', 'http://127.0.0.1:9', 'simulated', 'up', "
                                    "'2026-12-01 11:00:00', '2026-12-01 11:00:00')"))
        store.migrate()
        with store.read() as session:
            rows = {x.id: x for x in session.scalars(select(Lease))}
            assert rows["L-000000000001"].held_since == datetime(2026, 12, 1, 12, tzinfo=timezone.utc)
            assert rows["L-000000000002"].held_since is None and rows["L-000000000003"].held_since is None
            assert {x.on_idle for x in rows.values()} == {"park"} and {x.parked_seconds for x in rows.values()} == {0}
            assert all(x.park_tier is None and x.resume_requested_at is None for x in rows.values())
            node = session.get(Node, "n")
            assert (node.checkpointer, node.parked_memory) == (None, None)  # an agent from before parking
        with store.write() as session:  # a second span of the same lease is a row of its own
            session.add(UsageRecord(lease_id="L-000000000002", owner="ann", gpus=0.5,
                                    started_at=datetime(2026, 12, 1, 12, 30, tzinfo=timezone.utc),
                                    ended_at=datetime(2026, 12, 1, 12, 40, tzinfo=timezone.utc), gpu_seconds=300))
        with pytest.raises(IntegrityError):  # the same span twice is not
            with store.write() as session:
                session.add(UsageRecord(lease_id="L-000000000002", owner="ann", gpus=0.5,
                                        started_at=datetime(2026, 12, 1, 12, 30, tzinfo=timezone.utc),
                                        ended_at=datetime(2026, 12, 1, 12, 35, tzinfo=timezone.utc), gpu_seconds=150))
        with store.engine.begin() as connection:
            cfg = config()
            cfg.attributes["connection"] = connection
            command.downgrade(cfg, "0010")
            ledger = connection.execute(text("SELECT lease_id, gpu_seconds FROM usage_ledger")).all()
            assert [tuple(row) for row in ledger] == [("L-000000000002", 2100.0)], "spans summed into one row"
            assert "held_since" not in {c["name"] for c in __import__("sqlalchemy").inspect(connection)
                                        .get_columns("leases")}
        store.migrate()  # and up again
    finally:
        store.close()


# -- the service's park path, in-process ------------------------------------------------------------------------

@pytest.fixture
def refused_port():
    """A port nothing listens on: an agent that cannot be reached answers at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


@pytest.fixture
def store(request, tmp_path, refused_port):
    """A migrated store (SQLite; PostgreSQL too where set) with node n (one GPU G-0, a checkpointer
    that remaps unless the test says otherwise) and node old (an agent from before parking)."""
    from gpupool.hub_plugin.db import Store
    from gpupool.hub_plugin.models import GPU, Node

    store = Store(f"sqlite:///{tmp_path}/park.sqlite")
    store.migrate()
    with store.write() as session:
        for name, checkpointer in (("n", {"name": "simulated", "mid_cell": True, "remap": True}), ("old", None)):
            session.add(Node(name=name, url=f"http://127.0.0.1:{refused_port}", inventory="simulated", state="up",
                             registered_at=T0, last_heartbeat_at=T0, checkpointer=checkpointer,
                             host_cpus=8.0, host_memory=64 * GiB,
                             gpus=[GPU(uuid=f"G-{name}", name="A100", index=0, memory_total=80 * GiB,
                                       memory_reserved=0, healthy=True)]))
    yield store
    store.close()


def add(store, lease_id: str, *, state: str = "active", node: str = "n", **more) -> None:
    from gpupool.hub_plugin.models import Lease, LeaseGPU

    with store.write() as session:
        session.add(Lease(**{"id": lease_id, "owner": "ann", "state": state, "fraction": 1.0, "gpu_count": 1,
                             "memory": 70 * GiB, "node_name": node, "idle_timeout": 60, "heartbeat_ttl": 600,
                             "created_at": T0, "started_at": T0, "held_since": T0, "last_heartbeat_at": T0,
                             "usage_gpu_seconds": 0.0, "groups": [], "worker_state": "idle", "idle_since": T0,
                             "cpus": 8.0, "host_memory": 64 * GiB, "connection": {"key": "k"},
                             "gpus": [LeaseGPU(gpu_uuid=f"G-{node}", name="A100", index=0)], **more}))


def get(store, lease_id: str):
    from sqlalchemy.orm import selectinload

    from gpupool.hub_plugin.models import Lease

    with store.read() as session:
        return session.get(Lease, lease_id, options=[selectinload(Lease.events)])


def in_pool(store, clock, body, settings=None):
    """Run ``body(pool)`` (a coroutine function) on a Pool over ``store`` at ``clock["now"]``."""
    return stores.in_pool(store, body, lambda: clock["now"], settings)


def ann():
    from gpupool.hub_plugin.auth import Identity

    return Identity("ann")


def test_a_lease_on_a_node_that_cannot_park_is_refused_or_released_and_an_unanswered_park_keeps_it(store):
    from gpupool.hub_plugin.rules.reclaim import ParkCode

    add(store, "L-00000000000a", node="old")
    add(store, "L-00000000000b")
    clock = {"now": T0 + timedelta(seconds=30)}

    async def body(pool):
        with pytest.raises(GPUPoolError) as refused:
            await pool.parking.park_by(ann(), "L-00000000000a")
        assert (refused.value.code, refused.value.status) == ("cannot_park", 409)
        assert "the agent on old cannot park in place (it reports no checkpointer" in refused.value.message
        # The idle sweep releases it as it did before parking existed (its node is not parkable) ...
        clock["now"] = T0 + timedelta(seconds=61)
        decisions = await pool.reclaimer().sweep()
        assert {(d.lease_id, d.state) for d in decisions} == {("L-00000000000a", LeaseState.reclaimed),
                                                               ("L-00000000000b", LeaseState.parked)}
        await asyncio.sleep(0.5)
        # ... and an idle park whose agent does not answer (nothing listens here; its node is not lost)
        # keeps the lease active, in words: an agent restarting re-adopts the worker, and a sweep asks again.
        return await pool.parking.park("L-00000000000b", ParkCode.idle, "idle for 1m")

    outcome = in_pool(store, clock, body)
    assert outcome.kind == "failed"
    old, new = get(store, "L-00000000000a"), get(store, "L-00000000000b")
    assert (old.state, old.reclaim_code) == ("reclaimed", "idle")
    assert (new.state, new.reclaim_code) == ("active", None)
    assert [e.state for e in new.events][-4:] == ["parking", "active", "parking", "active"]  # the sweep's, then ours
    assert new.events[-1].reason.startswith("not parked: it could not be parked in place (the node agent at "
                                            "http://127.0.0.1:"), new.events[-1].reason
    assert new.events[-1].reason.endswith("; it is parked once its agent answers"), new.events[-1].reason
    assert new.park_tier is None, "no park is left behind"


def test_a_parked_lease_ends_at_once_and_its_heartbeats_count(store):
    from gpupool.hub_plugin.capacity import allocations, host_states

    add(store, "L-00000000000c", state="parked", held_since=None, park_tier="memory", park_code="idle",
        park_reason="idle for 1m", parked_at=T0, parked_host_bytes=3 * GiB, gpu_bytes_kept=GiB, usage_gpu_seconds=60.0)
    with store.read() as session:  # what it holds while parked: its kept GPU bytes, its host RAM, no share
        assert allocations(session)["G-n"].fraction == 0.0 and allocations(session)["G-n"].memory == GiB
        assert host_states(session)["n"].memory_parked == 3 * GiB
    clock = {"now": T0 + timedelta(seconds=50)}

    async def body(pool):
        beat = await pool.leases.heartbeat(ann(), "L-00000000000c")
        assert beat["state"] == "parked" and beat["parked"]["tier"] == "memory"
        assert beat["connection"] == {"key": "k"}, "the notebook keeps its connection to the frozen worker"
        clock["now"] = T0 + timedelta(seconds=640)  # past the TTL counted from its start, not from that heartbeat
        assert await pool.reclaimer().sweep() == []
        await pool.leases.release_by(ann(), "L-00000000000c", None)

    in_pool(store, clock, body)
    lease = get(store, "L-00000000000c")
    assert lease.state == "released" and [e.state for e in lease.events] == ["releasing", "released"]
    assert lease.usage_gpu_seconds == 60.0, "no GPU-seconds for the time parked"
    assert lease.parked_seconds == 640.0 and lease.connection is None
    assert "its worker was not confirmed stopped" in lease.reason  # the agent was unreachable: said after the end
    with store.read() as session:
        assert allocations(session).get("G-n") is None and host_states(session)["n"].memory_parked == 0


def test_a_resume_the_agent_cannot_do_leaves_the_lease_parked(store):
    add(store, "L-00000000000d", state="parked", held_since=None, park_tier="memory", park_code="owner",
        park_reason="parked by its owner", parked_at=T0, parked_host_bytes=GiB)
    clock = {"now": T0 + timedelta(seconds=10)}

    async def body(pool):
        waiting = await pool.parking.resume_by(ann(), "L-00000000000d")
        assert waiting["state"] in ("parked", "starting")
        for _ in range(100):  # placed at once (its GPU is free), then the agent is not there
            await asyncio.sleep(0.05)
            if get(store, "L-00000000000d").events[-1].state == "parked":
                break

    in_pool(store, clock, body)
    lease = get(store, "L-00000000000d")
    assert [e.state for e in lease.events] == ["starting", "parked"]
    assert lease.state == "parked" and lease.resume_requested_at is None
    assert lease.events[-1].reason.startswith("its resume on n failed (the node agent at http://127.0.0.1:")
    assert lease.events[-1].reason.endswith("it stays parked: resume again to retry")
    assert lease.park_tier == "memory", "still parked, its figures kept"
    assert (lease.parked_at, lease.parked_seconds) == (T0, 0.0), "parked since T0: the park's end counts it"


def test_a_service_restart_picks_up_a_resume_half_done(store):
    """A lease placed to resume when the service stopped (``starting`` with its park) is resumed, not started:
    the agent's resume is asked for (here it cannot be reached, so it stays parked)."""
    add(store, "L-00000000000e", state="starting", held_since=None, park_tier="memory", park_code="idle",
        park_reason="idle for 1m", parked_at=T0, parked_host_bytes=GiB)
    clock = {"now": T0 + timedelta(seconds=5)}

    async def body(pool):
        await pool.resume()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if get(store, "L-00000000000e").state == "parked":
                break

    in_pool(store, clock, body)
    lease = get(store, "L-00000000000e")
    assert lease.state == "parked" and "its resume on n failed" in lease.events[-1].reason


def test_parked_leases_count_against_max_gpus(store):
    from gpupool.hub_plugin.config import PoolQuotas, ServiceSettings
    from gpupool.wire.leases import LeaseRequest

    add(store, "L-00000000000f", state="parked", held_since=None, park_tier="memory", parked_at=T0,
        parked_host_bytes=GiB, fraction=0.5)
    clock = {"now": T0}

    async def body(pool):
        with pytest.raises(GPUPoolError) as refused:
            await pool.intake.create(ann(), LeaseRequest(fraction=1.0).to_json())
        return refused.value

    refused = in_pool(store, clock, body, ServiceSettings(quotas=PoolQuotas(quotas={"*": {"max_gpus": 1}})))
    assert (refused.code, refused.extra["limit"]) == ("quota_exceeded", "max_gpus")
    assert refused.message == ("quota exceeded: you hold 0.50 of 1.00 GPU; requested 1.00 (0.50 of it in parked "
                               "leases, which keep their GPUs' worth; release one you no longer need); ask for at most 0.50")


def test_a_parked_lease_claims_its_gpu_so_a_new_lease_goes_elsewhere(store):
    """The service's placement keeps a parked lease's share free while other room fits: node n's GPU
    holds a parked lease (its share claimed, its kept GiB held), node old's is free, so a new whole-GPU
    lease goes to old; once the parked lease ends its claim goes with it (the index is told)."""
    from gpupool.hub_plugin.capacity import gpu_states
    from gpupool.hub_plugin.placing import Placer
    from gpupool.hub_plugin.rules.scheduler import Demand, Placement

    add(store, "L-00000000000f", state="parked", held_since=None, park_tier="memory", park_code="idle",
        park_reason="idle for 1m", parked_at=T0, parked_host_bytes=GiB, gpu_bytes_kept=GiB)
    with store.read() as session:
        claimed = {g.uuid: g for g in gpu_states(session, 0)}["G-n"]
    assert (claimed.allocated_fraction, claimed.allocated_memory) == (0.0, GiB)
    assert (claimed.parked_fraction, claimed.parked_memory) == (1.0, 69 * GiB)
    clock = {"now": T0 + timedelta(seconds=10)}

    async def body(pool):
        placer = Placer(pool.state)  # the pool's own capacity index, as its intake and queue use it

        def decide():  # on the writer thread, as the intake decides
            with pool.state.writing() as tx:
                return placer.place(tx.session, Demand(1.0))
        first = await pool.state.work.write(decide)
        await pool.leases.release_by(ann(), "L-00000000000f", None)
        return first, await pool.state.work.write(decide)

    first, after = in_pool(store, clock, body)
    assert isinstance(first, Placement) and first.gpus == ("G-old",), first
    assert isinstance(after, Placement) and after.gpus == ("G-n",), "by name once nothing is claimed"


def test_the_pool_view_counts_a_claim_other_leases_took_apart_from_free(store):
    """A lease placed when no other room fit takes the room a parked lease claims: ``GET /pool`` shows
    that part of the claim as not free now (``parked_unbacked``), so no GPU looks more than full and
    ``totals.parked`` stays a part of ``totals.free``; the pool table says so in words."""
    from gpupool.hub_plugin.views import pool_json
    from gpupool.tables import allocated_cell, pool_table

    park = {"state": "parked", "held_since": None, "park_tier": "memory", "park_code": "idle",
            "park_reason": "idle for 1m", "parked_at": T0, "parked_host_bytes": GiB, "fraction": 0.5}
    add(store, "L-00000000000f", **park)  # n: its half claimed, then a whole-GPU lease took the GPU
    add(store, "L-000000000010", owner="bob")
    add(store, "L-000000000011", node="old", **park)  # old: a quarter of its half still free
    add(store, "L-000000000012", node="old", owner="bob", fraction=0.75)
    with store.read() as session:
        shown = pool_json(session, 0)
    gpus = {g["uuid"]: g for node in shown["nodes"] for g in node["gpus"]}
    assert [(gpus[u]["allocated_fraction"], gpus[u]["parked_fraction"], gpus[u]["parked_unbacked"])
            for u in ("G-n", "G-old")] == [(1.0, 0.5, 0.5), (0.75, 0.5, 0.25)]
    assert shown["totals"] == {"gpus": 2, "allocated": 1.75, "free": 0.25, "parked": 0.25, "parked_unbacked": 0.75}
    assert shown["totals"]["parked"] <= shown["totals"]["free"], "docs/api.md: parked is a part of free"
    assert [allocated_cell(gpus[u]) for u in ("G-n", "G-old")] == [
        "1.00 (0.50 parked, not free now)", "0.75 + 0.25 parked (0.25 more parked, not free now)"]
    text = pool_table(shown)[0]
    assert "1.00 (0.50 parked, not free now)" in text and "1.00 + 0.50 parked" not in text, text


def test_a_new_batch_request_goes_off_the_node_a_persons_resume_waits_for(store):
    """A person's parked lease waits to resume on node n: a new batch request whose first choice is n
    goes to node old instead, and is refused with words when old has no room either."""
    from gpupool.hub_plugin.placing import Placer
    from gpupool.hub_plugin.rules.scheduler import Demand, Placement, Refusal

    add(store, "L-00000000000f", state="parked", held_since=None, park_tier="memory", park_code="preempted",
        park_reason="preempted", parked_at=T0, parked_host_bytes=GiB, lease_class="interactive",
        resume_requested_at=T0, fraction=0.5)
    clock = {"now": T0 + timedelta(seconds=10)}

    async def body(pool):
        placer = Placer(pool.state)

        def decide():  # on the writer thread, as the intake decides
            with pool.state.writing() as tx:
                on_n = placer.pool(tx.session).place_off(Demand(0.5), {"old"})
                return on_n, placer.for_batch(tx.session, on_n, Demand(0.5), clock["now"], yields=False,
                                              headroom_nodes=0)
        return await pool.state.work.write(decide)

    on_n, moved = in_pool(store, clock, body)
    assert isinstance(on_n, Placement) and on_n.node == "n"
    assert isinstance(moved, Placement) and moved.node == "old", moved
    add(store, "L-000000000010", node="old")  # old's GPU taken whole
    _, refused = in_pool(store, clock, body)
    assert isinstance(refused, Refusal), refused
    assert refused.message == ("batch request not placed: node n is held for a person's request that waits for "
                               "room there, and no other node has room")
