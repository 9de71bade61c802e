"""The usage ledger: GPU-seconds (fraction x GPUs x seconds held) per lease,
summed per user, group, day and week.

- :func:`close` writes a lease's one :class:`~.models.UsageRecord` when the
  lease ends, in the transaction that ends it; ``usage_ledger.lease_id`` is
  unique, so a lease can never be counted twice (not even if two releases
  raced past the state check).
- Days and weeks are calendar periods in one time zone
  (``c.GPUPool.usage_timezone``; weeks start Monday 00:00); every timestamp
  is stored as UTC. A lease that spans a period boundary counts in each
  period for the seconds it held there.
- "Used" includes the seconds the user's leases hold right now (from
  ``started_at`` to ``now``), so a running lease counts before it ends.

The period arithmetic (:func:`period`, :func:`overlap_gpu_seconds`,
:func:`daily`) is pure, so tests move the clock by passing another ``now``.
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

def close(session: Session, lease: Lease, now: datetime) -> float:
    """Write ``lease``'s ledger record as it ends at ``now``; returns its
    GPU-seconds (0 for a lease that never started). Call once, in the
    transaction that ends the lease; a second call for the same lease fails
    on the unique ``lease_id``."""
    held = max(0.0, (now - lease.started_at).total_seconds()) if lease.started_at else 0.0
    gpus = lease.fraction * lease.gpu_count
    record = UsageRecord(lease_id=lease.id, owner=lease.owner, groups=list(lease.groups or []), gpus=gpus,
                         started_at=lease.started_at or now, ended_at=now, gpu_seconds=gpus * held)
    session.add(record)
    return record.gpu_seconds


def intervals(session: Session, lo: datetime, hi: datetime, now: datetime, *,
              owner: str | None = None) -> list[Interval]:
    """What overlaps ``[lo, hi)``: closed ledger records, and the leases
    holding capacity now (counted up to ``now``); only ``owner``'s if given."""
    query = select(UsageRecord).where(UsageRecord.ended_at > lo, UsageRecord.started_at < hi)
    live = select(Lease).where(Lease.state.in_(HOLDING), Lease.started_at.is_not(None), Lease.started_at < hi)
    if owner is not None:
        query = query.where(UsageRecord.owner == owner)
        live = live.where(Lease.owner == owner)
    found = [Interval(r.gpus, r.started_at, r.ended_at, r.owner, tuple(r.groups or ()))
             for r in session.scalars(query)]
    found += [Interval(x.fraction * x.gpu_count, x.started_at, max(now, x.started_at), x.owner, tuple(x.groups or ()))
              for x in session.scalars(live)]
    return found


def used(session: Session, owner: str, now: datetime, tz: tzinfo) -> tuple[float, float]:
    """``owner``'s GPU-seconds of today and of this week (in ``tz``)."""
    week_lo, week_hi = period(now, tz, WEEK)
    rows = intervals(session, week_lo, week_hi, now, owner=owner)
    day_lo, day_hi = period(now, tz, DAY)
    return overlap_gpu_seconds(rows, day_lo, day_hi), overlap_gpu_seconds(rows, week_lo, week_hi)


def holding(session: Session, owner: str) -> float:
    """GPUs (fraction x count) ``owner`` holds or waits for: leases holding
    capacity and queued ones (a queued request counts against ``max_gpus``)."""
    states = (*HOLDING, "queued")
    total = session.scalar(select(func.sum(Lease.fraction * Lease.gpu_count))  # one row, however many leases
                           .where(Lease.owner == owner, Lease.state.in_(states)))
    return float(total or 0.0)


def last_used(session: Session, owners: Iterable[str], now: datetime) -> dict[str, datetime | None]:
    """When each of ``owners`` last held capacity: ``now`` while they hold
    some, else the end of their latest lease that used any (from the ledger),
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
