"""What each GPU has allocated, read from the store for the scheduler, the
pool view and the metrics.

Allocation is always summed from the leases that hold capacity
(``LeaseState.holds_capacity``) at the moment of reading, never kept in a
counter, so a crashed release cannot leak a slice. Parked leases hold no
share but what they still take: GPU memory their checkpointer could not free
(``gpu_bytes_kept``) on their GPUs, host RAM (``parked_host_bytes``) on their node; the
rest of their share is claimed there (``GPUState.parked_fraction``), kept free while other room fits. The service's
:class:`CapacityIndex` keeps the scheduler's view in memory between
requests, re-reading only the GPUs that writers named as changed, and
checks every decision against the store before it is written.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from gpupool.schema import LeaseState

from .changes import Changes
from .rules.hosts import HostState
from .models import GPU, Lease, LeaseGPU, Node
from .rules.placement_index import PlacementIndex
from .rules.scheduler import GPUState, Placement
from .rules.workload import Workload

log = logging.getLogger(__name__)

HOLDING = tuple(state.value for state in LeaseState if state.holds_capacity)
PARKED = LeaseState.parked.value
STARTING = LeaseState.starting.value


@dataclass
class Allocation:
    """Sums over the capacity-holding leases of one GPU (memory in bytes)."""

    fraction: float = 0.0
    memory: int = 0
    leases: int = 0
    parked_fraction: float = 0.0
    parked_memory: int = 0
    parked_leases: int = 0


def allocations(session: Session, uuids: Collection[str] | None = None) -> dict[str, Allocation]:
    """GPU UUID -> what the leases holding capacity take of it (of ``uuids`` only,
    when given), the GPU memory parked leases could not free there
    (``gpu_bytes_kept``, shared evenly by their GPUs: memory, no fraction, not counted in ``leases``)
    and the rest of the parked leases' share, claimed for their resume (``parked_fraction``, ``parked_memory``,
    by ``parked_leases``)."""
    query = (select(LeaseGPU.gpu_uuid, Lease.state, Lease.fraction, Lease.memory, Lease.gpu_count,
                    Lease.gpu_bytes_kept)
             .join(Lease, Lease.id == LeaseGPU.lease_id)
             .where(Lease.state.in_(HOLDING + (PARKED,))))
    if uuids is not None:
        query = query.where(LeaseGPU.gpu_uuid.in_(uuids))
    rows = session.execute(query).all()
    totals: dict[str, Allocation] = defaultdict(Allocation)
    for uuid, state, fraction, memory, count, kept in rows:
        alloc = totals[uuid]
        if state == PARKED:
            kept_here = (kept or 0) // max(1, count)
            alloc.memory += kept_here
            alloc.parked_fraction += fraction
            alloc.parked_memory += max(0, memory - kept_here)
            alloc.parked_leases += 1
            continue
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


def gpu_states(session: Session, context_overhead: int, uuids: Collection[str] | None = None) -> list[GPUState]:
    """The scheduler's view of every GPU in the pool (of ``uuids`` only, when given), by node name."""
    alloc = allocations(session, uuids)
    query = select(GPU, Node).join(Node, Node.name == GPU.node_name).order_by(Node.name, GPU.index)
    if uuids is not None:
        query = query.where(GPU.uuid.in_(uuids))
    states, offers = [], {}
    for gpu, node in session.execute(query):
        taken = alloc.get(gpu.uuid, Allocation())
        if node.name not in offers:  # one frozenset per node, shared by its GPUs
            offers[node.name] = environment_offer(node.environments)
        states.append(GPUState(
            uuid=gpu.uuid, node=node.name, name=gpu.name, index=gpu.index,
            memory_total=gpu.memory_total, memory_usable=usable_memory(gpu, context_overhead),
            allocated_fraction=taken.fraction, allocated_memory=taken.memory,
            observed_memory_used=gpu.memory_used, healthy=gpu.healthy, node_up=node.state != "lost",
            node_degraded=node.state == "degraded",
            memory_unattributed=gpu.memory_unattributed or 0,
            whole_only=node.whole_gpus,
            environments=offers[node.name][0], default_env=offers[node.name][1],
            parked_fraction=taken.parked_fraction, parked_memory=taken.parked_memory))
    return states


