"""The policies a notebook replay compares (:mod:`.notebooks`), and the
dedicated baseline that is not a replay.

Policies (:data:`POLICIES`):

- ``reservation``: a session holds whole GPUs (``num_gpu`` of its cells) from
  its first cell until it has been idle 30 minutes (the same reclaim rule with
  ``idle_timeout = 1800``) or its kernel shuts down; the next cell re-acquires.
- ``gpupool``: a 1-GPU session holds only its slice; 4/8-GPU sessions whole
  GPUs; parked in place after ``idle_timeout`` idle, or after the pressure
  grace while others wait, and resumed on its node on the next cell, or on
  another node at a cold move's cost when its own has no room
  (``resume_moves``; :mod:`.parked`, costs :mod:`.costs`); interactive
  first; batch preempted after the grace plus the notice and parked in place
  too, keeping its progress. Its idle timeout, grace, notice and moves are
  the service's defaults (:mod:`.defaults`: 30 min, 2 min, 30 s, moves on)
  unless given.
- ``batch``: first-come batch: each cell is a job holding ``num_gpu`` whole
  GPUs only while it runs; strict FIFO queue.
- ``dedicated`` (:func:`dedicated_gpus`): every user owns the most GPUs they
  run at once; not replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rules import priority
from .defaults import IDLE_TIMEOUT_S, PREEMPTION_NOTICE_S, PRESSURE_GRACE_S, RESUME_MOVES
from .estimates import peak_concurrent
from .workload import NotebookWorkload

__all__ = ["IDLE_TIMEOUT_S", "PREEMPTION_NOTICE_S", "PRESSURE_GRACE_S", "NotebookPolicy", "POLICIES", "policies",
           "dedicated_gpus"]


@dataclass(frozen=True)
class NotebookPolicy:
    """``slices``: a 1-GPU session asks for its slice, else a whole GPU;
    ``idle_timeout``: seconds a lease outlives its last cell (None: released
    when the cell ends); ``fifo``: one strict first-come queue for everyone;
    ``pressure_grace``: seconds after which an idle lease is parked while
    others wait (None: only the idle timeout); ``classes``: interactive
    requests go before batch ones (False: one queue, oldest first);
    ``preemption_notice``: the pool allows preemption, with this notice
    (``c.PoolPressure.preemption_notice``; batch jobs are all preemptible here;
    None: ``allow_preemption = False``); ``headroom_nodes`` (``batch_headroom_nodes``): batch is not
    placed on an idle node while only this many nodes are idle (room kept
    for interactive arrivals); ``preemption_grace``: seconds from the press
    to the preemption notice (None: ``pressure_grace``); ``batch_first``:
    running batch is preempted before idle interactive leases are parked;
    ``batch_yields`` (``c.PoolPressure.batch_yields``): no batch request is placed while an interactive one
    waits (:func:`.priority.batch_may_start`); ``clear_nodes``: the plan is
    given each node's free GPUs and clears one node per waiting whole-GPU
    interactive request (:mod:`gpupool.hub_plugin.rules.clearing`);
    ``clear_grace`` (``c.PoolPressure.pressure_clear_grace``): an idle lease on a node
    cleared so is parked this long after the request was asked;
    ``resume_preempted``: a preempted batch job keeps its progress (it was
    parked with its variables and its loop resumes) instead of restarting;
    ``park_in_place``: a park freezes the worker on its node (:mod:`.parked`)
    and the next cell waits for its resume there, with the costs of
    :mod:`.costs` (False: a park releases the lease, the next cell takes a
    new one anywhere, at no cost); ``resume_moves``
    (``c.PoolLeases.resume_moves``): a resume that finds no room on its node
    goes to another at a cold move's cost (False: it waits for its node);
    ``state_fill``: every session's parked state is
    this share of its slice's memory (None: drawn per session, seeded);
    ``parked_claims``: a parked lease's share stays claimed on its GPUs, so
    new leases go elsewhere while they can (the service's rule,
    :func:`.scheduler.claimed`; False: placement ignores parked leases)."""

    name: str
    slices: bool
    idle_timeout: float | None
    fifo: bool = False
    pressure_grace: float | None = None
    classes: bool = False
    preemption_notice: float | None = None
    headroom_nodes: int = 0
    preemption_grace: float | None = None
    batch_first: bool = False
    batch_yields: bool = False
    clear_nodes: bool = True
    resume_preempted: bool = False
    clear_grace: float | None = None
    park_in_place: bool = False
    resume_moves: bool = False
    state_fill: float | None = None
    parked_claims: bool = True

    def rule(self) -> priority.Rule | None:
        """The pressure plan's settings as the service would have them (None: no pressure parks):
        ``c.PoolPressure.pressure_grace``, ``preemption_notice`` (``allow_preemption`` where it is
        set), ``preemption_grace``, ``batch_first``, ``pressure_clears_nodes``."""
        if self.pressure_grace is None:
            return None
        return priority.Rule(self.pressure_grace, self.preemption_notice or 0.0, self.preemption_notice is not None,
                             self.preemption_grace, self.batch_first, self.clear_nodes, self.clear_grace)


def policies(gpupool_idle_timeout: float = IDLE_TIMEOUT_S,
             pressure_grace: float | None = PRESSURE_GRACE_S) -> dict[str, NotebookPolicy]:
    """The compared policies, by name; times in seconds (the service's
    defaults unless given). ``dedicated`` is not a replay (:func:`dedicated_gpus`)."""
    return {"reservation": NotebookPolicy("reservation", slices=False, idle_timeout=1800.0),
            "gpupool": NotebookPolicy("gpupool", slices=True, idle_timeout=gpupool_idle_timeout,
                                      pressure_grace=pressure_grace, classes=True,
                                      preemption_notice=PREEMPTION_NOTICE_S, resume_preempted=True,
                                      park_in_place=True, resume_moves=RESUME_MOVES),
            "batch": NotebookPolicy("batch", slices=False, idle_timeout=None, fifo=True)}


POLICIES = tuple(policies())


def dedicated_gpus(workload: NotebookWorkload) -> dict[int, int]:
    """The dedicated baseline: per user, the most whole GPUs their cells run
    at once over the trace (a slice is a card of its own). Each user owns
    that many cards for the whole period; nobody waits."""
    by_user: dict[int, list] = {}
    for cell in workload.cells:
        session = workload.sessions[cell.session]
        by_user.setdefault(session.user, []).append((cell.submit, cell.submit + cell.duration, session.gpus))
    return {user: int(peak_concurrent(spans)) for user, spans in sorted(by_user.items())}
