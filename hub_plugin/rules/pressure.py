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
from typing import Any, Iterable

from gpupool.schema import LeaseState
from gpupool.units import format_duration

from . import priority
from .reclaim import Decision, Reclaim, idle_deadline


def deadline(plan: priority.Plan, lease: Any) -> datetime | None:
    """``lease``'s idle deadline: its own, or the earlier one ``plan`` set."""
    own = idle_deadline(lease)
    early = plan.parks.get(lease.id)
    if own is None or early is None:
        return own
    return min(own, early.deadline)


def due(plan: priority.Plan, active: Iterable[Any], now: datetime) -> list[Decision]:
    """Reclaim decisions for idle leases past their early deadline, in words
    that name the grace which set it: the fallback when the notebook did not
    park them itself."""
    decisions = []
    parks = priority.acting(plan, now)[0]
    for lease in active:
        own = idle_deadline(lease)
        if lease.id in parks and own is not None and now < own:
            early = plan.parks[lease.id]
            idle = (now - lease.idle_since).total_seconds()
            decisions.append(Decision(lease.id, LeaseState.reclaimed,
                                      f"{early.reason} (idle for {format_duration(idle)}, {grace_words(early)})",
                                      Reclaim.pressure))
    return decisions


def grace_words(early: priority.EarlyPark) -> str:
    """Which grace set ``early``'s deadline: ``pressure grace 2m``, or the cleared node's."""
    grace = format_duration(early.grace)
    return f"its node cleared for a whole-node request, grace {grace}" if early.cleared else f"pressure grace {grace}"


def still_due(plan: priority.Plan, lease: Any, now: datetime) -> bool:
    """Re-checked under the write lock: still idle and past its early deadline."""
    when = deadline(plan, lease)
    return (lease.state == LeaseState.active.value and lease.worker_state == "idle"
            and when is not None and when <= now)


def held(lease: Any) -> priority.Held:
    """``lease`` as the plan sees it."""
    idle = lease.worker_state == "idle"
    return priority.Held(lease.id, lease.owner, lease.fraction * lease.gpu_count, lease.lease_class,
                         bool(lease.preemptible), lease.worker_state == "busy", lease.started_at or lease.created_at,
                         lease.idle_since if idle else None, idle_deadline(lease), lease.node_name)
