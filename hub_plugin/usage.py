"""The usage ledger: GPU-seconds (fraction x GPUs x seconds holding a GPU
share) per lease, in spans (one :class:`~.models.UsageRecord` each, written
by :func:`close_span` when the lease parks or ends), summed per user, group,
day and week of ``c.PoolQuotas.usage_timezone`` (docs/api.md, "Quotas"). The
period arithmetic (:func:`period`, :func:`overlap_gpu_seconds`, :func:`daily`)
is pure, so tests move the clock by passing another ``now``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone, tzinfo
from typing import Iterable

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from .capacity import HOLDING
from .models import Lease, UsageRecord

DAY, WEEK = "day", "week"


@dataclass(frozen=True)
class Interval:
    """``gpus`` (fraction x count) held from ``start`` to ``end`` (aware datetimes)."""

    gpus: float
    start: datetime
    end: datetime
    owner: str = ""
    groups: tuple[str, ...] = ()


def period(now: datetime, tz: tzinfo, kind: str) -> tuple[datetime, datetime]:
    """``(start, end)`` in UTC of the day or week (``DAY``/``WEEK``, Monday
    first) that holds ``now`` in time zone ``tz``."""
    local = now.astimezone(tz)
    first = local.date() - timedelta(days=local.weekday() if kind == WEEK else 0)
    last = first + timedelta(days=7 if kind == WEEK else 1)
    return _midnight(first, tz), _midnight(last, tz)


def _midnight(day: date, tz: tzinfo) -> datetime:
    return datetime.combine(day, time(0), tzinfo=tz).astimezone(timezone.utc)


def resets_words(tz: tzinfo, kind: str) -> str:
    """When a period's allowance comes back: ``"00:00 UTC"``, ``"Monday 00:00 Europe/Berlin"``."""
    name = getattr(tz, "key", None) or str(tz)
    return f"{'Monday ' if kind == WEEK else ''}00:00 {name}"


def overlap_gpu_seconds(intervals: Iterable[Interval], lo: datetime, hi: datetime) -> float:
    """GPU-seconds of ``intervals`` that fall within ``[lo, hi)``."""
    total = 0.0
    for item in intervals:
        seconds = (min(item.end, hi) - max(item.start, lo)).total_seconds()
        if seconds > 0:
            total += item.gpus * seconds
    return total


def daily(intervals: Iterable[Interval], tz: tzinfo, first: date, days: int) -> dict[date, float]:
    """GPU-seconds per local calendar day, ``days`` days from ``first``."""
    out = {}
    for offset in range(days):
        day = first + timedelta(days=offset)
        out[day] = overlap_gpu_seconds(intervals, _midnight(day, tz), _midnight(day + timedelta(days=1), tz))
    return out


# -- the ledger in SQL ------------------------------------------------------------------------------------------

def close_span(session: Session, lease: Lease, now: datetime) -> float:
    """Write the ledger record of ``lease``'s current span, from ``held_since``
    to ``now``, as it is parked or ends; returns its GPU-seconds, which are
    added to ``lease.usage_gpu_seconds`` (0 and no record while it holds no
    span). Its span is then over (``held_since`` None). In the transaction
    that parks or ends the lease; the same span twice fails on the unique
    (``lease_id``, ``started_at``)."""
    if lease.held_since is None:
        return 0.0
    gpus = lease.fraction * lease.gpu_count
    seconds = gpus * max(0.0, (now - lease.held_since).total_seconds())
    session.add(UsageRecord(lease_id=lease.id, owner=lease.owner, groups=list(lease.groups or []), gpus=gpus,
                            started_at=lease.held_since, ended_at=max(now, lease.held_since), gpu_seconds=seconds))
    lease.usage_gpu_seconds = (lease.usage_gpu_seconds or 0.0) + seconds
    lease.held_since = None
    return seconds


def close(session: Session, lease: Lease, now: datetime) -> float:
    """As ``lease`` ends at ``now``: close its current span (:func:`close_span`);
    one that never started gets one record of 0 GPU-seconds. Returns its
    GPU-seconds over all its spans."""
    if lease.started_at is None:
        session.add(UsageRecord(lease_id=lease.id, owner=lease.owner, groups=list(lease.groups or []),
                                gpus=lease.fraction * lease.gpu_count, started_at=now, ended_at=now, gpu_seconds=0.0))
    close_span(session, lease, now)
    return lease.usage_gpu_seconds or 0.0