def environment_offer(reported: list[dict[str, Any]] | None) -> tuple[frozenset[str], str | None]:
    """``(names usable, default's name)`` of a node's ``environments`` as its agent
    reported them (``Node.environments``; None from an agent that reports none)."""
    envs = reported or []
    return (frozenset(e["name"] for e in envs if e.get("usable")),
            next((e["name"] for e in envs if e.get("default")), None))


def moving_host_bytes(session: Session, nodes: Collection[str] | None = None) -> dict[str, int]:
    """Node -> host bytes that leases moving away from it still hold there (of ``nodes`` only, when
    given): a cold move (:func:`.parked.moving`) makes the lease ``starting`` on its new node at once,
    but its frozen worker keeps its ``parked_host_bytes`` on the old node (``moved_from``) until the
    move's spill is done (:func:`.parked.spilled` makes them 0). Counted there as parked bytes, so
    that nothing is placed on that RAM meanwhile. Only moves with bytes in memory are read: few rows."""
    rows = session.execute(select(Lease.moved_from, Lease.parked_host_bytes).where(
        Lease.state == STARTING, Lease.park_tier.is_not(None), Lease.parked_host_bytes > 0))
    held: dict[str, int] = defaultdict(int)
    for moved_from, host_bytes in rows:
        node = (moved_from or {}).get("node") if isinstance(moved_from, dict) else None
        if node is not None and (nodes is None or node in nodes):
            held[node] += int(host_bytes)
    return dict(held)


def host_states(session: Session, nodes: Collection[str] | None = None) -> dict[str, HostState]:
    """Node -> its host (cores, RAM, GPU count, what holding leases take, and the
    host RAM its parked leases hold, ``parked_host_bytes``, with what leases moving
    away from it still hold there, :func:`moving_host_bytes`), for the nodes (of
    ``nodes`` only, when given) whose agent reported a host. Two queries."""
    holding = (Lease.node_name == Node.name) & Lease.state.in_(HOLDING)
    parked = (Lease.node_name == Node.name) & (Lease.state == PARKED)
    query = select(Node.name, Node.host_cpus, Node.host_memory,
                   select(func.count()).where(GPU.node_name == Node.name).scalar_subquery(),
                   select(func.coalesce(func.sum(Lease.cpus), 0.0)).where(holding).scalar_subquery(),
                   select(func.coalesce(func.sum(Lease.host_memory), 0)).where(holding).scalar_subquery(),
                   select(func.coalesce(func.sum(Lease.parked_host_bytes), 0)).where(parked).scalar_subquery(),
                   ).where(Node.host_cpus.is_not(None), Node.host_memory.is_not(None))
    if nodes is not None:
        query = query.where(Node.name.in_(nodes))
    moving = moving_host_bytes(session, nodes)
    hosts = {}
    for name, cpus, memory, gpus, used_cpus, used_memory, parked_bytes in session.execute(query):
        parked_bytes = int(parked_bytes) + moving.get(name, 0)
        hosts[name] = HostState(name, cpus, memory, gpus, float(used_cpus), int(used_memory) + parked_bytes,
                                parked_bytes)
    return hosts


