"""The pressure plan (:func:`.priority.plan`) applied to leases: a lease's
idle deadline under the plan, which idle leases are past their early
deadline, and how a lease looks to the plan. Pure: the plan, lease rows and
``now`` in; the service's sweep that reads the store and keeps the plan is
:mod:`gpupool.hub_plugin.pressure`.

Leases are objects with the attributes of
:class:`~gpupool.hub_plugin.models.Lease` (those :func:`.reclaim.decide`
reads, plus ``owner``, ``fraction``, ``gpu_count``, ``lease_class``,
``preemptible``, ``created_at``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Collection, Iterable

from gpupool.schema import LeaseState, WorkerState
from gpupool.units import format_duration

from . import priority
from .reclaim import FREEZE, Decision, ParkCode, Reclaim, idle_deadline, is_busy, parks_idle


def deadline(plan: priority.Plan, lease: Any) -> datetime | None:
    """``lease``'s idle deadline: its own, or the earlier one ``plan`` set."""
    own = idle_deadline(lease)
    early = plan.parks.get(lease.id)
    if own is None or early is None:
        return own
    return min(own, early.deadline)


def due(plan: priority.Plan, active: Iterable[Any], now: datetime, parkable: Collection[str] = ()) -> list[Decision]:
    """Decisions for idle leases past their early deadline, in words that name
    the grace which set it: parked in place where their node can park
    (``parkable``, :func:`.reclaim.parks_idle`), else reclaimed."""
    decisions = []
    parks = priority.acting(plan, now)[0]
    for lease in active:
        own = idle_deadline(lease)
        if lease.id in parks and own is not None and now < own:
            early = plan.parks[lease.id]
            idle = (now - lease.idle_since).total_seconds()
            words = f"{early.reason} (idle for {format_duration(idle)}, {grace_words(early)})"
            decisions.append(Decision(lease.id, LeaseState.parked, words, ParkCode.pressure)
                             if parks_idle(lease, parkable) else
                             Decision(lease.id, LeaseState.reclaimed, words, Reclaim.pressure))
    return decisions


def preempts(plan: priority.Plan, active: Iterable[Any], now: datetime, parkable: Collection[str]) -> list[Decision]:
    """Park decisions for preemptible leases whose cell runs past their
    ``preempt_at``, frozen where they are (``running_cell`` freeze: the agent
    interrupts instead where its checkpointer cannot freeze mid-cell), on nodes
    that can park (``parkable``); elsewhere the notebook interrupts its cell."""
    preempting = priority.acting(plan, now)[1]
    return [Decision(lease.id, LeaseState.parked, plan.preemptions[lease.id].reason, ParkCode.preemption, FREEZE)
            for lease in active
            if lease.id in preempting and is_busy(lease) and lease.preemptible
            and lease.node_name in parkable]


def coming_preemption(plan: priority.Plan, made: datetime | None, lease: Any) -> priority.Preemption | None:
    """``lease``'s preemption in ``plan`` (made at ``made``; None: not known) while it is still to
    come: the lease active, its cell running (an idle one is parked by its early deadline),
    holding its GPU since before the plan was made. Parking or parked, it has come; a lease
    parked and resumed since (``held_since`` after ``made``) is not the one the plan preempted:
    the next sweep's plan says whether it still is. What the lease JSON shows (``preempt_at``)."""
    preemption = plan.preemptions.get(lease.id)
    if preemption is None or lease.state != LeaseState.active.value or not is_busy(lease):
        return None
    if made is not None and lease.held_since is not None and lease.held_since > made:
        return None
    return preemption


def still_preempted(plan: priority.Plan, lease: Any, now: datetime) -> bool:
    """Re-checked under the write lock: still active, its cell running, past its ``preempt_at``."""
    preemption = plan.preemptions.get(lease.id)
    return (lease.state == LeaseState.active.value and is_busy(lease) and preemption is not None
            and preemption.at <= now)


def grace_words(early: priority.EarlyPark) -> str:
    """Which grace set ``early``'s deadline: ``pressure grace 2m``, or the cleared node's."""
    grace = format_duration(early.grace)
    return f"its node cleared for a whole-node request, grace {grace}" if early.cleared else f"pressure grace {grace}"


def still_due(plan: priority.Plan, lease: Any, now: datetime) -> bool:
    """Re-checked under the write lock: still idle and past its early deadline."""
    when = deadline(plan, lease)
    return (lease.state == LeaseState.active.value and lease.worker_state == WorkerState.idle
            and when is not None and when <= now)


def held(lease: Any) -> priority.Held:
    """``lease`` (its ``gpus`` loaded) as the rules see it: the plan and the ETA."""
    idle, busy = lease.worker_state == WorkerState.idle, is_busy(lease)
    return priority.Held(lease.id, lease.owner, lease.fraction * lease.gpu_count, lease.lease_class,
                         bool(lease.preemptible), busy, lease.started_at or lease.created_at,
                         lease.idle_since if idle else None, idle_deadline(lease), lease.node_name,
                         gpu_ids=tuple(gpu.gpu_uuid for gpu in lease.gpus),
                         cell_started=(lease.cell_started_at or lease.started_at) if busy else None,
                         idle_timeout=lease.idle_timeout if lease.idle_timeout > 0 else None)
