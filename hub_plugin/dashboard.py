"""What the admin page at ``/services/gpupool/`` shows, as plain data.

One function, :func:`dashboard`, reads the store and returns dicts and
lists the template draws; no HTML here. Visibility: an admin sees every
lease, everyone's usage and the whole quota table; anyone else only their
own leases, usage and limits.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import date, datetime, timedelta
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, selectinload

from gpupool.schema import LeaseState

from .auth import Identity
from .capacity import HOLDING
from .models import Lease
from .rules.reclaim import PARKED_STATES
from .views import pool_json

#: The leases the page lists beside the queue: those holding capacity, and those parked on their nodes.
SHOWN = (*HOLDING, *PARKED_STATES)

#: Days of usage the chart covers, today included.
USAGE_DAYS = 7


def dashboard(session: Session, who: Identity, *, context_overhead: int, now: datetime,
              quota_book: Any = None) -> dict[str, Any]:
    """The page's data for ``who`` at ``now`` (aware UTC).

    Returns ``{"pool", "leases", "queue", "usage", "quotas"}``: ``pool`` as
    ``GET /pool``; ``leases`` the ones holding capacity or parked (with their
    park: tier, host bytes, since) and ``queue`` the
    ``queued`` ones (oldest first), each a small dict; ``usage`` from
    :func:`usage_by_day`; ``quotas`` from ``quota_book`` (a
    :class:`~.quota_book.QuotaBook`, or None where quotas are not
    available: then None).
    """
    visible = select(Lease).options(selectinload(Lease.gpus)).order_by(Lease.created_at)
    if not who.admin:
        visible = visible.where(Lease.owner == who.name)
    holding = session.scalars(visible.where(Lease.state.in_(SHOWN))).all()
    queued = session.scalars(visible.where(Lease.state == LeaseState.queued.value)).all()
    return {
        "pool": pool_json(session, context_overhead),
        "leases": [_lease_row(lease, now) for lease in holding],
        "queue": [_lease_row(lease, now) for lease in queued],
        "usage": usage_by_day(session, None if who.admin else who.name, now),
        "quotas": _quotas(session, who, quota_book),
    }


def usage_by_day(session: Session, owner: str | None, now: datetime, days: int = USAGE_DAYS) -> dict[str, Any]:
    """GPU-hours per user per UTC day over the last ``days`` days (today last).

    An ended lease counts its recorded ``usage_gpu_seconds`` on the day it
    ended; a lease still held (or parked) counts what it has used so far, today.
    ``owner`` None: every user. Returns ``{"days": ["2026-11-23", ...],
    "users": {name: [hours per day]}, "max": largest daily total}``.
    """
    first = now.date() - timedelta(days=days - 1)
    start = datetime.combine(first, datetime.min.time(), tzinfo=now.tzinfo)
    query = select(Lease).where(or_(Lease.ended_at >= start, Lease.state.in_(SHOWN)))
    if owner is not None:
        query = query.where(Lease.owner == owner)
    hours: dict[str, dict[date, float]] = defaultdict(lambda: defaultdict(float))
    for lease in session.scalars(query):
        if lease.ended_at is not None:
            hours[lease.owner][lease.ended_at.date()] += lease.usage_gpu_seconds / 3600.0
        else:  # what it used so far: its spans that ended, and the one it is in
            span = max(0.0, (now - lease.held_since).total_seconds()) if lease.held_since is not None else 0.0
            used = (lease.usage_gpu_seconds or 0.0) + lease.fraction * lease.gpu_count * span
            if used:
                hours[lease.owner][now.date()] += used / 3600.0
    day_list = [first + timedelta(days=i) for i in range(days)]
    users = {name: [round(per_day.get(d, 0.0), 6) for d in day_list] for name, per_day in sorted(hours.items())}
    totals = [sum(series[i] for series in users.values()) for i in range(days)]
    return {"days": [d.isoformat() for d in day_list], "users": users, "max": max(totals, default=0.0)}


def _lease_row(lease: Lease, now: datetime) -> dict[str, Any]:
    since = lease.started_at or lease.created_at
    return {
        "id": lease.id, "owner": lease.owner, "state": lease.state, "fraction": lease.fraction,
        "gpu_count": lease.gpu_count, "memory": lease.memory, "node": lease.node_name,
        "gpus": ", ".join(f"GPU {g.index}" for g in lease.gpus),
        # As `gpupool status` shows it: only an active lease's worker runs; a parked one's is frozen
        # (its state is the one it had when parked), a spilled or starting one has none.
        "worker": (lease.worker_state or "-") if lease.state == LeaseState.active.value else "-",
        "held_s": max(0.0, (now - since).total_seconds()),
        "parked": _park_row(lease, now),
    }


def _park_row(lease: Lease, now: datetime) -> dict[str, Any] | None:
    """A parked (or parking) lease's park: ``{"tier", "host_bytes", "since_s", "resume"}``; None otherwise."""
    if lease.state not in PARKED_STATES or lease.park_tier is None:
        return None
    since = max(0.0, (now - lease.parked_at).total_seconds()) if lease.parked_at else 0.0
    return {"tier": lease.park_tier if lease.state == LeaseState.parked.value else "parking",
            "host_bytes": lease.parked_host_bytes or 0, "since_s": since,
            "resume": lease.resume_requested_at is not None, "lost": list(lease.parked_lost or [])}


def _quotas(session: Session, who: Identity, book: Any) -> dict[str, Any] | None:
    """Admins: the effective table (scope -> limits); others: their own
    resolved limits and usage (``GET /quota``)."""
    if book is None:
        return None
    if who.admin:
        return {"table": book.table(session)}
    return {"mine": book.mine(session, who)}
