"""Replay notebook sessions against the real scheduler and reclaim rules, on a virtual clock.

Who calls it: :mod:`.cli` (``gpupool simulate --workload sensei``) and
``bench/simulate_report.py``. Time is seconds since the trace's first event;
reclaim sees it as ``sweep.T0 + seconds`` (UTC datetimes), as the service's clock.

What is real and what is modelled:

- Every placement is the service's ``place()`` (through :class:`.pool.SimulatedPool`).
- Idle reclaim is :func:`gpupool.hub_plugin.rules.reclaim.decide`, evaluated
  at the reclaim sweep ticks (every ``PoolLeases.reclaim_interval``, 5 s) on
  lease objects with the attributes of the service's ``Lease`` rows
  (:class:`.sweep.SimLease`). Only the ticks at which a lease can
  become due are simulated: ``decide`` is a per-lease filter of state and
  ``now``, and state changes only at events, so a lease's first due tick is the
  first tick at or after ``idle_since + idle_timeout``; ``decide`` is called on
  it there (and says "not due" if a cell started again meanwhile). The kernel
  is alive while its session is open, so ``last_heartbeat_at`` is ``now``.
- A session runs its cells one after another; a cell that arrives while the
  previous one runs waits for it (as in Jupyter).
- When nothing fits, the request waits; whenever capacity is freed the
  waiting requests are retried in the order of :mod:`.waiting`
  (interactive first, oldest first, backfill; strict FIFO for ``batch``).
- Pressure is the service's rule, evaluated as its sweep does
  (:mod:`.sweep`): an idle lease past its early deadline is parked; a
  preemptible lease past its ``at`` has its cell interrupted and is parked.
  Whatever a tick frees is then offered to the queue at once.
- Park in place (``park_in_place``, the service's): a park freezes the
  worker on its node (:mod:`.parked`: its state in the node's RAM under the
  node's budget, the longest-parked spilled to its disk beyond it); the
  lease holds its share while the state moves off the GPU
  (:func:`.costs.warm_park_seconds`), then gives it back. The next cell
  resumes it where the service's rule puts it (:meth:`.SimulatedPool.place_resume`:
  its own node first), ahead of new requests; with no room there it goes to
  another node with room at a move's cost (``resume_moves``, the
  service's default ``c.PoolLeases.resume_moves``; never a cell frozen
  mid-way in RAM). With room nowhere it waits, pressing on its own node's
  leases only (and, a person's, holding that node against batch), as the
  service's resume does; without ``resume_moves`` it waits for that node
  alone. The cell then waits the resume's cost (:func:`.costs.resume_seconds`:
  warm, spilled or moved) on top of any queueing; that cost is also
  reported apart (``resume_waits``). Not modelled: the JupyterLab
  extension's early resume when the user comes back (a resume starts at the
  cell), a parked worker's host memory in the placement of new leases (the
  pool has no host dimension), a spill's own time (it runs in the
  background), and a worker's start for a new lease (reported as the share
  of cells that acquired one).
- With a :class:`BatchSource` backlog, batch jobs (one cell each, released
  when it ends; preemptible) are queued whenever held
  plus queued demand falls under its load x the pool, until the trace's
  period is over. A preempted job is parked in place with its cell frozen and
  resumes on its node, keeping its progress (``resume_preempted``; it moves
  only once spilled to disk; without ``resume_preempted``, or without
  parking in place, it is queued again as a new request and loses its
  progress).
- The wait of a cell is its start (after its resume) minus its trace
  submit time, in seconds.

"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque

import numpy as np

from gpupool.leaseclasses import lease_class, names as class_names
from gpupool.schema import WorkerState

from ..rules import priority
from ..rules.reclaim import decide
from ..rules.scheduler import Placement
from . import costs
from .backlog import BatchSource
from .eta_log import EtaLog
from .parked import ParkedLease, ParkedNodes
from .policies import NotebookPolicy
from .pool import FULL, SimulatedPool, uniform_pool
from .results import NotebookResult, Tally
from .sessions import SessionTable
from .sweep import SWEEP_S, Sweep, at
from .waiting import WaitQueue
from .workload import NotebookWorkload



def simulate_notebooks(workload: NotebookWorkload, policy: NotebookPolicy, pool_size: int, *,
                       per_node: int = 8, pool: SimulatedPool | None = None, backlog: BatchSource | None = None,
                       with_eta: bool = False, users: int | None = None) -> NotebookResult:
    """Replay ``workload`` under ``policy`` on ``pool_size`` GPUs (nodes of
    ``per_node``), with ``backlog`` batch jobs if given; ``with_eta`` records
    the ETA of every interactive request that waits (:func:`..rules.eta.eta_seconds`)
    next to the queue's old estimate and the wait it had."""
    wall = time.perf_counter()
    replay = _Replay(workload, policy, pool or uniform_pool(pool_size, per_node=per_node), backlog, with_eta)
    return replay.run(pool_size, wall, users or len({s.user for s in workload.sessions}) or 1)