class CapacityIndex:
    """The service's :class:`.placement_index.PlacementIndex`, kept equal to the store.

    Writers record what they change in their transaction's change set
    (:class:`.changes.Changes`); once it commits, :meth:`changed` takes it,
    and the next :meth:`get` (inside the placing transaction, which holds the
    capacity lock) re-reads just those GPUs.
    So a decision at 10,000 GPUs reads a handful of rows, not every GPU.
    :meth:`verify` re-reads the chosen GPUs before the decision is written:
    a change no change set named (another service process, a writer that forgot it) costs a
    rebuild and a new decision, never an over-allocation.
    """

    def __init__(self, context_overhead: int) -> None:
        self.context_overhead = context_overhead
        self._index: PlacementIndex | None = None
        self._gpus: set[str] = set()
        self._nodes: set[str] = set()

    def invalidate(self) -> None:
        """Forget everything: the next :meth:`get` reads every GPU."""
        self._index = None

    def changed(self, changes: Changes) -> None:
        """Take the change set of a committed transaction."""
        if changes.all:
            self.invalidate()
        self._gpus.update(changes.gpus)
        self._nodes.update(changes.nodes)

    def get(self, session: Session, workload: Workload) -> PlacementIndex:
        """The index, up to date with the store as ``session`` sees it, deciding for ``workload``."""
        if self._index is not None and (self._gpus or self._nodes):
            self._refresh(session)
        if self._index is None:
            self._index = PlacementIndex(gpu_states(session, self.context_overhead), workload, host_states(session))
        self._gpus.clear()
        self._nodes.clear()
        self._index.workload = workload
        return self._index

    def _refresh(self, session: Session) -> None:
        index = self._index
        uuids = set(self._gpus)
        for node in self._nodes:
            uuids.update(index.node_gpus(node))
        fresh = gpu_states(session, self.context_overhead, uuids)
        if {s.uuid for s in fresh} != uuids & index.states.keys() or any(
                s.uuid not in index.states or index.states[s.uuid].node != s.node for s in fresh):
            self._index = None  # GPUs came, went or moved: read them all
            return
        for state in fresh:
            index.update(state)
        nodes = {index.states[u].node for u in uuids if u in index.states}
        for host in host_states(session, nodes).values():
            index.update_host(host)

    def verify(self, session: Session, placement: Placement) -> bool:
        """True when the store agrees with the index on ``placement``'s GPUs;
        otherwise logs it, forgets the index and returns False (decide again).
        On PostgreSQL the GPUs' rows stay locked until the lease is written
        (in UUID order, as heartbeats update them: no deadlock)."""
        session.execute(select(GPU.uuid).where(GPU.uuid.in_(placement.gpus)).order_by(GPU.uuid)
                        .with_for_update()).all()
        fresh = gpu_states(session, self.context_overhead, placement.gpus)
        states = self._index.states if self._index is not None else {}
        hosts = self._index.hosts if self._index is not None else {}
        host = host_states(session, [placement.node]).get(placement.node)
        if len(fresh) == len(placement.gpus) and all(_same_capacity(s, states.get(s.uuid)) for s in fresh) \
                and _same_host(host, hosts.get(placement.node)):
            return True
        log.warning("the in-memory pool view disagreed with the store on %s; reading every GPU again",
                    ", ".join(placement.gpus))
        self.invalidate()
        return False


def _same_capacity(a: GPUState, b: GPUState | None) -> bool:
    """Equal in everything placement depends on (not NVML's latest reading, shown in messages only)."""
    fields = ("node", "memory_usable", "allocated_memory", "memory_unattributed", "healthy", "node_up",
              "node_degraded", "whole_only", "environments", "default_env", "parked_memory")
    return b is not None and abs(a.allocated_fraction - b.allocated_fraction) <= 1e-9 and \
        abs(a.parked_fraction - b.parked_fraction) <= 1e-9 and all(
        getattr(a, f) == getattr(b, f) for f in fields)


def _same_host(a: HostState | None, b: HostState | None) -> bool:
    """Equal hosts (cores compared to float noise)."""
    if a is None or b is None:
        return a is b
    return (a.memory, a.gpus, a.memory_allocated, a.memory_parked) == (b.memory, b.gpus, b.memory_allocated,
                                                                       b.memory_parked) and \
        abs(a.cpus - b.cpus) <= 1e-6 and abs(a.cpus_allocated - b.cpus_allocated) <= 1e-6
