"""Replay notebook sessions against the real scheduler and reclaim rules, on a virtual clock.

Who calls it: :mod:`.simulator` (``gpupool simulate --workload sensei``) and
``bench/simulate_report.py``. Time is seconds since the trace's first event;
reclaim sees it as ``T0 + seconds`` (UTC datetimes), as the service's clock.

What is real and what is modelled:

- Every placement is :func:`.scheduler.place` (through :class:`.simulator_pool.Pool`).
- Idle reclaim is :func:`.reclaim.decide`, evaluated at the reclaim sweep ticks
  (every ``GPUPool.reclaim_interval``, 5 s) on lease objects with the
  attributes of :class:`~.models.Lease`. Only the ticks at which a lease can
  become due are simulated: ``decide`` is a per-lease filter of state and
  ``now``, and state changes only at events, so a lease's first due tick is the
  first tick at or after ``idle_since + idle_timeout``; ``decide`` is called on
  it there (and says "not due" if a cell started again meanwhile). The kernel
  is alive while its session is open, so ``last_heartbeat_at`` is ``now``.
- A session runs its cells one after another; a cell that arrives while the
  previous one runs waits for it (as in Jupyter).
- When nothing fits, the request waits. The service itself answers
  ``pool_full`` and the client retries (``--wait``); the simulator retries
  waiting requests, oldest first, whenever capacity is freed, and a request
  that does not fit does not hold back a smaller one behind it — except in
  the first-come ``batch`` policy, where the queue is strict FIFO.
- The wait of a cell is its start minus its trace submit time, in seconds.
  Starting a worker and moving variables (park/resume) take no time here;
  the share of cells that had to acquire a lease is reported instead.

Policies (:data:`POLICIES`):

- ``reservation``: a session holds whole GPUs (``num_gpu`` of its cells) from
  its first cell until it has been idle 30 minutes (the same reclaim rule with
  ``idle_timeout = 1800``) or its kernel shuts down; the next cell re-acquires.
- ``gpupool``: a 1-GPU session holds only its slice; 4/8-GPU sessions whole
  GPUs; released after ``idle_timeout`` (default 5 minutes) idle, parked, and
  resumed (re-acquired) on the next cell.
- ``batch``: first-come batch: each cell is a job holding ``num_gpu`` whole
  GPUs only while it runs; strict FIFO queue.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import numpy as np

from gpupool.schema import LeaseState

from .reclaim import decide
from .scheduler import Placement
from .simulator_pool import FULL, Pool, uniform_pool
from .simulator_workload import NotebookWorkload

#: The virtual clock's origin (the sensei trace starts on June 1, 2021).
T0 = datetime(2021, 6, 1, tzinfo=timezone.utc)
#: The service's defaults (``GPUPool.reclaim_interval``, ``heartbeat_ttl``), seconds.
SWEEP_S = 5.0
HEARTBEAT_TTL_S = 60.0


@dataclass(frozen=True)
class NotebookPolicy:
    """``slices``: a 1-GPU session asks for its slice, else a whole GPU;
    ``idle_timeout``: seconds a lease outlives its last cell (None: released
    when the cell ends); ``fifo``: a waiting request blocks those behind it."""

    name: str
    slices: bool
    idle_timeout: float | None
    fifo: bool = False


def policies(gpupool_idle_timeout: float = 300.0) -> dict[str, NotebookPolicy]:
    """The compared policies, by name; ``gpupool_idle_timeout`` in seconds."""
    return {"reservation": NotebookPolicy("reservation", slices=False, idle_timeout=1800.0),
            "gpupool": NotebookPolicy("gpupool", slices=True, idle_timeout=gpupool_idle_timeout),
            "batch": NotebookPolicy("batch", slices=False, idle_timeout=None, fifo=True)}


POLICIES = tuple(policies())


@dataclass(eq=False, slots=True)
class SimLease:
    """A lease as :func:`.reclaim.decide` reads it (attributes of ``models.Lease``), plus what it holds."""

    id: str
    started_at: datetime
    idle_timeout: float
    placement: Placement
    granted: float
    state: str = LeaseState.active.value
    worker_state: str = "busy"
    idle_since: datetime | None = None
    last_heartbeat_at: datetime | None = None
    heartbeat_ttl: float = HEARTBEAT_TTL_S


@dataclass(eq=False, slots=True)
class _Session:
    milli: int
    gpus: int
    group: int
    closes: float
    pending: deque = field(default_factory=deque)
    running: bool = False
    waiting: bool = False
    lease: SimLease | None = None


@dataclass(frozen=True)
class NotebookResult:
    """One replay. GPU-hours: ``held`` = sum of fraction x GPUs x hours leased;
    ``busy`` = what running cells need (slice or whole GPUs) x hours run.
    ``waits``: seconds each cell waited before starting (trace order)."""

    policy: str
    pool_size: int
    held_gpu_hours: float
    busy_gpu_hours: float
    waits: np.ndarray
    acquisitions: int
    peak_held_gpus: float
    held_by_group: dict[int, float]
    seconds: float

    @property
    def utilization(self) -> float:
        return self.busy_gpu_hours / self.held_gpu_hours if self.held_gpu_hours else 0.0

    def wait_percentile(self, q: float) -> float:
        return float(np.percentile(self.waits, q)) if len(self.waits) else 0.0

    @property
    def waited_share(self) -> float:
        return float(np.mean(self.waits > 0)) if len(self.waits) else 0.0

    def row(self) -> dict:
        """Plain numbers for tables and JSON."""
        return {"policy": self.policy, "pool_size": self.pool_size,
                "held_gpu_hours": round(self.held_gpu_hours, 1), "busy_gpu_hours": round(self.busy_gpu_hours, 1),
                "utilization": round(self.utilization, 4), "p50_wait_s": self.wait_percentile(50),
                "p95_wait_s": self.wait_percentile(95), "p99_wait_s": self.wait_percentile(99),
                "waited_share": round(self.waited_share, 4),
                "acquired_share": round(self.acquisitions / max(1, len(self.waits)), 4),
                "peak_held_gpus": round(self.peak_held_gpus, 2), "sim_seconds": round(self.seconds, 2)}


def simulate_notebooks(workload: NotebookWorkload, policy: NotebookPolicy, pool_size: int, *,
                       per_node: int = 8, pool: Pool | None = None) -> NotebookResult:
    """Replay ``workload`` under ``policy`` on ``pool_size`` GPUs (nodes of ``per_node``)."""
    import time

    wall = time.perf_counter()
    return _Replay(workload, policy, pool or uniform_pool(pool_size, per_node=per_node)).run(pool_size, wall)


class _Replay:
    ARRIVE, END, TICK, CLOSE = 0, 1, 2, 3

    def __init__(self, workload: NotebookWorkload, policy: NotebookPolicy, pool: Pool) -> None:
        self.workload, self.policy, self.pool = workload, policy, pool
        self.sessions = [_Session(s.milli if policy.slices else FULL, s.gpus, s.group, s.closes)
                         for s in workload.sessions]
        self.need = [s.gpus * s.milli / FULL for s in workload.sessions]  # GPUs a cell needs
        self.events: list = []
        self.seq = 0
        self.waits = np.full(len(workload.cells), np.nan)
        self.fifo: deque = deque()
        self.by_shape: dict[tuple[int, int], deque] = {}
        self.held = 0.0
        self.busy = 0.0
        self.held_by_group: dict[int, float] = {}
        self.acquisitions = 0
        self.peak = 0
        self.leases = 0

    def push(self, when: float, kind: int, arg) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, kind, self.seq, arg))

    def run(self, pool_size: int, wall: float) -> NotebookResult:
        import time

        for i, cell in enumerate(self.workload.cells):
            self.push(cell.submit, self.ARRIVE, i)
        for sid, session in enumerate(self.sessions):
            self.push(session.closes, self.CLOSE, sid)
        while self.events:
            now, kind, _, arg = heapq.heappop(self.events)
            if kind == self.ARRIVE:
                sid = self.workload.cells[arg].session
                self.sessions[sid].pending.append(arg)
                self.dispatch(sid, now)
            elif kind == self.END:
                self.cell_ended(arg, now)
            elif kind == self.TICK:
                sid, lease = arg
                session = self.sessions[sid]
                if session.lease is lease:
                    lease.last_heartbeat_at = T0 + timedelta(seconds=now)
                    if decide([lease], T0 + timedelta(seconds=now)):
                        self.release(sid, now)
            elif kind == self.CLOSE:
                session = self.sessions[arg]
                if session.lease is not None and not session.running and not session.pending:
                    self.release(arg, now)
        if np.isnan(self.waits).any():
            raise AssertionError("a cell never started")
        return NotebookResult(self.policy.name, pool_size, self.held / 3600, self.busy / 3600, self.waits,
                              self.acquisitions, self.peak / FULL,
                              {g: h / 3600 for g, h in sorted(self.held_by_group.items())},
                              time.perf_counter() - wall)

    # -- a session's cells ------------------------------------------------------

    def dispatch(self, sid: int, now: float) -> None:
        """Start the session's next cell, or ask for a lease for it."""
        session = self.sessions[sid]
        if session.running or session.waiting or not session.pending:
            return
        if session.lease is not None:
            self.start(sid, now)
            return
        shape = (session.milli, session.gpus)
        queue = self.fifo if self.policy.fifo else self.by_shape.setdefault(shape, deque())
        if not queue and self.acquire(sid, now):
            return
        session.waiting = True
        queue.append((now, sid))

    def start(self, sid: int, now: float) -> None:
        session = self.sessions[sid]
        cell = session.pending.popleft()
        self.waits[cell] = now - self.workload.cells[cell].submit
        session.running = True
        session.lease.worker_state = "busy"
        session.lease.idle_since = None
        self.push(now + self.workload.cells[cell].duration, self.END, cell)

    def cell_ended(self, cell: int, now: float) -> None:
        sid = self.workload.cells[cell].session
        session = self.sessions[sid]
        session.running = False
        self.busy += self.need[sid] * self.workload.cells[cell].duration
        timeout = self.policy.idle_timeout
        if timeout is None or (now >= session.closes and not session.pending):
            self.release(sid, now)  # batch job done, or the kernel shut down
            self.dispatch(sid, now)
            return
        if session.pending:
            self.start(sid, now)
            return
        lease = session.lease
        lease.worker_state = "idle"
        lease.idle_since = T0 + timedelta(seconds=now)
        self.push(math.ceil((now + timeout) / SWEEP_S) * SWEEP_S, self.TICK, (sid, lease))

    # -- leases -------------------------------------------------------------------

    def acquire(self, sid: int, now: float) -> bool:
        """Ask ``place()``; on success the lease holds capacity and the cell starts."""
        session = self.sessions[sid]
        placement = self.pool.place(session.milli, session.gpus)
        if not isinstance(placement, Placement):
            return False
        self.pool.take(placement)
        self.peak = max(self.peak, self.pool.allocated_milli)
        self.leases += 1
        self.acquisitions += 1
        started = T0 + timedelta(seconds=now)
        session.lease = SimLease(f"L-{self.leases:012d}", started, self.policy.idle_timeout or 0.0, placement, now,
                                 last_heartbeat_at=started)
        session.waiting = False
        self.start(sid, now)
        return True

    def release(self, sid: int, now: float) -> None:
        session = self.sessions[sid]
        lease = session.lease
        if lease is None:
            return
        session.lease = None
        held = lease.placement.fraction * len(lease.placement.gpus) * (now - lease.granted)
        self.held += held
        self.held_by_group[session.group] = self.held_by_group.get(session.group, 0.0) + held
        self.pool.give(lease.placement)
        self.retry(now)

    def retry(self, now: float) -> None:
        """Capacity was freed: retry waiting requests, oldest first."""
        if self.policy.fifo:
            while self.fifo and self.acquire(self.fifo[0][1], now):
                self.fifo.popleft()
            return
        heads = sorted((queue[0][0], shape) for shape, queue in self.by_shape.items() if queue)
        failed_milli, failed_gpus = FULL + 1, 10**9  # smallest slice / whole-GPU count refused in this pass
        for _, shape in heads:
            milli, gpus = shape
            if (gpus == 1 and milli >= failed_milli) or (gpus > 1 and gpus >= failed_gpus):
                continue
            queue = self.by_shape[shape]
            while queue and self.acquire(queue[0][1], now):
                queue.popleft()
            if queue:
                if gpus == 1:
                    failed_milli = milli
                    if milli == FULL:
                        failed_gpus = 2  # no idle GPU left
                else:
                    failed_gpus = gpus
