"""Each lease's cell activity, recorded from the agent's heartbeats.

Who calls it: the node heartbeat (:mod:`.nodes`) for every live worker's
report, and the release path (:mod:`.transitions`) when a lease ends. What
it writes: one :class:`~.models.LeaseCell` row per cell the worker ran, from
the report's ``cell_started`` (when the last cell started) to its
``idle_since`` (when it ended); ``gpupool simulate --from-store`` replays
them (:mod:`.simulate.store`). A cell that started and ended between two
heartbeats is still seen (the next report names its start and end); of two
cells between two heartbeats only the later is (the earlier one's run is
counted into it, up to the later one's start). Times are clamped to the
lease's start and ``now`` (the agent's clock may be off).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import update
from sqlalchemy.orm import Session

from gpupool.schema import parse_time
from gpupool.wire.nodes import WorkerReport

from .models import Lease, LeaseCell


def record(session: Session, lease: Lease, report: WorkerReport, now: datetime) -> None:
    """Record what ``report`` (a live worker's) says of ``lease``'s cells at ``now``."""
    started = _moment(report.cell_started, lease, now)
    ended = _moment(report.idle_since, lease, now) if report.execution_state == "idle" else None
    if started is not None and (lease.cell_started_at is None or started > lease.cell_started_at):
        if lease.cell_open:  # it ended unseen, before this one started
            close(session, lease, started)
        cell = LeaseCell(lease_id=lease.id, started_at=started)
        session.add(cell)
        lease.cell_started_at, lease.cell_open = started, True
        if ended is not None and ended >= started:
            cell.ended_at, lease.cell_open = ended, False
    elif lease.cell_open and ended is not None and ended >= lease.cell_started_at:
        close(session, lease, ended)


def close(session: Session, lease: Lease, ended: datetime) -> None:
    """End ``lease``'s open cell (if any) at ``ended``: its next cell started, it went idle, or it ended."""
    if lease.cell_open:
        session.execute(update(LeaseCell).where(LeaseCell.lease_id == lease.id, LeaseCell.ended_at.is_(None))
                        .values(ended_at=max(ended, lease.cell_started_at)))
        lease.cell_open = False


def _moment(text: str | None, lease: Lease, now: datetime) -> datetime | None:
    """The report's time ``text`` within the lease's start and ``now`` (None: absent or unreadable)."""
    try:
        moment = parse_time(text)
    except (TypeError, ValueError, AttributeError):
        return None
    if moment is None:
        return None
    return min(max(moment, lease.started_at or moment), now)
