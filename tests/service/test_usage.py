"""The usage ledger: periods in a time zone (pure), sums from the store with
the clock moved by hand, and each lease closed exactly once, also when a
release races a reclaim."""

from __future__ import annotations

import asyncio
from datetime import date, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from gpupool.hub_plugin import usage
from gpupool.hub_plugin.usage import DAY, WEEK, Interval, daily, overlap_gpu_seconds, period

UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")
GiB = 1024**3


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@pytest.mark.parametrize("now, tz, kind, start, end", [
    ("2026-03-02 00:00", UTC, DAY, "2026-03-02 00:00", "2026-03-03 00:00"),
    ("2026-03-01 23:30", BERLIN, DAY, "2026-03-01 23:00", "2026-03-02 23:00"),  # already Monday in Berlin
    ("2026-03-01 22:30", BERLIN, DAY, "2026-02-28 23:00", "2026-03-01 23:00"),
    ("2026-03-04 12:00", UTC, WEEK, "2026-03-02 00:00", "2026-03-09 00:00"),  # weeks start Monday
    ("2026-03-01 23:30", BERLIN, WEEK, "2026-03-01 23:00", "2026-03-08 23:00"),
    ("2026-03-01 23:30", UTC, WEEK, "2026-02-23 00:00", "2026-03-02 00:00"),
    ("2026-10-25 12:00", BERLIN, DAY, "2026-10-24 22:00", "2026-10-25 23:00"),  # 25 hours: summer time ends
])
def test_periods(now, tz, kind, start, end):
    assert period(at(now), tz, kind) == (at(start), at(end))


def test_a_lease_across_midnight_counts_in_both_days():
    # 22:00-23:30 UTC is 23:00-00:30 in Berlin (UTC+1 in March): 1 h on Sunday, 30 min on Monday there.
    lease = [Interval(0.5, at("2026-03-01 22:00"), at("2026-03-01 23:30"))]
    assert daily(lease, BERLIN, date(2026, 3, 1), 2) == {date(2026, 3, 1): 0.5 * 3600, date(2026, 3, 2): 0.5 * 1800}
    assert daily(lease, UTC, date(2026, 3, 1), 2) == {date(2026, 3, 1): 0.5 * 5400, date(2026, 3, 2): 0.0}
    assert overlap_gpu_seconds(lease, *period(at("2026-03-02 10:00"), BERLIN, WEEK)) == 0.5 * 1800
    assert overlap_gpu_seconds(lease, *period(at("2026-03-02 10:00"), UTC, WEEK)) == 0.0


def test_resets_words():
    assert usage.resets_words(UTC, DAY) == "00:00 UTC"
    assert usage.resets_words(BERLIN, WEEK) == "Monday 00:00 Europe/Berlin"


# -- with a store ---------------------------------------------------------------------------------------------------

@pytest.fixture
def store(tmp_path):
    """A migrated SQLite store with node n (GPU G-0; its agent address refuses connections)."""
    from gpupool.hub_plugin.db import Store
    from gpupool.hub_plugin.models import GPU, Node

    store = Store(f"sqlite:///{tmp_path}/usage.sqlite")
    store.migrate()
    now = datetime.now(UTC)
    with store.write() as session:
        session.add(Node(name="n", url="http://127.0.0.1:9", inventory="simulated", state="up",
                         registered_at=now, last_heartbeat_at=now,
                         gpus=[GPU(uuid="G-0", name="L4", index=0, memory_total=24 * GiB, memory_reserved=0,
                                   healthy=True)]))
    yield store
    store.close()


def add_lease(store, lease_id: str, *, owner: str = "ann", state: str = "active", fraction: float = 0.5,
              started: datetime, ended: datetime | None = None) -> None:
    from gpupool.hub_plugin.models import Lease, LeaseGPU, UsageRecord

    with store.write() as session:
        session.add(Lease(id=lease_id, owner=owner, state=state, fraction=fraction, gpu_count=1, memory=GiB,
                          node_name="n", idle_timeout=1800, heartbeat_ttl=60, created_at=started,
                          started_at=started, ended_at=ended, usage_gpu_seconds=0.0, groups=["quants"],
                          held_since=started if ended is None else None,
                          gpus=[LeaseGPU(gpu_uuid="G-0", name="L4", index=0)]))
        if ended is not None:
            session.add(UsageRecord(lease_id=lease_id, owner=owner, groups=["quants"], gpus=fraction,
                                    started_at=started, ended_at=ended,
                                    gpu_seconds=fraction * (ended - started).total_seconds()))


