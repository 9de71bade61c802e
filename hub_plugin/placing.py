"""Placing requests on the pool as the store holds it: the capacity index
(:class:`.capacity.CapacityIndex`, in :class:`.state.PoolState`) deciding for
the mix of requests the pool has seen lately. On the writer thread only
(:mod:`.storework`), inside a transaction that holds the capacity lock.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Collection

from datetime import datetime

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from gpupool.schema import LeaseState
from gpupool.leaseclasses import not_yielding

from .models import Lease
from .rules.placement_index import PlacementIndex
from .rules.priority import NO_PRESSURE, Plan, batch_may_start
from .rules.misfits import Misfit
from .rules.scheduler import Demand, Placement, Refusal
from .rules.workload import DEFAULT_WORKLOAD, Workload, workload_of
from .state import PoolState
from .transitions import RESUMING

#: The scheduler's expected workload is the mix of the last this many requests ...
WORKLOAD_WINDOW = 1000
#: ... once there are at least this many (until then: rules.workload.DEFAULT_WORKLOAD); recomputed every this many.
WORKLOAD_MIN = 50


class Placer:
    """Decisions through ``state``'s capacity index, and the recent requests they
    weigh; ``plan()``: the pressure plan now, whose cleared nodes no batch takes."""

    def __init__(self, state: PoolState, plan: Callable[[], Plan] = lambda: NO_PRESSURE) -> None:
        self.state = state
        self.plan = plan
        self._recent: deque[Demand] | None = None  # recent requests, read from the store at first use
        self._shapes: Workload | None = None

    def pool(self, session: Session) -> PlacementIndex:
        """The index, up to date with the store as ``session`` sees it."""
        return self.state.capacity.get(session, self._workload(session))

    def place(self, session: Session, demand: Demand) -> Placement | Refusal:
        """The scheduler's decision for ``demand`` (a new request, counted in the mix)."""
        workload = self._workload(session, demand)
        decision = self.state.capacity.get(session, workload).place(demand)
        if isinstance(decision, Placement) and not self.verify(session, decision):
            decision = self.state.capacity.get(session, workload).place(demand)  # rebuilt from the store
        return decision

    def place_off(self, session: Session, demand: Demand, nodes: Collection[str]) -> Placement | Refusal:
        """:meth:`place` on every node but ``nodes``, for a demand already counted in
        the mix (one held for someone else, one whose start failed there), checked
        against the store as :meth:`place` is."""
        decision = self.pool(session).place_off(demand, nodes)
        if isinstance(decision, Placement) and not self.verify(session, decision):
            decision = self.pool(session).place_off(demand, nodes)  # rebuilt from the store
        return decision

    def held_nodes(self, waiting: Collection[str]) -> set[str]:
        """The nodes pressure clears for a request among ``waiting`` (queued lease ids):
        no batch request or resume is placed there (:meth:`.priority.Plan.held_nodes`)."""
        return self.plan().held_nodes(waiting)

    def cleared_for(self, waiting: Collection[str]) -> dict[str, str]:
        """Node -> the request among ``waiting`` (queued lease ids) pressure clears it for: no
        other request is placed there while it waits (:meth:`.priority.Plan.cleared_for_others`)."""
        return {node: lease_id for node, lease_id in self.plan().cleared.items() if lease_id in waiting}

    def for_person(self, session: Session, decision: Placement, demand: Demand) -> Placement | Refusal:
        """Where a new request of a class that does not yield may start instead of ``decision``:
        off the nodes pressure clears for a request still queued (that room is freed for it,
        :meth:`.priority.Plan.cleared_for_others`), where other room fits; else why not now."""
        cleared = self._cleared_for_queued(session)
        if decision.node not in cleared:
            return decision
        moved = self.place_off(session, demand, cleared)
        if isinstance(moved, Placement):
            return moved
        return Refusal({Misfit.held_for_interactive: len(decision.gpus)},
                       f"not placed: node {decision.node} is being cleared for a request that waits for it, "
                       "and no other node has room")

    def for_batch(self, session: Session, decision: Placement, demand: Demand, now: datetime, *, yields: bool,
                  headroom_nodes: int) -> Placement | Refusal:
        """Where a new batch request for ``demand`` may start instead of ``decision``
        (:func:`.priority.batch_may_start`): off the nodes held for a person, where other
        room fits; or why it may not start now (that, ``c.PoolPressure.batch_yields``,
        ``batch_headroom_nodes``)."""
        held = self._held_for_people(session)
        if decision.node in held:
            moved = self.place_off(session, demand, held)
            if not isinstance(moved, Placement):
                return Refusal({Misfit.held_for_interactive: len(decision.gpus)},
                               f"batch request not placed: node {decision.node} is held for a person's request "
                               "that waits for room there, and no other node has room")
            decision = moved
        if not yields and not headroom_nodes:
            return decision
        person = yields and session.scalar(
            select(Lease.id).where(Lease.state == LeaseState.queued.value, Lease.lease_class.in_(not_yielding()),
                                   or_(Lease.wait_until.is_(None), Lease.wait_until > now)).limit(1)) is not None
        index = self.pool(session)
        if batch_may_start(index.node_idle(decision.node), index.idle_nodes(), headroom_nodes, person):
            return decision
        if person:
            why = "a person's interactive request is waiting and batch yields to it (c.PoolPressure.batch_yields)"
        else:
            why = (f"the last {headroom_nodes} idle node(s) are kept for interactive requests "
                   "(c.PoolPressure.batch_headroom_nodes)")
        return Refusal({Misfit.held_for_interactive: len(decision.gpus)}, f"batch request not placed: {why}")

    def _held_for_people(self, session: Session) -> set[str]:
        """The nodes a person's request waits for room on: its parked lease's resume, or a
        request pressure clears the node for (still queued)."""
        resuming = session.scalars(select(Lease.node_name).where(RESUMING, Lease.lease_class.in_(not_yielding())))
        return self._cleared_for_queued(session) | {node for node in resuming if node}

    def _cleared_for_queued(self, session: Session) -> set[str]:
        """The nodes pressure clears for a request still queued."""
        cleared = self.plan().cleared
        queued = set(session.scalars(select(Lease.id).where(
            Lease.id.in_(list(cleared.values())), Lease.state == LeaseState.queued.value))) if cleared else set()
        return {node for node, lease_id in cleared.items() if lease_id in queued}

    def verify(self, session: Session, decision: Placement) -> bool:
        """Whether the store agrees with the index on ``decision`` (:meth:`.capacity.CapacityIndex.verify`)."""
        return self.state.capacity.verify(session, decision)

    def _workload(self, session: Session, new: Demand | None = None) -> Workload:
        """The expected mix of requests the scheduler weighs: the last
        :data:`WORKLOAD_WINDOW` requests (``new`` included), or the scheduler's
        default while the pool has seen fewer than :data:`WORKLOAD_MIN`."""
        if self._recent is None:
            rows = session.execute(select(Lease.fraction, Lease.gpu_count)
                                   .order_by(Lease.created_at.desc()).limit(WORKLOAD_WINDOW)).all()
            self._recent = deque((Demand(f, c) for f, c in reversed(rows)), maxlen=WORKLOAD_WINDOW)
        if new is not None:
            self._recent.append(new)
            if len(self._recent) % WORKLOAD_MIN == 0:
                self._shapes = None
        if self._shapes is None:
            self._shapes = workload_of(self._recent) if len(self._recent) >= WORKLOAD_MIN else DEFAULT_WORKLOAD
        return self._shapes
