"""Read a pool's own history from its store, as a workload the replay can run.

Who calls it: ``gpupool simulate --from-store URL`` (:mod:`.cli`). It
does I/O (SQL through SQLAlchemy) and nothing else: the replay
(:mod:`.notebooks`) stays pure and gets a
:class:`.workload.NotebookWorkload` like any trace's.

What is read: every lease that started and ended (``leases``: owner, groups,
kernel, fraction, GPU count, idle timeout, class, preemptibility,
created/started/ended times, end state and reason), the usage ledger (``usage_ledger``: GPU-seconds held per
lease, the figure the replay is checked against) and the pool's GPUs
(``gpus``: how many there are now).

How it becomes a workload (the store keeps lease lifetimes, not cells):

- one **session** per notebook kernel (``kernel_id``; a lease without one is
  its own session), owned by the lease's owner; it opens at its first
  request and closes when its last lease ends;
- one **cell** per lease, arriving when the lease was asked for
  (``created_at``) and running while the lease was busy: from its start to
  its end, less the idle timeout when the lease was reclaimed for idleness
  (its worker was idle that long before); a lease released by its user, its
  kernel's shutdown or a lost heartbeat counts as busy until it ended;
- 1-GPU leases ask for their fraction, several-GPU leases whole GPUs;
- a session takes the class and preemptibility of its first lease: a batch
  session gives its lease back when its cell ends, and pressure may interrupt
  a preemptible one, as the service does.

What the history does not hold (:data:`MISSING`), and so the replay assumes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .workload import Cell, NotebookWorkload, Session

#: What the store does not record that a faithful replay would need.
MISSING = (
    "cell activity: the store keeps each lease's lifetime and only its latest idle_since, not when each cell ran; "
    "one busy burst per lease is assumed (less the idle timeout for leases reclaimed for idleness)",
    "idle time before a user's own release: a released lease counts as busy until it ended",
    "requests that never got capacity (queued, then failed or cancelled): left out, so demand the pool refused "
    "is not replayed",
    "GPU models and node shapes over time: the replay uses uniform nodes of --per-node GPUs",
)


@dataclass(frozen=True)
class StoreHistory:
    """A store's history as a workload, with what the store itself says."""

    workload: NotebookWorkload
    pool_gpus: int
    recorded_gpu_hours: float
    leases: int
    skipped: int


def load_store(url: str) -> StoreHistory:
    """Read the store at SQLAlchemy ``url`` (module docstring). Raises
    SystemExit with the fix when the URL cannot be read or holds no ended lease."""
    from sqlalchemy import create_engine, func, select
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.orm import Session as SQLSession

    from ..models import GPU, Lease, UsageRecord

    try:
        engine = create_engine(url)
        with SQLSession(engine) as db:
            rows = db.execute(select(Lease.owner, Lease.kernel_id, Lease.id, Lease.fraction, Lease.gpu_count,
                                     Lease.idle_timeout, Lease.created_at, Lease.started_at, Lease.ended_at,
                                     Lease.state, Lease.reason, Lease.groups, Lease.lease_class, Lease.preemptible)
                              .order_by(Lease.created_at, Lease.id)).all()
            recorded = db.scalar(select(func.coalesce(func.sum(UsageRecord.gpu_seconds), 0.0)))
            pool_gpus = db.scalar(select(func.count()).select_from(GPU)) or 0
        engine.dispose()
    except SQLAlchemyError as exc:
        raise SystemExit(f"gpupool simulate: cannot read the store at {url!r} ({exc.__class__.__name__}: "
                         f"{str(exc).splitlines()[0]}); pass the service's c.GPUPool.db_url") from exc
    ended = [r for r in rows if r.started_at is not None and r.ended_at is not None]
    if not ended:
        raise SystemExit(f"gpupool simulate: the store at {url!r} has no lease that started and ended yet; "
                         "nothing to replay")
    workload = history_workload(ended)
    return StoreHistory(workload, int(pool_gpus), float(recorded) / 3600, len(ended), len(rows) - len(ended))


def busy_seconds(row) -> float:
    """How long lease ``row`` is taken to have run cells (module docstring), at least one second."""
    held = (row.ended_at - row.started_at).total_seconds()
    if row.state == "reclaimed" and (row.reason or "").startswith("idle"):
        held -= row.idle_timeout
    return max(1.0, held)


def history_workload(rows) -> NotebookWorkload:
    """Sessions and cells from ended lease rows sorted by ``created_at``
    (objects with the attributes :func:`load_store` selects)."""
    origin = rows[0].created_at
    users: dict[str, int] = {}
    groups: dict[str, int] = {}
    by_session: dict[tuple[str, str], list[int]] = {}
    cells: list[Cell] = []
    for i, row in enumerate(rows):
        key = (row.owner, row.kernel_id or row.id)
        sid = by_session.setdefault(key, [len(by_session)])[0]
        by_session[key].append(i)
        cells.append(Cell(i, sid, (row.created_at - origin).total_seconds(), busy_seconds(row)))
    sessions = []
    for key, (sid, *members) in by_session.items():
        first, last = rows[members[0]], rows[members[-1]]
        user = users.setdefault(first.owner, len(users))
        group = groups.setdefault((first.groups or [""])[0], len(groups))
        gpus = max(1, first.gpu_count)
        milli = round(first.fraction * 1000) if gpus == 1 else 1000
        sessions.append(Session(sid, user, group, gpus, max(1, min(1000, milli)), cells[members[0]].submit,
                                (last.ended_at - origin).total_seconds(), tuple(members),
                                first.lease_class or "interactive", bool(first.preemptible)))
    rule = ("a pool's own history: one session per notebook kernel, one cell per lease (asked at created_at, "
            "busy from start to end less the idle timeout when reclaimed for idleness)")
    return NotebookWorkload(tuple(cells), tuple(sessions), rule)
