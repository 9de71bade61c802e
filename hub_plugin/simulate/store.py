"""Read a pool's own history from its store, as a workload the replay can run.

Who calls it: ``gpupool simulate --from-store URL`` (:mod:`.cli`). It
does I/O (SQL through SQLAlchemy) and nothing else: the replay
(:mod:`.notebooks`) stays pure and gets a
:class:`.workload.NotebookWorkload` like any trace's.

What is read: every lease that started and ended (``leases``: owner, groups,
kernel, fraction, GPU count, idle timeout, class, preemptibility,
created/started/ended times, end state and reason), the cells each lease's
worker ran (``lease_cells``, recorded from the agents' heartbeats since
revision 0009), the usage ledger (``usage_ledger``: GPU-seconds held per
lease, the figure the replay is checked against) and the pool's GPUs
(``gpus``: how many there are now).

How it becomes a workload:

- one **session** per notebook kernel (``kernel_id``; a lease without one is
  its own session), owned by the lease's owner; it opens at its first
  request and closes when its last lease ends;
- the **cells** of a lease are its recorded ones, each running as long as it
  ran; the first arrives when the lease was asked for (``created_at``: the
  replay's wait is the queue's), the others when they started; a lease that
  ran none is one cell of a second, its ask. A lease from before revision
  0009 (``cells_recorded`` false) is one cell, arriving at
  ``created_at`` and busy from its start to its end, less the idle timeout when
  it was reclaimed for idleness (its worker was idle that long before); then
  a lease released by its user, its kernel's shutdown or a lost heartbeat
  counts as busy until it ended;
- 1-GPU leases ask for their fraction, several-GPU leases whole GPUs;
- a session takes the class and preemptibility of its first lease: a batch
  session gives its lease back when its cell ends, and pressure may interrupt
  a preemptible one, as the service does.

What the history does not hold (:data:`MISSING`), and so the replay assumes.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpupool.leaseclasses import default as default_class

from .workload import Cell, NotebookWorkload, Session

#: What the store does not record that a faithful replay would need.
MISSING = (
    "the time between asking for a lease and its first cell: the first cell is replayed as asked at created_at",
    "requests that never got capacity (queued, then failed or cancelled): left out, so demand the pool refused "
    "is not replayed",
    "GPU models and node shapes over time: the replay uses uniform nodes of --per-node GPUs",
)


def before_cells(leases: int) -> str:
    """What the history lacks of ``leases`` leases without recorded cells (from before revision 0009)."""
    return (f"the cells of {leases} lease{'s' if leases != 1 else ''} from before revision 0009 (no lease_cells "
            "rows): one busy burst per such lease is assumed (less the idle timeout if it was reclaimed for "
            "idleness; until its end if its user released it)")


@dataclass(frozen=True)
class StoreHistory:
    """A store's history as a workload, with what the store itself says."""

    workload: NotebookWorkload
    pool_gpus: int
    recorded_gpu_hours: float
    leases: int
    skipped: int
    without_cells: int = 0


def load_store(url: str) -> StoreHistory:
    """Read the store at SQLAlchemy ``url`` (module docstring). Raises
    SystemExit with the fix when the URL cannot be read or holds no ended lease."""
    from sqlalchemy import create_engine, func, select
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.orm import Session as SQLSession

    from ..models import GPU, Lease, LeaseCell, UsageRecord

    try:
        engine = create_engine(url)
        with SQLSession(engine) as db:
            rows = db.execute(select(Lease.owner, Lease.kernel_id, Lease.id, Lease.fraction, Lease.gpu_count,
                                     Lease.idle_timeout, Lease.created_at, Lease.started_at, Lease.ended_at,
                                     Lease.state, Lease.reason, Lease.groups, Lease.lease_class, Lease.preemptible,
                                     Lease.cells_recorded)
                              .order_by(Lease.created_at, Lease.id)).all()
            ran = db.execute(select(LeaseCell.lease_id, LeaseCell.started_at, LeaseCell.ended_at)
                             .order_by(LeaseCell.started_at, LeaseCell.id)).all()
            recorded = db.scalar(select(func.coalesce(func.sum(UsageRecord.gpu_seconds), 0.0)))
            pool_gpus = db.scalar(select(func.count()).select_from(GPU)) or 0
        engine.dispose()
    except SQLAlchemyError as exc:
        first = str(exc).splitlines()[0]
        if any(words in first for words in ("no such column", "no such table", "does not exist")):
            raise SystemExit(f"gpupool simulate: the store at {url!r} has no {_missing(first)}: it is not a "
                             "gpupool store, or one of an older gpupool (start this version's service on it "
                             "once: it migrates its store)") from exc
        raise SystemExit(f"gpupool simulate: cannot read the store at {url!r} ({exc.__class__.__name__}: "
                         f"{first}); pass the service's c.GPUPool.db_url") from exc
    ended = [r for r in rows if r.started_at is not None and r.ended_at is not None]
    if not ended:
        raise SystemExit(f"gpupool simulate: the store at {url!r} has no lease that started and ended yet; "
                         "nothing to replay")
    cells: dict[str, list[tuple]] = {}
    for lease_id, started_at, ended_at in ran:
        cells.setdefault(lease_id, []).append((started_at, ended_at))
    workload = history_workload(ended, cells)
    return StoreHistory(workload, int(pool_gpus), float(recorded) / 3600, len(ended), len(rows) - len(ended),
                        sum(1 for row in ended if not row.cells_recorded))