def test_used_today_and_this_week_move_with_the_clock(store):
    add_lease(store, "L-000000000001", state="released", started=at("2026-03-01 22:00"),
              ended=at("2026-03-01 23:30"))
    add_lease(store, "L-000000000002", started=at("2026-03-01 23:45"))  # still held
    with store.read() as session:
        now = at("2026-03-02 00:15")
        # Berlin: Monday began at 23:00 UTC: 30 min of the ended lease and 30 min of the running one.
        assert usage.used(session, "ann", now, BERLIN) == (0.5 * 1800 + 0.5 * 1800,) * 2
        # UTC: Monday began at 00:00: 15 min of the running lease.
        assert usage.used(session, "ann", now, UTC) == (0.5 * 900,) * 2
        later = at("2026-03-02 01:15")
        assert usage.used(session, "ann", later, UTC) == (0.5 * 4500,) * 2
        assert usage.used(session, "bob", later, UTC) == (0.0, 0.0)
        sums = usage.summary(session, *period(later, BERLIN, DAY), later)
        assert sums == {"users": {"ann": 0.5 * 1800 + 0.5 * 5400}, "groups": {"quants": 0.5 * 1800 + 0.5 * 5400}}
        assert usage.holding(session, "ann") == 0.5
        assert usage.last_used(session, ["ann", "bob"], later) == {"ann": later, "bob": None}


def test_a_span_is_written_once_and_parked_time_in_none(store):
    """Each span holding a GPU share is one ledger record, written as it ends; the same span twice
    (two releases racing past the state check, each with the lease as it read it) fails on the
    unique (lease, span start); the time between spans (parked) is in no record."""
    from gpupool.hub_plugin.models import Lease, UsageRecord

    add_lease(store, "L-000000000003", started=at("2026-03-02 10:00"))
    with store.write() as session:  # parked at 11:00: the first span
        assert usage.close_span(session, session.get(Lease, "L-000000000003"), at("2026-03-02 11:00")) == 0.5 * 3600
    with store.write() as session:  # nothing held while parked
        lease = session.get(Lease, "L-000000000003")
        assert lease.held_since is None and usage.close_span(session, lease, at("2026-03-02 11:30")) == 0.0
        lease.held_since = at("2026-03-02 12:00")  # resumed
    with store.read() as session:  # 11:00-12:00 counts nothing: parked
        assert usage.used(session, "ann", at("2026-03-02 13:00"), UTC) == (0.5 * 3600 * 2,) * 2
    with pytest.raises(IntegrityError):
        with store.write() as session:
            session.add(UsageRecord(lease_id="L-000000000003", owner="ann", gpus=0.5, started_at=at("2026-03-02 10:00"),
                                    ended_at=at("2026-03-02 10:30"), gpu_seconds=900.0))
    with store.write() as session:
        assert usage.close(session, session.get(Lease, "L-000000000003"), at("2026-03-02 13:00")) == 0.5 * 3600 * 2
    with store.read() as session:
        spans = session.scalars(select(UsageRecord).where(UsageRecord.lease_id == "L-000000000003")
                                .order_by(UsageRecord.started_at)).all()
        assert [(r.started_at.hour, r.ended_at.hour, r.gpu_seconds) for r in spans] == [(10, 11, 1800.0),
                                                                                         (12, 13, 1800.0)]


def test_release_racing_reclaim_closes_the_ledger_once(store):
    """An owner's release and a reclaim of the same lease at the same time:
    one of them ends it, with one ledger record; the other waits and leaves it."""
    from gpupool.hub_plugin.agent_client import AgentClient
    from gpupool.hub_plugin.config import ServiceSettings
    from gpupool.hub_plugin.pool import Pool
    from gpupool.hub_plugin.models import Lease, UsageRecord
    from gpupool.schema import LeaseState

    started = datetime.now(UTC) - timedelta(hours=2)
    add_lease(store, "L-000000000004", started=started)
    clock = {"now": started + timedelta(hours=1)}

    async def race() -> None:
        agents = AgentClient("agent-token")
        pool = Pool(ServiceSettings(), store, agents, now=lambda: clock["now"])
        book = pool.leases
        try:
            await asyncio.gather(
                book.release("L-000000000004", LeaseState.released, "released by its owner"),
                book.release("L-000000000004", LeaseState.reclaimed, "idle for 30m (idle timeout 30m)"),
                book.release("L-000000000004", LeaseState.reclaimed, "idle for 30m (idle timeout 30m)"))
        finally:
            await pool.shutdown()
            agents.close()

    asyncio.run(race())
    with store.read() as session:
        lease = session.get(Lease, "L-000000000004")
        records = session.scalars(select(UsageRecord).where(UsageRecord.lease_id == lease.id)).all()
        assert lease.state in ("released", "reclaimed") and lease.ended_at == clock["now"]
        assert [r.gpu_seconds for r in records] == [0.5 * 3600] == [lease.usage_gpu_seconds]
        assert [e.state for e in lease.events] == ["releasing", lease.state]
