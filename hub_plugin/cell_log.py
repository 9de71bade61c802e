"""Each lease's cell activity, recorded from the agent's heartbeats.

Who calls it: the node heartbeat (:mod:`.nodes`) for every live worker's
report, and the release path (:mod:`.transitions`) when a lease ends. What
it writes: one :class:`~.models.LeaseCell` row per cell the worker ran, from
the report's ``cell_started`` (when the last cell started) to its
``idle_since`` (when it ended), and each report's ``cells`` (the last cells
that ended, with their start and end), so cells that start and end between
two heartbeats are recorded too; ``gpupool simulate --from-store`` replays
them (:mod:`.simulate.store`). Reports repeat what they said before; a cell
is written once. Times are clamped to the lease's start and ``now`` (the
agent's clock may be off).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import update
from sqlalchemy.orm import Session

from gpupool.schema import WorkerState, parse_time
from gpupool.wire.nodes import WorkerReport

from .models import Lease, LeaseCell


def record(session: Session, lease: Lease, report: WorkerReport, now: datetime) -> None:
    """Record what ``report`` (a live worker's) says of ``lease``'s cells at ``now``: the
    cells that ended (``cells``, oldest first), then the last one (``cell_started``, ended
    at ``idle_since`` when the worker is idle). What the store has already is left alone."""
    for start_text, end_text in report.cells:
        start, end = _moment(start_text, lease, now), _moment(end_text, lease, now)
        if start is not None and end is not None:
            _cell(session, lease, start, max(start, end))
    started = _moment(report.cell_started, lease, now)
    ended = _moment(report.idle_since, lease, now) if report.execution_state == WorkerState.idle else None
    if started is not None:
        _cell(session, lease, started, ended if ended is not None and ended >= started else None)


def _cell(session: Session, lease: Lease, start: datetime, end: datetime | None) -> None:
    """The cell from ``start`` to ``end`` (None: it runs), unless the store has it already."""
    known = lease.cell_started_at
    if known is not None and start <= known:
        if start == known and end is not None:
            close(session, lease, end)  # the open one ended
        return
    if lease.cell_open:  # its end went unseen (an agent before ``cells``): up to this start
        close(session, lease, start)
    session.add(LeaseCell(lease_id=lease.id, started_at=start, ended_at=end))
    lease.cell_started_at, lease.cell_open = start, end is None


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