def intervals(session: Session, lo: datetime, hi: datetime, now: datetime, *,
              owner: str | None = None) -> list[Interval]:
    """What overlaps ``[lo, hi)``: closed ledger records, and the leases
    holding capacity now (counted up to ``now``); only ``owner``'s if given."""
    query = select(UsageRecord).where(UsageRecord.ended_at > lo, UsageRecord.started_at < hi)
    live = select(Lease).where(Lease.state.in_(HOLDING), Lease.held_since.is_not(None), Lease.held_since < hi)
    if owner is not None:
        query = query.where(UsageRecord.owner == owner)
        live = live.where(Lease.owner == owner)
    found = [Interval(r.gpus, r.started_at, r.ended_at, r.owner, tuple(r.groups or ()))
             for r in session.scalars(query)]
    found += [Interval(x.fraction * x.gpu_count, x.held_since, max(now, x.held_since), x.owner, tuple(x.groups or ()))
              for x in session.scalars(live)]
    return found


def used(session: Session, owner: str, now: datetime, tz: tzinfo) -> tuple[float, float]:
    """``owner``'s GPU-seconds of today and of this week (in ``tz``)."""
    week_lo, week_hi = period(now, tz, WEEK)
    rows = intervals(session, week_lo, week_hi, now, owner=owner)
    day_lo, day_hi = period(now, tz, DAY)
    return overlap_gpu_seconds(rows, day_lo, day_hi), overlap_gpu_seconds(rows, week_lo, week_hi)


#: The states ``max_gpus`` counts: a queued request waits for its GPUs, a parked lease may resume any time.
CLAIMING = (*HOLDING, "queued", "parked")


def holding(session: Session, owner: str) -> float:
    """GPUs (fraction x count) ``owner`` holds, waits for or has parked:
    leases holding capacity, queued and parked ones (each counts against ``max_gpus``)."""
    states = CLAIMING
    total = session.scalar(select(func.sum(Lease.fraction * Lease.gpu_count))  # one row, however many leases
                           .where(Lease.owner == owner, Lease.state.in_(states)))
    return float(total or 0.0)


def parked_gpus(session: Session, owner: str) -> float:
    """GPUs (fraction x count) of ``owner``'s parked leases (part of :func:`holding`)."""
    total = session.scalar(select(func.sum(Lease.fraction * Lease.gpu_count)).where(
        Lease.owner == owner, Lease.state == "parked"))
    return float(total or 0.0)


def parked_memory(session: Session, owner: str) -> int:
    """Host bytes ``owner``'s leases parked in memory hold on their nodes now (for ``max_parked_memory``)."""
    total = session.scalar(select(func.sum(Lease.parked_host_bytes)).where(
        Lease.owner == owner, Lease.state == "parked", Lease.park_tier == "memory"))
    return int(total or 0)


def last_used(session: Session, owners: Iterable[str], now: datetime) -> dict[str, datetime | None]:
    """When each of ``owners`` last held capacity: ``now`` while they hold
    some, else the end of their latest span that used any (from the ledger),
    else None (never)."""
    owners = sorted(set(owners))
    result: dict[str, datetime | None] = {owner: None for owner in owners}
    if not owners:
        return result
    ended = session.execute(select(UsageRecord.owner, func.max(UsageRecord.ended_at))
                            .where(UsageRecord.owner.in_(owners), UsageRecord.gpu_seconds > 0)
                            .group_by(UsageRecord.owner)).all()
    result.update(dict(ended))
    for owner in session.scalars(select(Lease.owner).where(Lease.owner.in_(owners), Lease.state.in_(HOLDING))
                                 .distinct()):
        result[owner] = now
    return result


def summary(session: Session, lo: datetime, hi: datetime, now: datetime) -> dict[str, dict[str, float]]:
    """``{"users": {name: GPU-seconds}, "groups": {name: GPU-seconds}}`` within ``[lo, hi)``.
    A lease counts for every group its owner was in when it was created."""
    users: dict[str, float] = defaultdict(float)
    groups: dict[str, float] = defaultdict(float)
    for item in intervals(session, lo, hi, now):
        seconds = overlap_gpu_seconds([item], lo, hi)
        users[item.owner] += seconds
        for group in item.groups:
            groups[group] += seconds
    return {"users": dict(users), "groups": dict(groups)}
