"""A notebook replay's table of sessions and cells (:mod:`.notebooks`).

Sessions and cells are numbered as in the trace (a session id ``sid``, a cell
index); the batch jobs of a backlog are appended as they are queued, each a
session of one cell. The table holds what each one asks for and when, and the
session's lease; it says how a session looks to the service's pressure rule
(:mod:`..rules.priority`) and to the ETA (:mod:`.eta_log`). It decides
nothing: :class:`.notebooks._Replay` moves the sessions along.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

from gpupool.leaseclasses import default as default_class, lease_class, script_default

from ..rules import priority
from ..rules.scheduler import Placement
from .pool import FULL
from .sweep import SimLease, at
from .workload import NotebookWorkload, period_seconds



@dataclass(eq=False, slots=True)
class SimSession:
    """One notebook (or batch job): its slice (``milli`` of ``gpus``), group,
    user, class, preemptibility and closing time; its ``pending`` cells, whether
    ``cell`` runs (since ``run_start``) or it waits in the queue, its ``lease``;
    ``token`` tells a cell's end event from one of a cell that was interrupted."""

    milli: int
    gpus: int
    group: int
    closes: float
    user: int = 0
    klass: str = default_class().name
    preemptible: bool = False
    pending: deque = field(default_factory=deque)
    running: bool = False
    waiting: bool = False
    lease: SimLease | None = None
    run_start: float = 0.0
    cell: int = -1
    token: int = 0


class SessionTable:
    """Per session (``sessions``, ``need``: GPUs a cell of it holds) and per
    cell (``submit``, ``duration``, ``cell_session``, ``queued_at``: when it
    last joined the queue) in seconds of the trace; ``trace_cells``: the
    trace's cells come first, the backlog's batch jobs after them.
    With ``slices`` off every session asks for whole GPUs."""

    def __init__(self, workload: NotebookWorkload, slices: bool) -> None:
        self.sessions = [SimSession(s.milli if slices else FULL, s.gpus, s.group, s.closes, s.user, s.klass,
                                    s.preemptible) for s in workload.sessions]
        self.need = [s.gpus * s.milli / FULL for s in workload.sessions]
        self.submit = [c.submit for c in workload.cells]
        self.duration = [c.duration for c in workload.cells]
        self.cell_session = [c.session for c in workload.cells]
        self.queued_at = list(self.submit)
        self.trace_cells = len(workload.cells)
        self.waiting_gpus = 0.0  # GPUs the waiting sessions ask for
        self.interactive_waiting = 0  # interactive sessions that wait
        self.leases = 0  # leases granted so far
        self.idle: dict[int, float] = {}  # interactive sessions whose lease is idle -> idle since

    def period(self) -> float:
        """The seconds cluster utilization is measured over (:func:`.workload.period_seconds`)."""
        return period_seconds(max(self.submit, default=0.0))

    def add_batch_job(self, milli: int, gpus: int, seconds: float, user: int, now: float) -> int:
        """A batch job of ``seconds`` on ``milli`` of ``gpus``, asked for at
        ``now``: a new session whose one cell is pending. Returns its id."""
        sid, cell = len(self.sessions), len(self.submit)
        self.sessions.append(SimSession(milli, gpus, user % 4, math.inf, user, script_default().name, preemptible=True))
        self.need.append(gpus * milli / FULL)
        self.submit.append(now)
        self.duration.append(seconds)
        self.cell_session.append(sid)
        self.queued_at.append(now)
        self.sessions[sid].pending.append(cell)
        return sid

    def wait(self, sid: int, now: float) -> None:
        """``sid`` joins the queue at ``now`` for its next pending cell."""
        session = self.sessions[sid]
        session.waiting = True
        self.waiting_gpus += self.need[sid]
        self.interactive_waiting += not lease_class(session.klass).yields
        self.queued_at[session.pending[0]] = now

    def grant(self, sid: int, placement: Placement, now: float, idle_timeout: float) -> bool:
        """``sid`` gets a lease on ``placement`` at ``now``, reclaimed after
        ``idle_timeout`` seconds idle (0: never). True when it was waiting:
        it no longer is."""
        session = self.sessions[sid]
        self.leases += 1
        started = at(now)
        session.lease = SimLease(f"L-{self.leases:012d}", started, idle_timeout, placement, now,
                                 last_heartbeat_at=started)
        waited, session.waiting = session.waiting, False
        if waited:
            self.waiting_gpus -= self.need[sid]
            self.interactive_waiting -= not lease_class(session.klass).yields
        return waited

    def held_gpus(self, sid: int) -> float:
        """GPUs (fraction x count) ``sid``'s lease holds."""
        placement = self.sessions[sid].lease.placement
        return placement.fraction * len(placement.gpus)

    def asking(self, sid: int, now: float, node: str | None = None) -> priority.Asking:
        """Waiting ``sid`` as the pressure rule sees a queued request asked at
        ``now`` (``node``: the only node it may go to, a resume's)."""
        session = self.sessions[sid]
        return priority.Asking(str(sid), str(session.user), self.need[sid], session.klass, at(now), session.gpus,
                               node)

    def held(self, sid: int, idle_timeout: float | None) -> priority.Held:
        """``sid``'s lease as the pressure rule sees it, with its GPUs (node clearing counts
        whole GPUs by them); when it is idle and interactive, its idle deadline is
        ``idle_timeout`` seconds after its cell ended (None: no deadline)."""
        session, lease = self.sessions[sid], self.sessions[sid].lease
        timeout = idle_timeout if lease_class(session.klass).idles else None
        idle_since = lease.idle_since if sid in self.idle else None
        deadline = idle_since + timedelta(seconds=timeout) if idle_since and timeout is not None else None
        return priority.Held(str(sid), str(session.user), self.held_gpus(sid), session.klass,
                             session.preemptible, session.running, lease.started_at, idle_since, deadline,
                             lease.placement.node, gpu_ids=lease.placement.gpus)

    def ahead_of(self, sid: int, entries) -> list[tuple[int, int]]:
        """``(milli, gpus)`` of the interactive requests among the queue's
        ``entries`` (``(queued at, sid)``) that were queued before ``sid``."""
        mine = self.queued_at[self.sessions[sid].pending[0]]
        return [(self.sessions[s].milli, self.sessions[s].gpus) for when, s in entries
                if s != sid and when <= mine and not lease_class(self.sessions[s].klass).yields]

    def leased(self) -> list[tuple]:
        """``(class, cell started at, idle since or None, GPU uuids, milli)`` of
        every session that holds a lease."""
        return [(s.klass, s.run_start, self.idle.get(sid), s.lease.placement.gpus, s.milli)
                for sid, s in enumerate(self.sessions) if s.lease is not None]
