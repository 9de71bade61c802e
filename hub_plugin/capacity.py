"""What each GPU has allocated, read from the store for the scheduler, the
pool view and the metrics.

Allocation is always summed from the leases that hold capacity
(``LeaseState.holds_capacity``) at the moment of reading, never kept in a
counter, so a crashed release cannot leak a slice.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from gpupool.schema import LeaseState

from .models import GPU, Lease, LeaseGPU, Node
from .scheduler import GPUState

HOLDING = tuple(state.value for state in LeaseState if state.holds_capacity)
#: Node enforcement modes that hand out whole GPUs only (docs/enforcement.md).
WHOLE_GPU_MODES = ("mig", "exclusive")


@dataclass
class Allocation:
    """Sums over the capacity-holding leases of one GPU (memory in bytes)."""

    fraction: float = 0.0
    memory: int = 0
    leases: int = 0


def allocations(session: Session) -> dict[str, Allocation]:
    """GPU UUID -> what the leases holding capacity take of it."""
    rows = session.execute(
        select(LeaseGPU.gpu_uuid, Lease.fraction, Lease.memory)
        .join(Lease, Lease.id == LeaseGPU.lease_id)
        .where(Lease.state.in_(HOLDING))).all()
    totals: dict[str, Allocation] = defaultdict(Allocation)
    for uuid, fraction, memory in rows:
        alloc = totals[uuid]
        alloc.fraction += fraction
        alloc.memory += memory
        alloc.leases += 1
    return totals


def usable_memory(gpu: GPU, context_overhead: int) -> int:
    """Bytes leases may share: total minus driver-reserved minus one CUDA context."""
    return max(0, gpu.memory_total - gpu.memory_reserved - context_overhead)


def nodes_with_gpus(session: Session) -> list[Node]:
    """Every node, by name, with its GPUs loaded."""
    return list(session.scalars(select(Node).options(selectinload(Node.gpus)).order_by(Node.name)))


def gpu_states(session: Session, context_overhead: int) -> list[GPUState]:
    """The scheduler's view of every GPU in the pool."""
    alloc = allocations(session)
    states = []
    for node in nodes_with_gpus(session):
        for gpu in node.gpus:
            taken = alloc.get(gpu.uuid, Allocation())
            states.append(GPUState(
                uuid=gpu.uuid, node=node.name, name=gpu.name, index=gpu.index,
                memory_total=gpu.memory_total, memory_usable=usable_memory(gpu, context_overhead),
                allocated_fraction=taken.fraction, allocated_memory=taken.memory,
                observed_memory_used=gpu.memory_used, healthy=gpu.healthy, node_up=node.state == "up",
                memory_unattributed=gpu.memory_unattributed or 0,
                whole_only=node.enforcement in WHOLE_GPU_MODES))
    return states
