"""Each lease's cell activity, recorded from the agents' heartbeats
(``gpupool simulate --from-store`` replays a pool's own cells)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select

from gpupool.hub_plugin import cell_log
from gpupool.hub_plugin.db import Store
from gpupool.hub_plugin.models import Lease, LeaseCell
from gpupool.hub_plugin.simulate.store import load_store
from gpupool.schema import isoformat
from gpupool.wire.leases import LeaseRequest
from gpupool.wire.nodes import WorkerReport
from procs import start_agent, start_service, wait_for
from workercell import run_worker_cell

T0 = datetime(2026, 3, 1, 9, tzinfo=timezone.utc)


def at(seconds: float | None) -> str | None:
    return None if seconds is None else isoformat(T0 + timedelta(seconds=seconds))


# Heartbeats in order: (seconds since the lease started, state, cell_started, idle_since, cells that ended),
# then the cells recorded so far as (start, end or None).
TABLE = [
    ((1, "idle", None, 0, ()), []),  # no cell yet
    ((5, "busy", 3, None, ()), [(3, None)]),  # a cell runs
    ((6, "busy", 3, None, ()), [(3, None)]),  # the same cell
    ((9, "idle", 3, 8, ((3, 8),)), [(3, 8)]),  # it ended
    ((10, "idle", 3, 8, ((3, 8),)), [(3, 8)]),  # told again: nothing new
    ((20, "idle", 12, 15, ((3, 8), (12, 15))), [(3, 8), (12, 15)]),  # started and ended between two heartbeats
    ((30, "busy", 25, None, ((3, 8), (12, 15))), [(3, 8), (12, 15), (25, None)]),
    # three cells between two heartbeats: two ended, the third runs
    ((40, "busy", 37, None, ((12, 15), (25, 31), (31, 35))), [(3, 8), (12, 15), (25, 31), (31, 35), (37, None)]),
    ((45, "busy", 42, None, ()), [(3, 8), (12, 15), (25, 31), (31, 35), (37, 42), (42, None)]),  # an agent before
    # ``cells``: the open one's end went unseen, so it ends where the next began
    ((50, "idle", 99, 120, ()), [(3, 8), (12, 15), (25, 31), (31, 35), (37, 42), (42, 50), (50, 50)]),  # a clock
    # ahead of the service's: kept to now
    ((60, "busy", None, None, ()), [(3, 8), (12, 15), (25, 31), (31, 35), (37, 42), (42, 50), (50, 50)]),  # no times
]


@pytest.fixture
def store(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/pool.sqlite")
    store.migrate()
    with store.write() as db:
        db.add(Lease(id="L-000000000001", owner="ann", state="active", fraction=0.5, gpu_count=1, memory=10**9,
                     idle_timeout=600, heartbeat_ttl=60, created_at=T0, started_at=T0, usage_gpu_seconds=0.0))
    yield store
    store.close()


def cells(db) -> list[tuple]:
    rows = db.scalars(select(LeaseCell).order_by(LeaseCell.started_at, LeaseCell.id))
    return [((c.started_at - T0).total_seconds(), None if c.ended_at is None else (c.ended_at - T0).total_seconds())
            for c in rows]


def test_each_heartbeat_records_the_cells_it_tells_of(store):
    for (now, state, started, idle_since, ended), expected in TABLE:
        with store.write() as db:
            lease = db.get(Lease, "L-000000000001")
            report = WorkerReport("L-000000000001", 42, state, idle_since=at(idle_since), cell_started=at(started),
                                  cells=tuple((at(a), at(b)) for a, b in ended))
            cell_log.record(db, lease, report, T0 + timedelta(seconds=now))
        with store.read() as db:
            assert cells(db) == expected, (now, state, started, idle_since, ended)
    with store.write() as db:  # the lease ends while nothing runs: nothing changes
        cell_log.close(db, db.get(Lease, "L-000000000001"), T0 + timedelta(seconds=70))
    with store.read() as db:
        assert cells(db)[-1] == (50, 50)


def test_a_cell_that_runs_to_the_leases_end_ends_with_it(store):
    with store.write() as db:
        lease = db.get(Lease, "L-000000000001")
        cell_log.record(db, lease, WorkerReport(lease.id, 42, "busy", cell_started=at(3)), T0 + timedelta(seconds=5))
        cell_log.close(db, lease, T0 + timedelta(seconds=70))
    with store.read() as db:
        assert cells(db) == [(3, 70)] and not db.get(Lease, "L-000000000001").cell_open


def test_a_real_pool_records_the_cells_a_worker_ran_and_simulate_replays_them(tmp_path):
    """A real service and agent with node heartbeats every 5 s: three cells of about 0.6 s on a lease's
    worker, one after another between two heartbeats, then its release; the store then holds all
    three, and the store's replay has them."""
    service = start_service(tmp_path, config={"heartbeat_ttl": 30.0, "node_heartbeat_interval": 5.0})
    agent = start_agent(tmp_path, service)
    try:
        client = service.client()
        lease = client.create_lease(LeaseRequest(fraction=0.25))
        lease = client.get_lease(lease.id, wait=30, state="starting")
        assert lease.state.value == "active", lease
        for _ in range(3):
            asyncio.run(run_worker_cell(lease.connection, "import time; time.sleep(0.6)"))
        url = f"sqlite:///{service.state_dir / 'gpupool.sqlite'}"
        store = Store(url)
        try:
            def recorded():
                with store.read() as db:
                    return [c for c in cells_of(db, lease.id) if c[1] is not None]
            ran = wait_for(lambda: len(recorded()) == 3 and recorded(), 15, "three recorded cells")
        finally:
            store.close()
        assert all(0.5 <= (end - start).total_seconds() <= 2.0 for start, end in ran), ran
        client.release(lease.id)
        history = load_store(url)
        durations = sorted(c.duration for c in history.workload.cells)
        assert len(durations) == 3 and all(0.5 <= d <= 2.0 for d in durations), durations
    finally:
        agent.stop()
        service.stop()


def cells_of(db, lease_id: str) -> list[tuple]:
    rows = db.scalars(select(LeaseCell).where(LeaseCell.lease_id == lease_id).order_by(LeaseCell.id))
    return [(c.started_at, c.ended_at) for c in rows]