def _missing(error: str) -> str:
    """The table or column an SQL error says is missing, in words (``column leases.cells_recorded``)."""
    for marker, kind in (("no such column: ", "column "), ("no such table: ", "table "), ('column "', "column "),
                         ('relation "', "table ")):
        if marker in error:
            return kind + error.split(marker, 1)[1].split('"', 1)[0].split()[0]
    return "table or column this gpupool reads"


def busy_seconds(row) -> float:
    """How long lease ``row`` is taken to have run cells (module docstring), at least one second."""
    held = (row.ended_at - row.started_at).total_seconds()
    if row.state == "reclaimed" and (row.reason or "").startswith("idle"):
        held -= row.idle_timeout
    return max(1.0, held)


def lease_cells(row, ran: list[tuple]) -> list[tuple]:
    """``(arrives, seconds)`` of lease ``row``'s cells (module docstring), times as datetimes;
    ``ran``: its recorded ``(started_at, ended_at or None)``, in order."""
    if not ran and not row.cells_recorded:  # from before revision 0009
        return [(row.created_at, busy_seconds(row))]
    if not ran:  # it ran no cell: only the ask (a second), then idle until it ended
        return [(row.created_at, 1.0)]
    runs = [(start, max(1.0, ((end or row.ended_at) - start).total_seconds())) for start, end in ran]
    return [(row.created_at, runs[0][1]), *runs[1:]]


def history_workload(rows, ran: dict[str, list[tuple]] | None = None) -> NotebookWorkload:
    """Sessions and cells from ended lease rows sorted by ``created_at``
    (objects with the attributes :func:`load_store` selects) and ``ran``,
    each lease's recorded cells by lease id."""
    origin = rows[0].created_at
    session_of: dict[tuple[str, str], int] = {}
    first: list = []  # by session id: its first lease
    closes: list[float] = []
    arrivals = []  # (arrives, session id, seconds), in seconds since the first lease was asked for
    for row in rows:
        key = (row.owner, row.kernel_id or row.id)
        sid = session_of.setdefault(key, len(first))
        if sid == len(first):
            first.append(row)
            closes.append(0.0)
        closes[sid] = max(closes[sid], (row.ended_at - origin).total_seconds())
        arrivals += [((at - origin).total_seconds(), sid, seconds)
                     for at, seconds in lease_cells(row, (ran or {}).get(row.id, []))]
    cells = tuple(Cell(i, sid, submit, seconds) for i, (submit, sid, seconds) in enumerate(sorted(arrivals)))
    members: list[list[int]] = [[] for _ in first]
    for cell in cells:
        members[cell.session].append(cell.job_id)
    users: dict[str, int] = {}
    groups: dict[str, int] = {}
    sessions = []
    for sid, row in enumerate(first):
        gpus = max(1, row.gpu_count)
        milli = round(row.fraction * 1000) if gpus == 1 else 1000
        sessions.append(Session(sid, users.setdefault(row.owner, len(users)),
                                groups.setdefault((row.groups or [""])[0], len(groups)), gpus,
                                max(1, min(1000, milli)), cells[members[sid][0]].submit, closes[sid],
                                tuple(members[sid]), row.lease_class or default_class().name, bool(row.preemptible)))
    rule = ("a pool's own history: one session per notebook kernel, the cells its leases ran (the first asked at "
            "created_at); a lease without recorded cells is one, busy from start to end less the idle timeout when "
            "reclaimed for idleness")
    return NotebookWorkload(cells, tuple(sessions), rule)
