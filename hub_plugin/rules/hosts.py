"""Host CPU and memory in a slice: what a node's host has, what a request
takes of it, and when that binds. Pure, like :mod:`.scheduler`, which calls it.

A node's agent reports its cores and RAM at registration (a node that
reports none has no host dimension: nothing is checked or reserved there).
A request names ``cpus`` (cores, may be fractional) and ``host_memory``
(bytes), or leaves them to the default: its GPU share of the node's GPUs,
times the node's cores and RAM, times ``host_share`` (its RAM less what
parked leases hold there, where that is all that is left: :func:`host_ask`)
(``c.PoolNodes.host_share``, 1.0 by default). So half a GPU on a node of 8
GPUs, 64 cores and 512 GiB gets 4 cores and 32 GiB; the default always fits
beside other default leases, and is known once the node is chosen (the
scheduler resolves it per candidate node, as it resolves a slice's GPU
memory per candidate GPU).

Fragmentation counts host dimensions as Weng et al. do (ATC '23, section
6; :mod:`.fragmentation`): a request shape whose host ask no longer fits a
node makes all of the node's free GPU capacity a fragment. The workload's
shapes ask the default (proportional) host share. :func:`binds` says when
that can happen (never while every lease takes the default); only then does the scheduler pay for the vectorised
measure (:func:`host_aware_delta`); elsewhere its GPU-only growth is the
same number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from gpupool.units import format_bytes

from .fragmentation import FULL, TaskTypes, node_fragmentation
from .misfits import Misfit

NO_CPUS = Misfit.no_host_cpus
NO_HOST_MEMORY = Misfit.no_host_memory
MIB = 2**20
#: The least a worker may use when its lease took the default share (a
#: Python kernel does not run usefully on less): its cgroup limits are at
#: least this, capped at the node's; its reservation stays the share, so
#: many tiny slices may overcommit the host by up to this much each.
DEFAULT_FLOOR_CPUS = 1.0
DEFAULT_FLOOR_MEMORY = 2**30


@dataclass(frozen=True)
class HostState:
    """A node's host as the scheduler sees it: ``cpus`` cores and ``memory``
    bytes its agent reported, ``gpus`` how many GPUs it has (the default
    share divides by it), and the sums the leases holding capacity there
    take (``cpus_allocated`` cores, ``memory_allocated`` bytes, which counts
    ``memory_parked`` too: the host RAM its parked leases hold, no cores)."""

    node: str
    cpus: float
    memory: int
    gpus: int
    cpus_allocated: float = 0.0
    memory_allocated: int = 0
    memory_parked: int = 0

    @property
    def free_cpus(self) -> float:
        return max(0.0, self.cpus - self.cpus_allocated)

    @property
    def free_memory(self) -> int:
        return max(0, self.memory - self.memory_allocated)

    def taken(self, cpus: float, memory: int, sign: int = 1) -> "HostState":
        """This host with ``sign`` x (``cpus``, ``memory``) more allocated."""
        return replace(self, cpus_allocated=round(self.cpus_allocated + sign * cpus, 6),
                       memory_allocated=self.memory_allocated + sign * memory)

    def unparked(self, memory: int) -> "HostState":
        """This host with ``memory`` bytes of its parked leases given back (a resume's own)."""
        memory = min(memory, self.memory_parked)
        return replace(self, memory_allocated=self.memory_allocated - memory, memory_parked=self.memory_parked - memory)


def share_of(gpu_share: float, host: HostState, host_share: float) -> tuple[float, int]:
    """The default ``(cores, bytes)`` of ``gpu_share`` GPUs (0.5, or 2 for two
    whole ones) on ``host``: proportional to its GPUs, times ``host_share``.
    Rounded down, cores to 0.01 (the cgroup quota's grain), so default shares
    never add up to more than the host."""
    part = gpu_share / max(1, host.gpus) * host_share
    return math.floor(host.cpus * part * 100 + 1e-6) / 100, int(host.memory * part)


def host_ask(demand, host: HostState) -> tuple[float, int]:
    """``(cores, bytes)`` ``demand`` (a :class:`.scheduler.Demand`) takes on
    ``host``: what it names, the default share (:func:`share_of`) for what it
    does not. The default share of memory gives way to what parked leases hold
    there (down to :data:`DEFAULT_FLOOR_MEMORY`): their frozen workers use host
    RAM that no reservation covers, and refusing a default share for it would
    keep the GPU a park gave back from its next lease."""
    cpus, memory = share_of(demand.fraction * demand.gpu_count, host, demand.host_share)
    if demand.host_memory is None and host.memory_parked and memory > host.free_memory:
        room = host.free_memory
        if memory <= room + host.memory_parked and room >= min(memory, DEFAULT_FLOOR_MEMORY):
            memory = room
    return (demand.cpus if demand.cpus is not None else cpus,
            demand.host_memory if demand.host_memory is not None else memory)


def host_misfit(demand, host: HostState | None) -> Misfit | None:
    """Why ``host`` cannot take ``demand``'s host ask now (a reason), or None."""
    if host is None:
        return None
    cpus, memory = host_ask(demand, host)
    if cpus > host.free_cpus + 1e-9:
        return NO_CPUS
    if memory > host.free_memory:
        return NO_HOST_MEMORY
    return None


def binds(demand, host: HostState | None, workload, free: list[float], taken: dict[int, float]) -> bool:
    """True when host dimensions change the fragmentation growth of
    ``demand`` taking ``taken`` (position in ``free`` -> fraction) of a
    node's GPUs (``free``: each one's free fraction, -1 unusable) and its
    host ask of ``host``: some shape of ``workload`` that the node's GPUs fit,
    before or after, does not fit its host then. Otherwise every shape's term
    is what the GPUs alone make it. With default (proportional) asks only, a
    host has the share of every GPU it has free, so it never binds."""
    if host is None or not workload:
        return False
    cpus, memory = host_ask(demand, host)
    needs = _needs(workload, host.cpus, host.memory, host.gpus, demand.host_share)
    if host.free_cpus - cpus >= needs[0][2] - 1e-9 and host.free_memory - memory >= needs[0][3]:
        return False  # room for any shape even after: the cheap answer
    after = list(free)
    for position, fraction in taken.items():
        after[position] -= fraction
    for gpus, free_cpus, free_memory in ((free, host.free_cpus, host.free_memory),
                                         (after, host.free_cpus - cpus, host.free_memory - memory)):
        idle, best = sum(f >= 1 - 1e-9 for f in gpus), max(gpus, default=-1.0)
        for count, fraction, need_cpus, need_memory in needs[1:]:
            if ((idle >= count) if count > 1 else (best >= fraction - 1e-9)) and (
                    free_cpus < need_cpus - 1e-9 or free_memory < need_memory):
                return True
    return False


@lru_cache(maxsize=1024)
def _needs(workload, cpus: float, memory: int, gpus: int,
           host_share: float) -> tuple[tuple[int, float, float, int], ...]:
    """``(gpu_count, fraction, cores, bytes)`` of each shape on such a host,
    the most any asks first (as ``(0, 0, cores, bytes)``)."""
    host = HostState("", cpus, memory, gpus)
    rows = [(s.gpu_count, s.fraction, *share_of(s.fraction * s.gpu_count, host, host_share)) for s in workload]
    return ((0, 0.0, max(r[2] for r in rows), max(r[3] for r in rows)), *rows)


def proportional(demand, host: HostState | None, free_gpus: float) -> bool:
    """True when ``demand`` takes the default share and ``host`` still has
    its default share of the ``free_gpus`` (GPUs) its node has free: then
    :func:`binds` is False whatever the node's GPUs look like (every shape
    that fits the GPUs finds its share), and the caller need not ask it."""
    if host is None or demand.cpus is not None or demand.host_memory is not None:
        return host is None
    cpus, memory = share_of(free_gpus, host, demand.host_share)
    return host.free_cpus >= cpus - 0.01 * host.gpus and host.free_memory >= memory - host.gpus


def host_aware_delta(demand, host: HostState, free: list[float], taken: dict[int, float], workload) -> float:
    """Growth of the node's fragmentation (GPUs) when ``demand`` takes
    ``taken`` (position in ``free`` -> fraction) of its GPUs and its host ask
    of ``host``; ``free`` lists each GPU's free fraction (-1: unusable). The
    measure of :func:`.fragmentation.node_fragmentation`, every dimension."""
    cpus, memory = host_ask(demand, host)
    before = np.array([round(f * FULL) if f >= 0 else -1 for f in free], dtype=np.int64)
    after = before.copy()
    for position, fraction in taken.items():
        after[position] -= round(fraction * FULL)
    cpu_free = np.array([host.free_cpus, host.free_cpus - cpus]) * 1000
    mem_free = np.array([host.free_memory, host.free_memory - memory]) / MIB
    frag = node_fragmentation(cpu_free, mem_free, np.stack([before, after]), _types(workload, host, demand.host_share))
    return float(frag[1] - frag[0]) / FULL


def _types(workload, host: HostState, host_share: float) -> TaskTypes:
    """``workload``'s shapes as task types on ``host`` (milli-cores, MiB, GPUs, milli-GPUs)."""
    asks = [share_of(s.fraction * s.gpu_count, host, host_share) for s in workload]
    return TaskTypes(np.array([c * 1000 for c, _ in asks]), np.array([m / MIB for _, m in asks]),
                     np.array([s.gpu_count for s in workload]),
                     np.array([FULL if s.gpu_count > 1 else round(s.fraction * FULL) for s in workload]),
                     np.array([s.weight for s in workload], dtype=float))


def beyond_every_node(demand, hosts: dict[str, HostState]) -> str | None:
    """Words for a person when ``demand`` names more cores or host memory
    than the biggest node (of those reporting a host) has at all, else None."""
    if not hosts or (demand.cpus is None and demand.host_memory is None):
        return None
    most_cpus = max(hosts.values(), key=lambda h: (h.cpus, h.memory))
    most_memory = max(hosts.values(), key=lambda h: (h.memory, h.cpus))
    if demand.cpus is not None and demand.cpus > most_cpus.cpus + 1e-9:
        return (f"{demand.cpus:g} host CPUs is more than any node has: the biggest, {most_cpus.node}, has "
                f"{most_cpus.cpus:g} cores and {format_bytes(most_cpus.memory)}; ask for at most that (--cpus)")
    if demand.host_memory is not None and demand.host_memory > most_memory.memory:
        return (f"{format_bytes(demand.host_memory)} of host memory is more than any node has: the biggest, "
                f"{most_memory.node}, has {format_bytes(most_memory.memory)} and {most_memory.cpus:g} cores; "
                f"ask for at most that (--host-memory)")
    return None


def host_limits(lease, node) -> dict[str, float | int]:
    """The ``cpus`` / ``host_memory`` fields of the agent's ``POST /workers``
    for ``lease`` on ``node`` (models): what it holds, raised to the
    :data:`DEFAULT_FLOOR_CPUS` / :data:`DEFAULT_FLOOR_MEMORY` (at most the
    node's) where it took the default share; empty without a host."""
    limits: dict[str, float | int] = {}
    if lease.cpus is not None:
        limits["cpus"] = lease.cpus if lease.requested_cpus is not None else \
            max(lease.cpus, min(DEFAULT_FLOOR_CPUS, node.host_cpus or lease.cpus))
    if lease.host_memory is not None:
        limits["host_memory"] = lease.host_memory if lease.requested_host_memory is not None else \
            max(lease.host_memory, min(DEFAULT_FLOOR_MEMORY, node.host_memory or lease.host_memory))
    return limits


def roomiest(hosts: dict[str, HostState]) -> str:
    """``'the most free host is gpu-a: 12 CPUs, 96.0 GiB'`` (for refusals)."""
    best = max(hosts.values(), key=lambda h: (h.free_cpus, h.free_memory, h.node))
    return f"the most free host is {best.node}: {best.free_cpus:g} CPUs, {format_bytes(best.free_memory)}"
