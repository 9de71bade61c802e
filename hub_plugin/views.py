"""The JSON the API returns for leases and the pool (docs/api.md), built as
the bodies of :mod:`gpupool.wire`.

A lease's JSON is :class:`gpupool.wire.leases.Lease`, the class the client
reads it with; the connection info (with the worker's HMAC key) goes only to
the lease's owner and only while its worker lives: active, parking, parked in
memory or resuming from memory (the notebook keeps its connection across a
park); never once it ended, nor while it is spilled to disk (no process).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpupool.leaseclasses import default as default_class
from gpupool.schema import LeaseState, isoformat
from gpupool.wire import leases as wire, pool

from . import parked
from .capacity import Allocation, allocations, moving_host_bytes, nodes_with_gpus, usable_memory
from .models import Lease
from .rules.reclaim import PARKED_STATES
from .rules.resume import resume_seconds

#: The states in which a lease's worker lives on its node (its connection is shown to its owner):
#: a spilled one's (parked on disk) is cleared with the process.
WORKER_LIVES = (LeaseState.active.value, *PARKED_STATES, LeaseState.starting.value)


def lease_body(lease: Lease, *, for_owner: bool, moves: bool = False, **known: Any) -> wire.Lease:
    """``lease`` (a row, with its GPUs and events loaded) on the wire;
    ``for_owner``: whether the caller owns it; ``moves``: ``c.PoolLeases.resume_moves``
    (whether a parked lease may move, :func:`.parked.may_move`). ``known``: the fields the row
    does not hold, which :meth:`.lease_views.LeaseViews.json` works out
    (``queue_position``, ``idle_deadline``, ``node_state``, ...), by their
    names in :class:`~gpupool.wire.leases.Lease`."""
    worker = None
    if lease.worker_pid is not None or lease.worker_state is not None:
        worker = {"pid": lease.worker_pid, "execution_state": lease.worker_state,
                  "memory_used": lease.worker_memory_used}
    show_connection = for_owner and lease.state in WORKER_LIVES and lease.connection
    park = parked.shown(lease, resume_seconds(lease.park_tier, lease.gpu_bytes_moved, lease.parked_disk_bytes), moves)
    return wire.Lease(
        id=lease.id, owner=lease.owner, state=LeaseState(lease.state), reason=lease.reason,
        fraction=lease.fraction, gpu_count=lease.gpu_count, memory=lease.memory,
        cpus=lease.cpus, host_memory=lease.host_memory,
        requested_cpus=lease.requested_cpus, requested_host_memory=lease.requested_host_memory,
        node=lease.node_name, gpus=[{"uuid": g.gpu_uuid, "name": g.name, "index": g.index} for g in lease.gpus],
        env=lease.env, idle_timeout=lease.idle_timeout, heartbeat_ttl=lease.heartbeat_ttl,
        kernel_id=lease.kernel_id, server_name=lease.server_name,
        lease_class=lease.lease_class or default_class().name, preemptible=bool(lease.preemptible),
        created_at=isoformat(lease.created_at), started_at=isoformat(lease.started_at),
        ended_at=isoformat(lease.ended_at), idle_since=isoformat(lease.idle_since),
        worker=worker, connection=dict(lease.connection) if show_connection else None,
        usage_gpu_seconds=lease.usage_gpu_seconds, parked_seconds=lease.parked_seconds or 0.0,
        events=[{"state": e.state, "at": isoformat(e.at), "reason": e.reason} for e in lease.events],
        on_idle=lease.on_idle or "park", parked=park, **known)


def pool_json(session: Session, context_overhead: int) -> dict[str, Any]:
    """``GET /pool``: :class:`gpupool.wire.pool.Pool`, the nodes, their GPUs
    and what is allocated, and apart from it what parked leases claim there
    (``parked_fraction``; ``parked_unbacked``: the part of it other leases took, so that
    ``totals.parked`` counts only claims that are still free; ``context_overhead``: bytes
    per GPU that leases may not have, ``c.PoolNodes.context_overhead``)."""
    alloc = allocations(session)
    parks = {row[0]: (row[1], int(row[2] or 0)) for row in session.execute(
        select(Lease.node_name, func.count(), func.sum(Lease.parked_host_bytes))
        .where(Lease.state.in_(PARKED_STATES)).group_by(Lease.node_name))}
    moving = moving_host_bytes(session)  # leases moving away hold their frozen worker's RAM until the spill
    nodes, total, allocated, free, claimed, unbacked = [], 0, 0.0, 0.0, 0.0, 0.0
    for node in nodes_with_gpus(session):
        gpus = []
        for gpu in node.gpus:
            taken = alloc.get(gpu.uuid, Allocation())
            room = max(0.0, 1.0 - taken.fraction)
            # A claim is room kept while other room fits: a lease placed when none did may take it (the
            # claim stays, the resume waits), so the part beyond the room is shown apart, not as free.
            beyond = max(0.0, taken.parked_fraction - room)
            total += 1
            allocated += taken.fraction
            unbacked += beyond
            if gpu.healthy and node.state == "up":
                free += room
                claimed += taken.parked_fraction - beyond
            gpus.append(pool.PoolGPU(
                uuid=gpu.uuid, name=gpu.name, index=gpu.index,
                memory_total=gpu.memory_total, memory_usable=usable_memory(gpu, context_overhead),
                allocated_fraction=round(taken.fraction, 9), allocated_memory=taken.memory,
                leases=taken.leases, healthy=gpu.healthy, memory_used=gpu.memory_used, utilization=gpu.utilization,
                parked_fraction=round(taken.parked_fraction, 9), parked_leases=taken.parked_leases,
                parked_unbacked=round(beyond, 9)))
        nodes.append(pool.PoolNode(
            name=node.name, state=node.state, state_reason=node.state_reason, inventory=node.inventory,
            enforcement=node.enforcement, last_heartbeat_at=isoformat(node.last_heartbeat_at),
            environments=node.environments or [], host_cpus=node.host_cpus, host_memory=node.host_memory,
            gpus=gpus, checkpointer=(node.checkpointer or {}).get("name"),
            freezes_running_cell=(node.checkpointer or {}).get("mid_cell") is True, parked_memory=node.parked_memory,
            parked_host_bytes=parks.get(node.name, (0, 0))[1] + moving.get(node.name, 0),
            parked_leases=parks.get(node.name, (0, 0))[0]))
    return pool.Pool(nodes, pool.PoolTotals(total, round(allocated, 9), round(free, 9), round(claimed, 9),
                                            round(unbacked, 9))).to_json()
