"""A lease's state changes as the store records them: each writes the new
state and its :class:`~.models.LeaseEvent`, and names what it changed in the
transaction's change set (the lease for long polls, its GPUs when it takes or
gives back capacity). The life cycle that decides them is in :mod:`.leases`.
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import select

from gpupool.schema import LeaseState
from gpupool.units import format_duration

from . import cell_log, usage
from .models import GPU, Lease, LeaseEvent, LeaseGPU
from .rules.scheduler import Placement
from .state import Transaction

log = logging.getLogger("gpupool.service.leases")

QUEUED = LeaseState.queued.value
PARKED = LeaseState.parked.value
#: The states ``c.PoolQuotas.max_active_per_user`` counts: a lease releasing is on its way out.
CAPPED = (LeaseState.starting.value, LeaseState.active.value)
#: Parked leases whose resume was asked for: they wait in the queue for room on their node.
RESUMING = (Lease.state == LeaseState.parked.value) & Lease.resume_requested_at.is_not(None)


def transition(tx: Transaction, lease: Lease, state: LeaseState, reason: str | None, at: datetime) -> None:
    """Set ``lease.state`` and store the event; the commit wakes long polls."""
    if lease.state is None or LeaseState(lease.state).holds_capacity != state.holds_capacity \
            or PARKED in (lease.state, state.value):  # a parked lease claims room on its GPUs
        tx.changes.gpu_capacity([g.gpu_uuid for g in lease.gpus])
    lease.state = state.value
    lease.events.append(LeaseEvent(state=state.value, at=at, reason=reason))
    tx.changes.lease(lease.id)


def assign(tx: Transaction, lease: Lease, decision: Placement, now: datetime, *, after: str | None = None) -> str:
    """Give ``lease`` the GPUs of ``decision`` and make it ``starting``; returns where, in words.
    ``after``: why it is placed again (:mod:`.replacing`), said first in the event's reason."""
    gpus = {g.uuid: g for g in tx.session.scalars(select(GPU).where(GPU.uuid.in_(decision.gpus)))}
    lease.fraction, lease.memory, lease.node_name = decision.fraction, decision.memory, decision.node
    lease.env = decision.env  # the node's default when the request named none: %gpu status shows it
    lease.cpus, lease.host_memory = decision.cpus, decision.host_memory
    lease.gpus = [LeaseGPU(gpu_uuid=u, name=gpus[u].name, index=gpus[u].index) for u in decision.gpus]
    where = ", ".join(f"GPU {g.index} ({g.name})" for g in lease.gpus)
    placed = f"placed on {decision.node}: {where}"
    transition(tx, lease, LeaseState.starting, f"{after}; {placed}" if after else placed, now)
    return f"{decision.node} {where}"


def end(tx: Transaction, lease: Lease, now: datetime, note: str | None = None) -> None:
    """A ``releasing`` lease to its final state, with ``ended_at`` and its usage
    (the ledger record). ``note``: words added to the reason unless it failed."""
    final = LeaseState(lease.end_state or LeaseState.released.value)
    if note and final is not LeaseState.failed:
        lease.reason = f"{lease.reason}; {note}"
    lease.ended_at = now
    held = (now - lease.started_at).total_seconds() if lease.started_at else 0.0
    lease.usage_gpu_seconds = usage.close(tx.session, lease, now)
    cell_log.close(tx.session, lease, now)  # a cell that ran to the end
    lease.connection = None  # the worker and its key are gone
    transition(tx, lease, final, lease.reason, now)
    log.info("lease %s %s after %s (%.1f GPU-seconds): %s", lease.id, final.value,
             format_duration(held), lease.usage_gpu_seconds, lease.reason)


def is_queued(lease: Lease, now: datetime) -> bool:
    return lease.state == QUEUED


def still_queued(lease: Lease, now: datetime) -> bool:
    # Re-checked under the write lock: the request may have been placed since the sweep read it.
    return lease.state == QUEUED and lease.wait_until is not None and lease.wait_until <= now
