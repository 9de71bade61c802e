"""The service's side of pressure and the queue's ETA: reads the store, calls
the pure rules (:mod:`.rules.priority`, :mod:`.rules.pressure`,
:mod:`.rules.eta`), keeps the current plan and
what the ETA reads (the active leases and typical lease lengths), so a long
poll of a queued request costs no query for its ETA.

The reclaim sweep calls :meth:`Pressure.refresh` every
``c.PoolLeases.reclaim_interval`` seconds (on a store thread); the plan it
computes is held here and read by every lease JSON (the notebook's heartbeat
answer): ``idle_deadline`` brought forward, ``pressure`` (why, in words) and
``preempt_at``. The sweep parks an idle lease at that deadline (:func:`due`;
where its node cannot park: reclaims it) and freezes a preemptible one whose
cell runs at its ``preempt_at`` (:meth:`Pressure.preempts`). Parked leases
waiting to resume are asks bound to their node. A new plan replaces the old
one whole, so readers on other threads see one or the other.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Collection, Iterable, Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from gpupool.schema import LeaseState, isoformat

from .config import PoolNodes, PoolPressure
from .transitions import RESUMING
from .models import Lease, LeaseCell, LeaseGPU
from .capacity import gpu_states
from .rules import clearing, eta, priority, quotas
from .rules import pressure as pressure_rules
from .rules.reclaim import Decision, idle_deadline
from .rules.scheduler import GPUState

#: Ended cells whose lengths give the ETA the typical length per class.
LENGTH_SAMPLE = 200


@dataclass(frozen=True)
class EtaInputs:
    """What the ETA reads, read together and replaced whole (readers on other
    threads see one snapshot or the next, never a mix): the ``room`` and
    active leases (``held``), the pressure ``plan`` and the ``guaranteed`` lease ids of
    :func:`.eta.eta_seconds`, ``typical`` cell lengths by class,
    ``gpus`` (UUID -> index in the room, node, model), and the state's
    capacity ``epoch`` they were read at."""

    room: eta.Room = eta.Room((), ())
    held: tuple[priority.Held, ...] = ()
    plan: priority.Plan = priority.NO_PRESSURE
    guaranteed: frozenset[str] = frozenset()
    typical: dict[str, float] = field(default_factory=dict)
    gpus: dict[str, tuple[int, str, str]] = field(default_factory=dict)
    epoch: int = -1


class Pressure:
    """The current pressure plan of one service. ``pool_pressure``: the plan's
    settings; ``pool_nodes``: the ``context_overhead`` of each GPU;
    ``quota_table(session)``: the effective quota table (:class:`.QuotaBook`)."""

    def __init__(self, pool_pressure: PoolPressure, pool_nodes: PoolNodes, quota_table) -> None:
        self.pool_pressure = pool_pressure
        self.pool_nodes = pool_nodes
        self._quota_table = quota_table
        # The plan and when it was made, replaced together (other threads read them): shown() reads
        # both (a lease resumed since holds its GPU again from after the plan, which did not see it).
        self._made: tuple[priority.Plan, datetime | None] = (priority.NO_PRESSURE, None)
        # What the ETA reads, as the last sweep (or capacity change) saw it: no query per long poll.
        self._eta = EtaInputs()

    def refresh(self, session: Session, active: Sequence[Lease], now: datetime, epoch: int = -1) -> priority.Plan:
        """Recompute the plan from the queue and ``active`` (the active leases
        the sweep read, their ``gpus`` loaded), and what the ETA reads (at the
        state's capacity ``epoch``); returns the plan. On a store thread."""
        held = [pressure_rules.held(lease) for lease in active]
        guarantees = self._guarantees(session, active)
        states = gpu_states(session, self.pool_nodes.context_overhead)  # read once, for the plan and the ETA
        self._made = (self._plan(session, held, guarantees, states, now), now)
        self._eta = self._eta_inputs(session, held, guarantees, states, epoch)
        return self.plan

    @property
    def plan(self) -> priority.Plan:
        """The current plan (:data:`.priority.NO_PRESSURE` until the first :meth:`refresh`)."""
        return self._made[0]

    def follow(self, session: Session, epoch: int) -> None:
        """Read what the ETA reads again when the pool's capacity changed since
        (``epoch``: the state's capacity epoch now), so a request queued behind a
        lease placed after the last sweep is not told "about 0s". On a store thread."""
        if epoch != self._eta.epoch:
            active, held = self._active(session)
            states = gpu_states(session, self.pool_nodes.context_overhead)
            self._eta = self._eta_inputs(session, held, self._guarantees(session, active), states, epoch)

    def renew(self, session: Session, epoch: int, now: datetime) -> None:
        """:meth:`refresh` from the store now, for a request just queued: its first
        answer sees each lease's cell as the store has it, not as the last sweep
        did, and the plan holds what pressure clears for it at once (no batch
        request takes that node until the next sweep). On a store thread."""
        self.refresh(session, self._active(session)[0], now, epoch)

    @staticmethod
    def _active(session: Session) -> tuple[Sequence[Lease], list[priority.Held]]:
        """The active leases (their ``gpus`` loaded) and their records for the plan."""
        active = session.scalars(select(Lease).where(Lease.state == LeaseState.active.value)
                                 .options(selectinload(Lease.gpus))).all()
        return active, [pressure_rules.held(lease) for lease in active]

    def _eta_inputs(self, session: Session, held: list[priority.Held], guarantees: dict[str, float],
                    states: list[GPUState], epoch: int) -> EtaInputs:
        """:class:`EtaInputs` from the store, the active leases ``held``, the GPUs' ``states`` and the plan."""
        ran = session.execute(select(Lease.lease_class, LeaseCell.started_at, LeaseCell.ended_at)
                              .join(Lease, Lease.id == LeaseCell.lease_id).where(LeaseCell.ended_at.is_not(None))
                              .order_by(LeaseCell.id.desc()).limit(LENGTH_SAMPLE)).all()  # the newest cells
        return EtaInputs(
            room=eta.Room(tuple(_room(gpu) for gpu in states), tuple(gpu.node for gpu in states),
                          tuple(gpu.uuid for gpu in states)),
            held=tuple(held), plan=self.plan, guaranteed=frozenset(priority.guaranteed(held, guarantees)),
            typical=eta.typical_lengths((row.lease_class, (row.ended_at - row.started_at).total_seconds())
                                        for row in ran),
            gpus={gpu.uuid: (i, gpu.node, gpu.name) for i, gpu in enumerate(states)}, epoch=epoch)

    def _plan(self, session: Session, held: list[priority.Held], guarantees: dict[str, float],
              states: list[GPUState], now: datetime) -> priority.Plan:
        asking = [priority.Asking(row.id, row.owner, row.fraction * row.gpu_count, row.lease_class, row.created_at,
                                  row.gpu_count)
                  for row in session.execute(select(Lease.id, Lease.owner, Lease.fraction, Lease.gpu_count,
                                                    Lease.lease_class, Lease.created_at, Lease.wait_until)
                                             .where(Lease.state == LeaseState.queued.value))
                  if row.wait_until is None or row.wait_until > now]
        # A resume waiting for room presses on the leases of its own node only.
        asking += [priority.Asking(row.id, row.owner, row.fraction * row.gpu_count, row.lease_class,
                                   row.resume_requested_at, row.gpu_count, row.node_name)
                   for row in session.execute(select(Lease.id, Lease.owner, Lease.fraction, Lease.gpu_count,
                                                     Lease.lease_class, Lease.resume_requested_at, Lease.node_name)
                                              .where(RESUMING))]
        if not asking:
            return priority.NO_PRESSURE
        rule = priority.Rule.of(self.pool_pressure)
        # What leases being parked or released hold is on its way back: the plan counts it free (``freeing``,
        # and GPU by GPU in the whole free GPUs a node is cleared by). The nodes the last plan cleared stay
        # cleared for the same requests while they can be (``kept``).
        freeing, leaving = self._on_the_way_back(session)
        free = clearing.whole_free(states, leaving) if rule.wants_free_gpus(asking) else None
        return rule.plan(held, asking, guarantees, free, freeing, self.plan.cleared)

    @staticmethod
    def _on_the_way_back(session: Session) -> tuple[dict[str, float], dict[str, float]]:
        """What leases being parked or released still hold, on its way back (a park's move takes
        seconds): ``({node: GPUs}, {GPU uuid: fraction})``. The plan takes no other lease for the
        first; a GPU such leases alone hold counts whole and free in the second
        (:func:`.rules.clearing.whole_free`). One query."""
        freeing: dict[str, float] = defaultdict(float)
        leaving: dict[str, float] = defaultdict(float)
        for node, uuid, fraction in session.execute(
                select(Lease.node_name, LeaseGPU.gpu_uuid, Lease.fraction).join(LeaseGPU, LeaseGPU.lease_id == Lease.id)
                .where(Lease.state.in_((LeaseState.parking.value, LeaseState.releasing.value)))):
            leaving[uuid] += fraction
            if node is not None:
                freeing[node] += fraction
        return dict(freeing), dict(leaving)

    def _guarantees(self, session: Session, active: Iterable[Lease]) -> dict[str, float]:
        """``{owner: guaranteed GPUs}`` of the owners of ``active`` (one quota table read)."""
        table = self._quota_table(session)
        groups = {lease.owner: tuple(lease.groups or ()) for lease in active}
        return {owner: quotas.resolve(owner, their, table).guaranteed_gpus or 0.0 for owner, their in groups.items()}

    def deadline(self, lease: Any) -> datetime | None:
        """``lease``'s idle deadline: its own, or the earlier one the plan set."""
        return pressure_rules.deadline(self.plan, lease)

    def shown(self, lease: Lease) -> dict[str, str | None]:
        """What the plan shows in ``lease``'s JSON: ``idle_deadline``, ``pressure`` (words) and
        ``preempt_at`` (ISO times or None), as :class:`gpupool.wire.leases.Lease` names them:
        a preemption only while it is still to come (:func:`.rules.pressure.coming_preemption`)."""
        plan, made = self._made
        early, preempt = plan.parks.get(lease.id), pressure_rules.coming_preemption(plan, made, lease)
        return {"idle_deadline": isoformat(pressure_rules.deadline(plan, lease)),
                "pressure": preempt.reason if preempt else early.reason if early and idle_deadline(lease) else None,
                "preempt_at": isoformat(preempt.at) if preempt else None}

    def due(self, active: Iterable[Lease], now: datetime, parkable: Collection[str] = ()) -> list[Decision]:
        """Decisions for idle leases past their early deadline: parked where their node can
        (``parkable``), else reclaimed (:func:`.rules.pressure.due`)."""
        return pressure_rules.due(self.plan, active, now, parkable)

    def still_due(self, lease: Lease, now: datetime) -> bool:
        """Re-checked under the write lock: still idle and past its early deadline."""
        return pressure_rules.still_due(self.plan, lease, now)

    def preempts(self, active: Iterable[Lease], now: datetime, parkable: Collection[str]) -> list[Decision]:
        """Park decisions, frozen mid-cell, for preemptible leases past their ``preempt_at``
        on nodes that can park (:func:`.rules.pressure.preempts`)."""
        return pressure_rules.preempts(self.plan, active, now, parkable)

    def still_preempted(self, lease: Lease, now: datetime) -> bool:
        """Re-checked under the write lock: still active and busy, past its ``preempt_at``."""
        return pressure_rules.still_preempted(self.plan, lease, now)

    def resume_room(self, lease: Lease, remap: bool, moves: bool = False) -> tuple[int, ...]:
        """The indexes in the ETA's room of the GPUs a resume of ``lease`` (its GPUs loaded) may
        take, as the sweep would try them (as the last sweep saw them): its own first; then, where
        its node's checkpointer can ``remap``, the others of the same model on its node; then,
        where it ``moves`` (:func:`.parked.may_move`), those of that model on other nodes
        (:func:`.rules.resume.place_elsewhere`; their worker environments are not read here)."""
        gpus = self._eta.gpus
        own = [gpus[g.gpu_uuid][0] for g in lease.gpus if g.gpu_uuid in gpus]
        if not lease.gpus or not (remap or moves):
            return tuple(own)
        model = lease.gpus[0].name
        same = [(i, node) for i, node, name in gpus.values() if name == model and i not in own]
        here = [i for i, node in same if node == lease.node_name] if remap else []
        elsewhere = [i for i, node in same if node != lease.node_name] if moves else []
        return tuple(own + here + elsewhere)

    def etas(self, asks: Sequence[tuple[float, int, str]], now: datetime, ids: Sequence[str | None] = (),
             waiting: Collection[str] = ()) -> list[float | None]:
        """:func:`.eta.eta_seconds` for queued requests asking ``(fraction, gpu count, class)``
        (queue order; ``ids``, their lease ids where known), from the pool, the active leases
        and recent cell lengths as the last sweep saw them (at most
        ``c.PoolLeases.reclaim_interval`` old); a node cleared for a request among ``waiting``
        (lease ids: those still queued or resuming) is held for that one."""
        inputs = self._eta
        plan = replace(inputs.plan, cleared={node: lease_id for node, lease_id in inputs.plan.cleared.items()
                                             if lease_id in waiting})
        return eta.eta_seconds(asks, inputs.room, inputs.held, inputs.typical, now,
                               self.pool_pressure.pressure_grace, plan, inputs.guaranteed, ids)


def _room(gpu: GPUState) -> float:
    """What the ETA may place on ``gpu``: its free fraction, or nothing where the scheduler places nothing."""
    return gpu.free_fraction if gpu.healthy and gpu.node_up and not gpu.node_degraded else 0.0
