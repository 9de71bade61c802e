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
- When nothing fits, the request waits. The simulator retries waiting
  requests whenever capacity is freed: interactive before batch when the
  policy has classes (the service's :func:`.priority.class_rank`), oldest
  first within a class, and a request that does not fit does not hold back
  a smaller one behind it — except in the first-come ``batch`` policy, where
  the queue is strict FIFO.
- Pressure is the service's rule, :func:`.priority.plan`, on every active
  lease and waiting request (no guaranteed shares: the trace has no quotas).
  As the service's sweep, the replay evaluates it at sweep ticks (at the
  tick after any change while requests wait, and at the tick of the plan's
  next deadline) and acts on what is due: an idle lease past its early
  deadline is parked; a preemptible lease past its ``at`` has its cell
  interrupted and is parked. Whatever a tick frees is then offered to the
  queue at once (interactive first).
- With a :class:`BatchSource` backlog, batch jobs (one cell each, released
  when it ends; preemptible, as issue 16's backlog) are queued whenever held
  plus queued demand falls under its load x the pool, until the trace's
  period is over. A preempted job is queued again as a new request (the
  parked notebook's next cell), losing its progress (or keeping it,
  ``resume_preempted``).
- The wait of a cell is its start minus its trace submit time, in seconds.
  Starting a worker and moving variables (park/resume) take no time here;
  the share of cells that had to acquire a lease is reported instead.

Policies (:data:`POLICIES`):

- ``reservation``: a session holds whole GPUs (``num_gpu`` of its cells) from
  its first cell until it has been idle 30 minutes (the same reclaim rule with
  ``idle_timeout = 1800``) or its kernel shuts down; the next cell re-acquires.
- ``gpupool``: a 1-GPU session holds only its slice; 4/8-GPU sessions whole
  GPUs; released after ``idle_timeout`` (default 5 minutes) idle, or after
  the 2-minute pressure grace while others wait, parked, and resumed
  (re-acquired) on the next cell; interactive first; batch preempted after
  the grace plus the 30 s notice (the service's defaults).
- ``batch``: first-come batch: each cell is a job holding ``num_gpu`` whole
  GPUs only while it runs; strict FIFO queue.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import numpy as np

from gpupool.schema import LeaseState

from . import priority
from .queue import estimate
from .reclaim import decide
from .scheduler import Placement
from .simulator_pool import FULL, Pool, uniform_pool
from .simulator_results import NotebookResult
from .simulator_rules import eta
from .simulator_workload import NotebookWorkload

#: The virtual clock's origin (the sensei trace starts on June 1, 2021).
T0 = datetime(2021, 6, 1, tzinfo=timezone.utc)
#: The service's defaults (``GPUPool.reclaim_interval``, ``heartbeat_ttl``), seconds.
SWEEP_S = 5.0
HEARTBEAT_TTL_S = 60.0
#: The service's defaults (``GPUPool.pressure_grace``, ``preemption_notice``), seconds.
PRESSURE_GRACE_S = 120.0
PREEMPTION_NOTICE_S = 30.0
INTERACTIVE, BATCH = priority.INTERACTIVE, priority.BATCH


@dataclass(frozen=True)
class NotebookPolicy:
    """``slices``: a 1-GPU session asks for its slice, else a whole GPU;
    ``idle_timeout``: seconds a lease outlives its last cell (None: released
    when the cell ends); ``fifo``: one strict first-come queue for everyone;
    ``pressure_grace``: seconds after which an idle lease is parked while
    others wait (None: only the idle timeout); ``classes``: interactive
    requests go before batch ones (False: one queue, oldest first);
    ``preemption_notice``: the pool allows preemption, with this notice
    (``c.GPUPool.preemption_notice``; batch jobs are all preemptible here;
    None: ``allow_preemption = False``); ``headroom_nodes``: batch is not placed on an idle node while
    only this many nodes are idle (room kept for interactive arrivals);
    ``resume_preempted``: a preempted batch job keeps its progress (it was
    parked with its variables and its loop resumes) instead of restarting."""

    name: str
    slices: bool
    idle_timeout: float | None
    fifo: bool = False
    pressure_grace: float | None = None
    classes: bool = False
    preemption_notice: float | None = None
    headroom_nodes: int = 0
    resume_preempted: bool = False


def policies(gpupool_idle_timeout: float = 300.0,
             pressure_grace: float | None = PRESSURE_GRACE_S) -> dict[str, NotebookPolicy]:
    """The compared policies, by name; times in seconds. ``dedicated`` is
    not a replay (:func:`dedicated_gpus`)."""
    return {"reservation": NotebookPolicy("reservation", slices=False, idle_timeout=1800.0),
            "gpupool": NotebookPolicy("gpupool", slices=True, idle_timeout=gpupool_idle_timeout,
                                      pressure_grace=pressure_grace, classes=True,
                                      preemption_notice=PREEMPTION_NOTICE_S),
            "batch": NotebookPolicy("batch", slices=False, idle_timeout=None, fifo=True)}


POLICIES = tuple(policies())


def dedicated_gpus(workload: NotebookWorkload) -> dict[int, int]:
    """The dedicated baseline: per user, the most whole GPUs their cells run
    at once over the trace (a slice is a card of its own). Each user owns
    that many cards for the whole period; nobody waits."""
    from .simulator_rules import peak_concurrent

    by_user: dict[int, list] = {}
    for cell in workload.cells:
        session = workload.sessions[cell.session]
        by_user.setdefault(session.user, []).append((cell.submit, cell.submit + cell.duration, session.gpus))
    return {user: int(peak_concurrent(spans)) for user, spans in sorted(by_user.items())}


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
    user: int = 0
    klass: str = INTERACTIVE
    pending: deque = field(default_factory=deque)
    running: bool = False
    waiting: bool = False
    lease: SimLease | None = None
    run_start: float = 0.0
    token: int = 0


class BatchSource:
    """Batch jobs drawn (seeded, with replacement) from ``(milli, gpus,
    seconds)`` arrays, added whenever held plus queued demand falls under
    ``load`` x the pool (a backlog that never runs dry)."""

    def __init__(self, milli: np.ndarray, gpus: np.ndarray, seconds: np.ndarray, *, load: float = 1.2,
                 users: int = 100, seed: int = 0) -> None:
        from .simulator_workload import zipf_weights

        self.milli, self.gpus, self.seconds, self.load = milli, gpus, seconds, load
        self.rng = np.random.default_rng(seed + 3)
        self.users, self.weights = users, zipf_weights(users, 1.0)
        self.picks: list[int] = []

    def draw(self) -> tuple[int, int, float, int]:
        """``(milli, gpus, seconds, user)`` of the next job."""
        if not self.picks:
            self.picks = self.rng.integers(len(self.milli), size=4096).tolist()[::-1]
        i = self.picks.pop()
        return int(self.milli[i]), int(self.gpus[i]), float(self.seconds[i]), int(self.rng.integers(self.users))


def simulate_notebooks(workload: NotebookWorkload, policy: NotebookPolicy, pool_size: int, *,
                       per_node: int = 8, pool: Pool | None = None, backlog: BatchSource | None = None,
                       with_eta: bool = False, users: int | None = None) -> NotebookResult:
    """Replay ``workload`` under ``policy`` on ``pool_size`` GPUs (nodes of
    ``per_node``), with ``backlog`` batch jobs if given; ``with_eta`` records
    the ETA of every interactive request that waits (:func:`.simulator_rules.eta`)
    next to the queue's old estimate and the wait it had."""
    wall = time.perf_counter()
    replay = _Replay(workload, policy, pool or uniform_pool(pool_size, per_node=per_node), backlog, with_eta)
    return replay.run(pool_size, wall, users or len({s.user for s in workload.sessions}) or 1)


class _Replay:
    ARRIVE, END, TICK, CLOSE, PRESSURE, PREEMPT = range(6)

    def __init__(self, workload: NotebookWorkload, policy: NotebookPolicy, pool: Pool,
                 backlog: BatchSource | None, with_eta: bool) -> None:
        self.workload, self.policy, self.pool, self.backlog, self.with_eta = workload, policy, pool, backlog, with_eta
        self.sessions = [_Session(s.milli if policy.slices else FULL, s.gpus, s.group, s.closes, s.user)
                         for s in workload.sessions]
        self.need = [s.gpus * s.milli / FULL for s in workload.sessions]  # GPUs a cell needs
        self.submit = [c.submit for c in workload.cells]
        self.duration = [c.duration for c in workload.cells]
        self.cell_session = [c.session for c in workload.cells]
        self.queued_at = list(self.submit)
        self.interactive_cells = len(workload.cells)
        self.waits = [math.nan] * len(workload.cells)
        self.batch_waits: list[float] = []
        self.started = 0  # interactive cells that started
        self.waiting_interactive: set[int] = set()
        self.waiters: dict[int, priority.Asking] = {}  # every waiting request, as the pressure rule sees it
        self.checks: set[float] = set()  # sweep ticks at which the pressure plan is evaluated
        self.last_check = -math.inf
        self.holding: dict[int, priority.Held] = {}  # every active lease, as the pressure rule sees it
        self.events: list = []
        self.seq = 0
        self.fifo: deque = deque()
        self.queues: dict[tuple[str, int, int], deque] = {}
        self.waiting_gpus = 0.0
        self.waiting_count = 0
        self.idle: dict[int, float] = {}  # interactive sessions whose lease is idle -> idle since
        self.batch_cell: dict[int, int] = {}  # batch session -> its one cell
        names: dict[str, int] = {}
        self.node_of = [names.setdefault(spec.node, len(names)) for spec in pool.specs]
        self.node_gpus: dict[str, list[int]] = {}
        for g, spec in enumerate(pool.specs):
            self.node_gpus.setdefault(spec.node, []).append(g)
        self.idle_nodes = sum(self.node_idle(name) for name in self.node_gpus)
        self.held = self.busy = self.lost = self.busy_in_period = 0.0
        #: The period cluster utilization is measured over: the trace's whole days.
        self.period = max(86400.0, math.ceil(max(self.submit, default=0.0) / 86400) * 86400)
        self.busy_by_class: dict[str, float] = {}
        self.held_by_group: dict[int, float] = {}
        self.acquisitions = self.peak = self.leases = self.parks = self.early_parks = self.preemptions = 0
        self.recent: dict[str, deque] = {INTERACTIVE: deque(maxlen=200), BATCH: deque(maxlen=200)}
        self.recent_holds: deque = deque(maxlen=200)
        self.eta_pending: dict[int, tuple[float | None, float | None]] = {}
        self.eta_errors: list[tuple[float | None, float | None, float]] = []

    def push(self, when: float, kind: int, arg) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, kind, self.seq, arg))

    def run(self, pool_size: int, wall: float, users: int) -> NotebookResult:
        for i, cell in enumerate(self.workload.cells):
            self.push(cell.submit, self.ARRIVE, i)
        for sid, session in enumerate(self.sessions):
            self.push(session.closes, self.CLOSE, sid)
        period = self.period
        if self.backlog is not None:
            self.push(0.0, self.PRESSURE, None)  # starts the backlog (a check at 0 retries first)
        while self.events:
            now, kind, _, arg = heapq.heappop(self.events)
            if self.backlog is not None and now > period and self.started == self.interactive_cells:
                self.backlog = None  # the period is over and every cell started: no more batch jobs
            self.handle(kind, arg, now)
        if any(math.isnan(w) for w in self.waits):
            raise AssertionError("a cell never started")
        return NotebookResult(self.policy.name, pool_size, self.held / 3600, self.busy / 3600, np.array(self.waits),
                              self.acquisitions - len(self.batch_waits), self.peak / FULL,
                              {g: h / 3600 for g, h in sorted(self.held_by_group.items())},
                              time.perf_counter() - wall, period, users, np.array(self.batch_waits),
                              {k: v / 3600 for k, v in self.busy_by_class.items()}, self.lost / 3600,
                              self.parks, self.early_parks, self.preemptions, tuple(self.eta_errors),
                              self.busy_in_period / 3600)

    def handle(self, kind: int, arg, now: float) -> None:
        if kind == self.ARRIVE:
            sid = self.cell_session[arg]
            self.sessions[sid].pending.append(arg)
            self.dispatch(sid, now)
        elif kind == self.END:
            cell, token = arg
            if self.sessions[self.cell_session[cell]].token == token:
                self.cell_ended(cell, now)
        elif kind == self.TICK:
            sid, lease = arg
            session = self.sessions[sid]
            if session.lease is lease:
                lease.last_heartbeat_at = T0 + timedelta(seconds=now)
                if decide([lease], T0 + timedelta(seconds=now)):
                    self.parks += now < session.closes
                    self.release(sid, now)
        elif kind == self.CLOSE:
            session = self.sessions[arg]
            if session.lease is not None and not session.running and not session.pending:
                self.release(arg, now)
        elif kind == self.PRESSURE:
            if arg is None:
                self.retry(now)
            else:
                self.checks.discard(now)
                self.pressure(now)

    # -- a session's cells ------------------------------------------------------

    def queue_of(self, sid: int) -> deque:
        session = self.sessions[sid]
        if self.policy.fifo:
            return self.fifo
        klass = session.klass if self.policy.classes else INTERACTIVE
        return self.queues.setdefault((klass, session.milli, session.gpus), deque())

    def dispatch(self, sid: int, now: float) -> None:
        """Start the session's next cell, or ask for a lease for it."""
        session = self.sessions[sid]
        if session.running or session.waiting or not session.pending:
            return
        if session.lease is not None:
            self.start(sid, now)
            return
        queue = self.queue_of(sid)
        if not queue and self.acquire(sid, now):
            return
        self.enqueue(sid, now, queue)
        if session.klass == INTERACTIVE and self.with_eta:
            self.record_eta(sid, now)

    def enqueue(self, sid: int, now: float, queue: deque, front: bool = False) -> None:
        session = self.sessions[sid]
        session.waiting = True
        self.waiting_gpus += self.need[sid]
        self.waiting_count += 1
        self.queued_at[session.pending[0]] = now
        (queue.appendleft if front else queue.append)((now, sid))
        if session.klass == INTERACTIVE:
            self.waiting_interactive.add(sid)
        self.waiters[sid] = priority.Asking(str(sid), str(session.user), self.need[sid], session.klass,
                                            T0 + timedelta(seconds=now))
        self.check_at(now)

    def start(self, sid: int, now: float) -> None:
        session = self.sessions[sid]
        cell = session.pending.popleft()
        wait = now - self.queued_at[cell]
        if cell < self.interactive_cells:
            self.started += math.isnan(self.waits[cell])
            self.waits[cell] = now - self.submit[cell]
            if cell in self.eta_pending:
                self.eta_errors.append((*self.eta_pending.pop(cell), wait))
        else:
            self.batch_waits.append(wait)
        session.running = True
        session.run_start = now
        session.token += 1
        session.lease.worker_state = "busy"
        session.lease.idle_since = None
        self.idle.pop(sid, None)
        self.hold(sid)
        self.push(now + self.duration[cell], self.END, (cell, session.token))

    def cell_ended(self, cell: int, now: float) -> None:
        sid = self.cell_session[cell]
        session = self.sessions[sid]
        session.running = False
        self.count_busy(sid, self.duration[cell], now)
        self.recent[session.klass].append(self.duration[cell])
        timeout = self.policy.idle_timeout if session.klass == INTERACTIVE else None
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
        self.idle[sid] = now
        self.hold(sid)
        self.push(math.ceil((now + timeout) / SWEEP_S) * SWEEP_S, self.TICK, (sid, lease))
        self.check_at(now)

    def count_busy(self, sid: int, seconds: float, now: float) -> None:
        """``sid`` ran ``seconds`` of useful work up to ``now``."""
        session = self.sessions[sid]
        work = self.need[sid] * seconds
        self.busy += work
        self.busy_in_period += self.need[sid] * max(0.0, min(now, self.period) - session.run_start)
        self.busy_by_class[session.klass] = self.busy_by_class.get(session.klass, 0.0) + work

    # -- pressure and preemption: the service's rule (priority.plan) at sweep ticks ----------

    def hold(self, sid: int) -> None:
        """Record ``sid``'s lease as the pressure rule sees it (after it started, ran or went idle)."""
        session, lease = self.sessions[sid], self.sessions[sid].lease
        timeout = self.policy.idle_timeout if session.klass == INTERACTIVE else None
        idle_since = lease.idle_since if sid in self.idle else None
        deadline = idle_since + timedelta(seconds=timeout) if idle_since and timeout is not None else None
        self.holding[sid] = priority.Held(str(sid), str(session.user), self.held_gpus(sid), session.klass,
                                          session.klass == BATCH, session.running, lease.started_at, idle_since,
                                          deadline)

    def check_at(self, now: float) -> None:
        """Evaluate the plan at the first sweep tick at or after ``now``, once
        per tick (the service plans once per sweep), if it can act."""
        if self.policy.pressure_grace is None or not self.waiters:
            return
        tick = math.ceil(now / SWEEP_S) * SWEEP_S
        tick += SWEEP_S if tick <= self.last_check else 0.0
        if tick not in self.checks:
            self.checks.add(tick)
            self.push(tick, self.PRESSURE, "check")

    def pressure(self, now: float) -> None:
        """A sweep tick: :func:`.priority.plan` on every lease and waiter; park
        the idle leases and interrupt the preemptible cells that are due, offer
        what they free to the queue, and come back at the plan's next moment."""
        self.last_check = now
        notice = self.policy.preemption_notice
        if self.policy.pressure_grace is None or not self.waiters or not (self.idle or notice is not None):
            return  # the plan parks only idle leases and preempts only where the pool allows it
        plan = priority.plan(list(self.holding.values()), list(self.waiters.values()), grace=self.policy.pressure_grace,
                             notice=notice or 0.0, allow_preemption=notice is not None, guaranteed_gpus={})
        at, later = T0 + timedelta(seconds=now), []
        for lease_id, park in plan.parks.items():
            if park.deadline > at:
                later.append(park.deadline)
                continue
            sid = int(lease_id)
            self.early_parks += 1
            self.parks += now < self.sessions[sid].closes
            self.release(sid, now, retry=False)
        for lease_id, preemption in plan.preemptions.items():
            if preemption.at > at:
                later.append(preemption.at)
                continue
            self.preempt(int(lease_id), now)
        if len(later) < len(plan.parks) + len(plan.preemptions):
            self.retry(now)
        if later:
            self.check_at((min(later) - T0).total_seconds())

    def node_idle(self, node: str) -> bool:
        return not any(self.pool.milli[g] for g in self.node_gpus[node])

    def held_gpus(self, sid: int) -> float:
        placement = self.sessions[sid].lease.placement
        return placement.fraction * len(placement.gpus)

    def preempt(self, sid: int, now: float) -> None:
        """Interrupt batch job ``sid``'s cell and park it; its cell is queued
        again as a new request, its work lost (or kept, ``resume_preempted``)."""
        session = self.sessions[sid]
        ran = now - session.run_start
        cell = self.batch_cell[sid]
        if self.policy.resume_preempted:
            self.count_busy(sid, ran, now)
            self.duration[cell] -= ran
        else:
            self.lost += self.need[sid] * ran
        self.preemptions += 1
        session.running = False
        session.token += 1
        self.release(sid, now, retry=False)
        session.pending.appendleft(cell)
        self.enqueue(sid, now, self.queue_of(sid))

    # -- leases -------------------------------------------------------------------

    def acquire(self, sid: int, now: float) -> bool:
        """Ask ``place()``; on success the lease holds capacity and the cell starts."""
        session = self.sessions[sid]
        placement = self.pool.place(session.milli, session.gpus)
        if not isinstance(placement, Placement):
            return False
        was_idle = self.node_idle(placement.node)
        if session.klass == BATCH and was_idle and self.idle_nodes <= self.policy.headroom_nodes:
            return False
        self.pool.take(placement)
        self.idle_nodes -= was_idle
        self.peak = max(self.peak, self.pool.allocated_milli)
        self.leases += 1
        self.acquisitions += 1
        started = T0 + timedelta(seconds=now)
        session.lease = SimLease(f"L-{self.leases:012d}", started, self.policy.idle_timeout or 0.0, placement, now,
                                 last_heartbeat_at=started)
        if session.waiting:
            session.waiting = False
            self.waiting_gpus -= self.need[sid]
            self.waiting_count -= 1
            self.waiting_interactive.discard(sid)
            del self.waiters[sid]
        self.start(sid, now)
        return True

    def release(self, sid: int, now: float, retry: bool = True) -> None:
        session = self.sessions[sid]
        lease = session.lease
        if lease is None:
            return
        self.idle.pop(sid, None)
        session.lease = None
        self.holding.pop(sid, None)
        held = lease.placement.fraction * len(lease.placement.gpus) * (now - lease.granted)
        self.held += held
        self.recent_holds.append(now - lease.granted)
        self.held_by_group[session.group] = self.held_by_group.get(session.group, 0.0) + held
        self.pool.give(lease.placement)
        self.idle_nodes += self.node_idle(lease.placement.node)
        self.check_at(now)  # what the plan targets shifts when a lease goes
        if retry:
            self.retry(now)

    def retry(self, now: float) -> None:
        """Capacity was freed: retry waiting requests, interactive first (with
        classes, :func:`.priority.class_rank`), oldest first within a class;
        strict FIFO for ``fifo``."""
        self.top_up(now)
        if self.policy.fifo:
            while self.fifo and self.acquire(self.fifo[0][1], now):
                self.fifo.popleft()
            return
        heads = [(queue[0][0], key) for key, queue in self.queues.items() if queue]
        heads.sort(key=lambda head: (priority.class_rank(head[1][0]), head))
        failed_milli, failed_gpus = FULL + 1, 10**9  # smallest slice / whole-GPU count refused in this pass
        for _, key in heads:
            _, milli, gpus = key
            if (gpus == 1 and milli >= failed_milli) or (gpus > 1 and gpus >= failed_gpus):
                continue
            queue = self.queues[key]
            while queue and self.acquire(queue[0][1], now):
                queue.popleft()
            if queue:
                if gpus == 1:
                    failed_milli = milli
                    if milli == FULL:
                        failed_gpus = 2  # no idle GPU left
                else:
                    failed_gpus = gpus

    # -- the batch backlog --------------------------------------------------------

    def top_up(self, now: float) -> None:
        """Queue batch jobs until held plus queued demand is the backlog's load x the pool."""
        if self.backlog is None:
            return
        target = self.backlog.load * self.pool.capacity
        while self.pool.allocated_milli / FULL + self.waiting_gpus < target:
            milli, gpus, seconds, user = self.backlog.draw()
            sid, cell = len(self.sessions), len(self.submit)
            milli = milli if self.policy.slices or gpus > 1 else FULL
            self.sessions.append(_Session(milli, gpus, user % 4, math.inf, user, BATCH))
            self.need.append(gpus * milli / FULL)
            self.submit.append(now)
            self.duration.append(seconds)
            self.cell_session.append(sid)
            self.queued_at.append(now)
            self.batch_cell[sid] = cell
            self.sessions[sid].pending.append(cell)
            self.enqueue(sid, now, self.queue_of(sid))

    # -- the ETA --------------------------------------------------------------------

    def record_eta(self, sid: int, now: float) -> None:
        """The new ETA and the queue's old estimate for waiting ``sid``, kept until it starts."""
        session = self.sessions[sid]
        ahead = [(self.sessions[s].milli, self.sessions[s].gpus) for s, _ in self.waiting_before(sid)]
        frees = []
        pressure = self.policy.pressure_grace
        for other, s in enumerate(self.sessions):
            if s.lease is None:
                continue
            gpus = [self.pool.uuid_index[u] for u in s.lease.placement.gpus]
            frees.append((self.expected_end(other, now, pressure), gpus, s.milli))
        free = [FULL - m for m in self.pool.milli]
        predicted = eta(session.milli, session.gpus, ahead, free, self.node_of, frees, now)
        holding = sum(1 for s in self.sessions if s.lease is not None)
        old = estimate(len(ahead) + 1, list(self.recent_holds), holding)
        self.eta_pending[session.pending[0]] = (predicted, old)

    def waiting_before(self, sid: int) -> list[tuple[int, float]]:
        items = [(s, at) for q in ([self.fifo] if self.policy.fifo else self.queues.values()) for at, s in q
                 if s != sid]
        mine = self.queued_at[self.sessions[sid].pending[0]]
        return [(s, at) for s, at in items if at <= mine and self.sessions[s].klass == INTERACTIVE]

    def expected_end(self, sid: int, now: float, pressure: float | None) -> float:
        """When ``sid``'s lease is expected to free its capacity, from what the service knows."""
        session = self.sessions[sid]
        if session.klass == BATCH:
            history = self.recent[BATCH]
            return max(now, session.run_start + (statistics.median(history) if history else 0.0))
        timeout = self.policy.idle_timeout or 0.0
        after = min(timeout, pressure) if pressure is not None else timeout
        if sid in self.idle:
            return max(now, math.ceil((self.idle[sid] + after) / SWEEP_S) * SWEEP_S)
        history = self.recent[INTERACTIVE]
        ends = max(now, session.run_start + (statistics.median(history) if history else 0.0))
        return math.ceil((ends + after) / SWEEP_S) * SWEEP_S