class _Events:
    """A replay's future events, earliest first (at one time: in the order of
    their kinds, then as pushed): ``(when, kind, arg)``."""

    def __init__(self) -> None:
        self._heap: list = []
        self._seq = 0

    def push(self, when: float, kind: int, arg) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, kind, self._seq, arg))

    def pop(self) -> tuple:
        when, kind, _, arg = heapq.heappop(self._heap)
        return when, kind, arg

    def __bool__(self) -> bool:
        return bool(self._heap)


class _Replay:
    """The events of one replay, in time order, and what each one does to
    the sessions (:class:`.sessions.SessionTable`), the pool, the queue and
    the sweep; the tally records the outcome."""

    ARRIVE, END, TICK, CLOSE, PRESSURE, FREE = range(6)

    def __init__(self, workload: NotebookWorkload, policy: NotebookPolicy, pool: SimulatedPool,
                 backlog: BatchSource | None, with_eta: bool) -> None:
        self.workload, self.policy, self.pool, self.backlog, self.with_eta = workload, policy, pool, backlog, with_eta
        self.table = SessionTable(workload, policy.slices)
        self.sessions = self.table.sessions  # the table appends to it: one list
        self.started = 0  # the trace's cells that started
        self.sweep = Sweep(policy.rule())
        self.events = _Events()
        self.queue = WaitQueue(policy.fifo, policy.classes)
        self.period = self.table.period()
        self.tally = Tally(self.period, [math.nan] * len(workload.cells))
        self.eta = EtaLog(policy)
        self.parked = ParkedNodes(costs.parked_budget())
        self.resumes: dict[str, deque] = {}  # node -> resumes waiting for room there, as (queued at, sid)
        self.yielded: set[str] = set()  # nodes with a batch resume the batch rule held back
        self.resuming_gpus = 0.0  # GPUs the resumes waiting for their node ask for
        self.frozen: set[int] = set()  # parked sessions whose cell was frozen mid-way (preempted)
        self.unfit: set[tuple[int, int]] = set()  # (milli, GPUs) that fitted nowhere since capacity was freed
        self.fills: list[float] = []  # per session, its parked state's share of its slice's memory
        self.rng = np.random.default_rng(7)

    def run(self, pool_size: int, wall: float, users: int) -> NotebookResult:
        for i, cell in enumerate(self.workload.cells):
            self.events.push(cell.submit, self.ARRIVE, i)
        for sid, session in enumerate(self.sessions):
            self.events.push(session.closes, self.CLOSE, sid)
        period = self.period
        if self.backlog is not None:
            self.events.push(0.0, self.PRESSURE, None)  # starts the backlog (a check at 0 retries first)
        while self.events:
            now, kind, arg = self.events.pop()
            if self.backlog is not None and now > period and self.started == self.table.trace_cells:
                self.backlog = None  # the period is over and every cell started: no more batch jobs
            self.handle(kind, arg, now)
        if any(math.isnan(w) for w in self.tally.waits):
            raise AssertionError("a cell never started")
        batch = [c for c, sid in enumerate(self.table.cell_session[:self.table.trace_cells])
                 if lease_class(self.sessions[sid].klass).yields]
        self.tally.spills = self.parked.spills
        return self.tally.result(self.policy.name, pool_size, time.perf_counter() - wall, users, self.eta.errors, batch)

    def handle(self, kind: int, arg, now: float) -> None:
        if kind == self.ARRIVE:
            sid = self.table.cell_session[arg]
            self.sessions[sid].pending.append(arg)
            self.dispatch(sid, now)
        elif kind == self.END:
            cell, token = arg
            if self.sessions[self.table.cell_session[cell]].token == token:
                self.cell_ended(cell, now)
        elif kind == self.TICK:
            sid, lease = arg
            session = self.sessions[sid]
            if session.lease is lease:
                lease.last_heartbeat_at = at(now)
                if decide([lease], at(now)):
                    self.tally.parks += now < session.closes
                    self.park_or_release(sid, now)
        elif kind == self.CLOSE:
            session = self.sessions[arg]
            if session.lease is not None and not session.running and not session.pending:
                self.release(arg, now)
            elif not session.pending:
                self.unpark(arg)  # the kernel shut down: its parked worker goes
        elif kind == self.FREE:
            self.sweep.freed(arg)
            self.pool.give(arg)
            self.check_at(now)
            self.retry(now)
        elif kind == self.PRESSURE:
            if arg is None:
                self.retry(now)
            else:
                self.pressure(now)

    # -- a session's cells ------------------------------------------------------

    def queue_of(self, sid: int) -> deque:
        session = self.sessions[sid]
        return self.queue.of(session.klass, session.milli, session.gpus)

    def dispatch(self, sid: int, now: float) -> None:
        """Start the session's next cell, or ask for a lease for it."""
        session = self.sessions[sid]
        if session.running or session.waiting or not session.pending:
            return
        if session.lease is not None:
            self.start(sid, now)
            return
        if self.parked.get(sid) is not None:
            if not self.acquire(sid, now):
                self.wait_resume(sid, now)
            return
        queue = self.queue_of(sid)
        if not queue and self.acquire(sid, now):
            return
        self.enqueue(sid, now, queue)
        if not lease_class(session.klass).yields and self.with_eta:
            self.record_eta(sid, now)

    def enqueue(self, sid: int, now: float, queue: deque, front: bool = False, node: str | None = None) -> None:
        """``sid`` waits in ``queue`` from ``now``; ``node``: the only node it may go to (a resume's)."""
        self.table.wait(sid, now)
        (queue.appendleft if front else queue.append)((now, sid))
        self.sweep.waiters[sid] = self.table.asking(sid, now, node)
        self.check_at(now)

    def start(self, sid: int, now: float, delay: float = 0.0) -> None:
        """Start ``sid``'s next cell on its lease ``delay`` seconds from ``now`` (after its resume)."""
        session = self.sessions[sid]
        cell = session.pending.popleft()
        begin = now + delay
        wait = begin - self.table.queued_at[cell]
        if cell < self.table.trace_cells:
            self.started += math.isnan(self.tally.waits[cell])
            self.tally.waits[cell] = begin - self.table.submit[cell]
            self.eta.started(cell, wait)
        else:
            self.tally.batch_waits.append(wait)
        session.running = True
        session.run_start, session.cell = begin, cell
        session.token += 1
        session.lease.worker_state = WorkerState.busy
        session.lease.idle_since = None
        self.table.idle.pop(sid, None)
        self.hold(sid)
        self.events.push(begin + self.table.duration[cell], self.END, (cell, session.token))

    def cell_ended(self, cell: int, now: float) -> None:
        sid = self.table.cell_session[cell]
        session = self.sessions[sid]
        session.running = False
        self.count_busy(sid, self.table.duration[cell], now)
        self.eta.cells[session.klass].append(self.table.duration[cell])
        timeout = self.policy.idle_timeout if lease_class(session.klass).idles else None
        if timeout is None or (now >= session.closes and not session.pending):
            self.release(sid, now)  # batch job done, or the kernel shut down
            self.dispatch(sid, now)
            return
        if session.pending:
            self.start(sid, now)
            return
        lease = session.lease
        lease.worker_state = WorkerState.idle
        lease.idle_since = at(now)
        self.table.idle[sid] = now
        self.hold(sid)
        self.events.push(math.ceil((now + timeout) / SWEEP_S) * SWEEP_S, self.TICK, (sid, lease))
        self.check_at(now)

    def count_busy(self, sid: int, seconds: float, now: float) -> None:
        """``sid`` ran ``seconds`` of useful work up to ``now``."""
        session = self.sessions[sid]
        self.tally.ran(self.table.need[sid], seconds, session.klass, session.run_start, now)

    # -- pressure and preemption: the service's rule (priority.plan) at sweep ticks ----------

    def hold(self, sid: int) -> None:
        """Record ``sid``'s lease as the pressure rule sees it (after it started, ran or went idle)."""
        self.sweep.holding[sid] = self.table.held(sid, self.policy.idle_timeout)

    def check_at(self, now: float) -> None:
        """Evaluate the plan at the first sweep tick at or after ``now``, once
        per tick (the service plans once per sweep), if it can act."""
        tick = self.sweep.next_check(now)
        if tick is not None:
            self.events.push(tick, self.PRESSURE, "check")

    def pressure(self, now: float) -> None:
        """A sweep tick (:meth:`.Sweep.due`): park the idle leases and interrupt
        the preemptible cells that are due, offer what they free to the queue,
        and come back at the plan's next moment."""
        free = self.pool.whole_free(self.sweep.leaving) if self.sweep.wants_free_gpus() else None
        parks, preempts, later = self.sweep.due(now, bool(self.table.idle), free)
        for sid in parks:
            self.tally.early_parks += 1
            self.tally.parks += now < self.sessions[sid].closes
            self.park_or_release(sid, now, retry=False)
        for sid in preempts:
            self.preempt(sid, now)
        if parks or preempts:
            self.retry(now)
        if later is not None:
            self.check_at(later)

    def preempt(self, sid: int, now: float) -> None:
        """Interrupt preemptible ``sid``'s cell: with ``resume_preempted`` and
        parking in place, its worker is parked with the cell frozen and its
        resume asked at once, its work kept; otherwise its cell is queued again
        as a new request, its work lost (kept, with ``resume_preempted`` alone)."""
        session = self.sessions[sid]
        ran, cell = max(0.0, now - session.run_start), session.cell
        if self.policy.resume_preempted:
            self.count_busy(sid, ran, now)
            self.table.duration[cell] -= ran
        else:
            self.tally.lost += self.table.need[sid] * ran
        self.tally.preemptions += 1
        session.running = False
        session.token += 1
        session.pending.appendleft(cell)
        if self.policy.resume_preempted and self.policy.park_in_place:
            self.park(sid, now, retry=False)
            self.frozen.add(sid)
            self.wait_resume(sid, now)
            return
        self.release(sid, now, retry=False)
        self.enqueue(sid, now, self.queue_of(sid))

    # -- parking in place (:mod:`.parked`, costs :mod:`.costs`) ------------------------

    def park_or_release(self, sid: int, now: float, retry: bool = True) -> None:
        """An idle lease's deadline: parked in place while its notebook is open
        (where the policy parks in place), else released."""
        if self.policy.park_in_place and now < self.sessions[sid].closes:
            self.park(sid, now, retry)
        else:
            self.release(sid, now, retry)

    def park(self, sid: int, now: float, retry: bool) -> None:
        """Freeze ``sid``'s worker on its node: its share is given back once its
        state is off the GPU; the node spills its longest-parked past its budget."""
        placement = self.sessions[sid].lease.placement
        size = self.state_size(sid, placement)
        self.release(sid, now, retry, free_at=now + costs.warm_park_seconds(size, len(placement.gpus)))
        self.parked.park(sid, ParkedLease(placement, size, now))
        if self.policy.parked_claims:
            self.pool.claim(placement, 1)

    def unpark(self, sid: int) -> None:
        """``sid`` is parked no more (resumed, or its kernel shut down): its claim goes."""
        parked = self.parked.pop(sid)
        self.frozen.discard(sid)
        if parked is not None and self.policy.parked_claims:
            self.pool.claim(parked.placement, -1)

    def state_size(self, sid: int, placement: Placement) -> int:
        """Bytes of ``sid``'s GPU state on ``placement`` (:func:`.costs.state_bytes`)."""
        fill = self.policy.state_fill
        if fill is None:
            while len(self.fills) <= sid:
                self.fills.extend(self.rng.uniform(costs.FILL_LOW, 1.0, 4096).tolist())
            fill = self.fills[sid]
        memory = self.pool.specs[self.pool.uuid_index[placement.gpus[0]]].memory
        return costs.state_bytes(round(placement.fraction * FULL), len(placement.gpus), memory, fill)

    def wait_resume(self, sid: int, now: float) -> None:
        """Parked ``sid`` waits for room on its node (with ``resume_moves``: or on another node with room,
        :meth:`offer_resumes`). As in the service (``pressure.py``, ``queue.drain``), it presses on its
        node's leases only and, a person's, holds that node against batch, moves or not."""
        node = self.parked.get(sid).placement.node
        self.enqueue(sid, now, self.resumes.setdefault(node, deque()), node=node)
        self.resuming_gpus += self.table.need[sid]

    def may_move(self, sid: int) -> bool:
        """Whether parked ``sid`` may resume on another node: ``resume_moves``, and not a cell frozen
        mid-way in its node's RAM (the move's spill would interrupt it; ``parked.resume_ask``)."""
        return self.policy.resume_moves and not (sid in self.frozen and self.parked.get(sid).tier == "memory")

    def resume(self, sid: int, now: float) -> bool:
        """Resume parked ``sid`` where the service's rule allows it now; its cell
        starts after the resume's cost. False: no room (it stays parked)."""
        session, parked = self.sessions[sid], self.parked.get(sid)
        placement, tier = self.pool.place_resume(parked.placement), parked.tier
        demand = (session.milli, session.gpus)  # refused on its node and off it: it fits nowhere
        if not isinstance(placement, Placement) and demand not in self.unfit and self.may_move(sid):
            # as ``resume.place_elsewhere``: the scheduler's choice, if not its node nor one cleared for another
            node, others = parked.placement.node, self.sweep.cleared_for_others(sid)
            placement, tier = self.pool.place(session.milli, session.gpus), "moved"
            if isinstance(placement, Placement) and (placement.node == node or placement.node in others):
                placement = self.pool.place_off(session.milli, session.gpus, {node} | others)
            if not isinstance(placement, Placement):
                self.unfit.add(demand)  # until capacity is freed (:meth:`retry`): it shrinks meanwhile
        if not isinstance(placement, Placement):
            return False
        if lease_class(session.klass).yields and not self.batch_may_start(placement.node):
            self.yielded.add(parked.placement.node)
            return False
        self.unpark(sid)
        seconds = costs.resume_seconds(tier, parked.size, len(placement.gpus), spilled=parked.tier == "disk")
        self.tally.resumed(tier, seconds, session.klass)
        self.take(sid, placement, now)
        self.start(sid, now, seconds)
        return True

    def offer_resumes(self, nodes: list[str], klass: str | None, now: float) -> None:
        """Offer ``nodes`` to the resumes of ``klass`` (None: any) waiting there,
        oldest first, each on its own; with ``resume_moves`` (and room freed) every waiting resume
        of ``klass``, oldest first, since one may move to the room freed."""
        if self.policy.resume_moves and nodes:
            entries = sorted((entry, node) for node, waiting in self.resumes.items() for entry in waiting)
        else:
            entries = [(entry, node) for node in nodes for entry in list(self.resumes.get(node) or ())]
        for entry, node in entries:
            if (klass is None or self.sessions[entry[1]].klass == klass) and self.acquire(entry[1], now):
                self.resumes[node].remove(entry)
                self.resuming_gpus -= self.table.need[entry[1]]

    # -- leases -------------------------------------------------------------------

    def acquire(self, sid: int, now: float) -> bool:
        """Ask ``place()`` (a parked session: resume it); on success the lease
        holds capacity and the cell starts."""
        if self.parked.get(sid) is not None:
            return self.resume(sid, now)
        session = self.sessions[sid]
        placement = self.pool.place(session.milli, session.gpus)
        if isinstance(placement, Placement) and lease_class(session.klass).yields and self.held(placement.node):
            placement = self.pool.place_off(session.milli, session.gpus, self.held_nodes())  # backfill goes elsewhere
        elif isinstance(placement, Placement) and placement.node in self.sweep.cleared_for_others(sid):
            # cleared for another person's request: that room is theirs (``Placer.for_person``, ``queue.drain``)
            placement = self.pool.place_off(session.milli, session.gpus, self.sweep.cleared_for_others(sid))
        if not isinstance(placement, Placement):
            return False
        if lease_class(session.klass).yields and not self.batch_may_start(placement.node):
            return False
        self.take(sid, placement, now)
        self.start(sid, now)
        return True

    def take(self, sid: int, placement: Placement, now: float) -> None:
        """``sid``'s lease holds ``placement`` from ``now``."""
        self.pool.take(placement)
        self.tally.peak_milli = max(self.tally.peak_milli, self.pool.allocated_milli)
        self.tally.acquisitions += 1
        if self.table.grant(sid, placement, now, self.policy.idle_timeout or 0.0):
            del self.sweep.waiters[sid]

    def batch_may_start(self, node: str) -> bool:
        """The service's rule for a batch placement on ``node`` (:func:`.priority.batch_may_start`)."""
        return priority.batch_may_start(self.pool.node_idle(node), self.pool.idle_nodes, self.policy.headroom_nodes,
                                        self.policy.batch_yields and self.table.interactive_waiting > 0,
                                        self.held(node))

    def held(self, node: str) -> bool:
        """Whether ``node`` is held for a person: their resume waits there, or pressure clears it for them."""
        return self.sweep.held(node) or any(not lease_class(self.sessions[entry[1]].klass).yields
                                            for entry in self.resumes.get(node, ()))

    def held_nodes(self) -> set[str]:
        """Every node :meth:`held` holds."""
        return {node for node in {*self.resumes, *self.sweep.plan.cleared} if self.held(node)}

    def release(self, sid: int, now: float, retry: bool = True, free_at: float | None = None) -> None:
        """End ``sid``'s lease at ``now``; its share is free at ``free_at`` (a
        park's state is still moving off the GPU until then; None: now)."""
        session = self.sessions[sid]
        lease = session.lease
        if lease is None:
            return
        free_at = now if free_at is None else free_at
        self.table.idle.pop(sid, None)
        session.lease = None
        self.sweep.holding.pop(sid, None)
        self.tally.released(lease.placement.fraction * len(lease.placement.gpus) * (free_at - lease.granted),
                            session.group)
        self.eta.holds.append(now - lease.granted)
        if free_at > now:
            self.sweep.freeing(lease.placement)
            self.events.push(free_at, self.FREE, lease.placement)
            return
        self.pool.give(lease.placement)
        self.check_at(now)  # what the plan targets shifts when a lease goes
        if retry:
            self.retry(now)

    def retry(self, now: float) -> None:
        """Capacity was freed: top up the backlog, then offer it to the waiting
        requests in the queue's order (:mod:`.waiting`), a class's resumes
        before its new requests, on the nodes where capacity was freed (or a
        batch resume was held back)."""
        self.top_up(now)
        nodes = sorted(self.pool.freed | self.yielded)
        self.pool.freed, self.yielded = set(), set()
        self.unfit.clear()
        acquire = lambda sid: self.acquire(sid, now)  # noqa: E731
        for klass in class_names() if self.policy.classes else (None,):
            self.offer_resumes(nodes, klass, now)
            self.place_cleared(klass, now)
            self.queue.drain(acquire, klass)

    def place_cleared(self, klass: str | None, now: float) -> None:
        """Offer room to the requests of ``klass`` (None: any) that a node is cleared for first: no
        other request may go there (:meth:`.Sweep.cleared_for_others`), so one that does not fit
        ahead of it in its queue does not keep it waiting (``queue.drain`` tries every request)."""
        for sid in sorted(int(lease_id) for lease_id in self.sweep.plan.cleared.values()):
            if sid not in self.sweep.waiters or (klass is not None and self.sessions[sid].klass != klass):
                continue
            queue = self.queue_of(sid)
            entry = next((item for item in queue if item[1] == sid), None)
            if entry is not None and self.acquire(sid, now):
                queue.remove(entry)

    # -- the batch backlog --------------------------------------------------------

    def top_up(self, now: float) -> None:
        """Queue the backlog's batch jobs (:meth:`.BatchSource.jobs`), each a session of one cell.
        Resumes waiting for room do not count as demand: they wait because no node they may go to has any."""
        if self.backlog is None:
            return
        demand = lambda: (self.pool.allocated_milli / FULL + self.table.waiting_gpus  # noqa: E731
                          - self.resuming_gpus)
        for milli, gpus, seconds, user in self.backlog.jobs(demand, self.pool.capacity, self.policy.slices):
            sid = self.table.add_batch_job(milli, gpus, seconds, user, now)
            self.enqueue(sid, now, self.queue_of(sid))

    # -- the ETA --------------------------------------------------------------------

    def record_eta(self, sid: int, now: float) -> None:
        """The ETA and the old estimate for waiting ``sid`` (:meth:`.EtaLog.waiting`)."""
        session = self.sessions[sid]
        self.eta.waiting(session.pending[0], session.milli, session.gpus, self.table.ahead_of(sid, self.queue.entries()),
                         self.table.leased(), self.pool, now)
