"""The service's reclaim sweep on a replay's virtual clock: when the pressure
plan (:func:`gpupool.hub_plugin.rules.priority.plan`) is evaluated and what
it finds due.

As in the service, the plan is evaluated at sweep ticks only (every
``PoolLeases.reclaim_interval``, 5 s), at most once per tick: at the tick after
any change while requests wait, and at the tick of the plan's next deadline.
It sees every active lease (:attr:`Sweep.holding`) and waiting request
(:attr:`Sweep.waiters`) as the service's rule reads them. The traces have no
quotas, so nothing is within a guaranteed share. Idle reclaim reads leases
as :class:`SimLease`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from gpupool.schema import LeaseState, WorkerState

from ..rules import priority
from ..rules.scheduler import Placement
from .defaults import HEARTBEAT_TTL_S, RECLAIM_INTERVAL_S
from .pool import FULL

#: The virtual clock's origin (the sensei trace starts on June 1, 2021).
T0 = datetime(2021, 6, 1, tzinfo=timezone.utc)
#: The service's default ``PoolLeases.reclaim_interval``, seconds.
SWEEP_S = RECLAIM_INTERVAL_S


def at(seconds: float) -> datetime:
    """The virtual clock's ``seconds`` as the service's clock (a UTC datetime)."""
    return T0 + timedelta(seconds=seconds)


@dataclass(eq=False, slots=True)
class SimLease:
    """A lease as :func:`gpupool.hub_plugin.rules.reclaim.decide` reads it
    (attributes of ``models.Lease``), plus what it holds."""

    id: str
    started_at: datetime
    idle_timeout: float
    placement: Placement
    granted: float
    state: str = LeaseState.active.value
    worker_state: str = WorkerState.busy
    idle_since: datetime | None = None
    last_heartbeat_at: datetime | None = None
    heartbeat_ttl: float = HEARTBEAT_TTL_S


class Sweep:
    """The pressure plan's inputs and ticks. ``rule``: the plan's settings
    (:class:`.priority.Rule`, as the service builds it from ``c.PoolPressure``; None: no
    pressure parks). Keys of :attr:`waiters` and :attr:`holding` are the replay's
    session ids."""

    def __init__(self, rule: priority.Rule | None) -> None:
        self.rule = rule
        self.waiters: dict[int, priority.Asking] = {}  # every waiting request
        self.holding: dict[int, priority.Held] = {}  # every active lease
        self.plan = priority.NO_PRESSURE  # the last plan evaluated
        self._freeing: dict[str, float] = {}  # node -> GPUs of parks whose state is still moving off the GPU
        self.leaving: dict[str, int] = {}  # GPU uuid -> thousandths those parks hold there
        self._checks: set[float] = set()  # ticks at which the plan is to be evaluated
        self._last_check = -math.inf

    def next_check(self, now: float) -> float | None:
        """The first sweep tick at or after ``now`` (after the last evaluated
        one) to evaluate the plan at, when it can act there and none is set
        for that tick yet; else None."""
        if self.rule is None or not self.waiters:
            return None
        tick = math.ceil(now / SWEEP_S) * SWEEP_S
        tick += SWEEP_S if tick <= self._last_check else 0.0
        if tick in self._checks:
            return None
        self._checks.add(tick)
        return tick

    def freeing(self, placement) -> None:
        """A park's share (``placement``) is on its way back: the plan counts it (as the service
        counts its ``parking`` leases), so it takes no second lease for the same waiter."""
        self._freeing[placement.node] = self._freeing.get(placement.node, 0.0) + placement.fraction * len(placement.gpus)
        for uuid in placement.gpus:
            self.leaving[uuid] = self.leaving.get(uuid, 0) + round(placement.fraction * FULL)

    def freed(self, placement) -> None:
        """That share is back in the pool."""
        self._freeing[placement.node] -= placement.fraction * len(placement.gpus)
        for uuid in placement.gpus:
            self.leaving[uuid] -= round(placement.fraction * FULL)
            if not self.leaving[uuid]:
                del self.leaving[uuid]

    def held(self, node: str) -> bool:
        """Whether the last plan cleared ``node`` for a request that still waits (:attr:`.priority.Plan.cleared`)."""
        lease_id = self.plan.cleared.get(node)
        return lease_id is not None and int(lease_id) in self.waiters

    def cleared_for_others(self, sid: int) -> set[str]:
        """The nodes the last plan cleared for a request still waiting other than ``sid``'s
        (:meth:`.priority.Plan.cleared_for_others`): no other request is placed there."""
        return {node for node, lease_id in self.plan.cleared.items()
                if int(lease_id) != sid and int(lease_id) in self.waiters}

    def wants_free_gpus(self) -> bool:
        """Whether the plan reads each node's free GPUs now (:meth:`.priority.Rule.wants_free_gpus`)."""
        return self.rule is not None and self.rule.wants_free_gpus(self.waiters.values())

    def due(self, now: float, any_idle: bool, free_gpus: dict[str, float] | None = None
            ) -> tuple[list[int], list[int], float | None]:
        """Evaluate the plan at tick ``now`` (``any_idle``: some lease is idle):
        the sessions whose idle lease is parked now, those whose cell is
        preempted now, and when the plan acts next (seconds; None: never).
        ``free_gpus``: the plan's (whole free GPUs per node, with those on their way back:
        :meth:`.SimulatedPool.whole_free` of :attr:`leaving`; None: not given). The nodes the
        last plan cleared stay cleared for the same requests while they can be (``kept``)."""
        self._checks.discard(now)
        self._last_check = now
        rule = self.rule
        if rule is None or not self.waiters or not (any_idle or rule.allow_preemption):
            return [], [], None  # the plan parks only idle leases and preempts only where the pool allows it
        plan = self.plan = rule.plan(list(self.holding.values()), list(self.waiters.values()), {}, free_gpus,
                                     self._freeing, self.plan.cleared)
        parks, preempts, later = priority.acting(plan, at(now))
        return ([int(lease) for lease in plan.parks if lease in parks],
                [int(lease) for lease in plan.preemptions if lease in preempts],
                (later - T0).total_seconds() if later else None)
