"""An index over GPU states that gives :func:`.scheduler.place`'s answer
without scanning every GPU. Pure, in memory; the service keeps one
(:class:`.capacity.CapacityIndex`), as do the simulator and
bench/scheduler_bench.py. ``tests/test_scheduler.py::test_placement_index_gives_the_same_answer_under_churn``
checks it against ``place()`` on random pools under churn.

Why it is the same answer:

- A slice: ``place()`` picks, among the GPUs that fit, the least
  ``(fragmentation growth, free left, node, index)``
  (:func:`.scheduler.slice_key`). On a GPU that is not wholly free the
  growth depends only on its free fraction; on a wholly free one, only on
  how many wholly free GPUs its node has (:func:`.scheduler.slice_delta`).
  So GPUs fall into classes — partly taken GPUs by free fraction, wholly
  free ones by their node's idle count — whose members differ only in
  ``(node, index)``, and only the least member of each class that fits can
  win. Partly taken GPUs are kept sorted by ``(free, node, index)`` and
  nodes by ``(idle GPUs, name)``; the index finds each class's first fitting
  member and calls ``place()`` on those, with the nodes' idle counts.
- N whole GPUs: ``place()`` picks the least ``(fragmentation growth, idle
  GPUs, name)`` among nodes with at least N eligible idle GPUs, and the
  growth depends only on the node's idle count. When every GPU is usable
  (node up, healthy) and the request names no model and no memory, every
  idle GPU is eligible, so the winner is the first node of one of the idle
  counts ``>= N``; ``place()`` is then called on those nodes' GPUs.
  Otherwise ``place()`` scans every GPU.
- Host CPUs and memory (``hosts``, :mod:`.hosts`): a class's first member
  that fits is the first that fits in every dimension. A request that
  takes the default host share cannot make a node's host bind while the
  host has its default share of the node's free GPUs
  (:func:`.hosts.proportional`); the other nodes ("tight": some lease there
  named more than its share) have a growth of their own, so the classes
  leave them out and every fitting GPU of theirs goes to ``place()``. A
  request that names its host ask may bind anywhere: ``place()`` scans every
  GPU for it (exact, slower).
- When nothing fits, ``place()`` runs on every GPU, since the refusal's
  tally of reasons covers every GPU (unless the caller asks for no
  explanation: the queue only needs to know).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Iterable

from .hosts import HostState, host_misfit, proportional
from .scheduler import (DEFAULT_WORKLOAD, EPSILON, Demand, GPUState, Placement, Refusal, Workload, _whole_free,
                        place, slice_misfit)

#: How far below the asked fraction the search for partly taken GPUs starts (>> float noise).
WINDOW = 1e-8


class PlacementIndex:
    """GPU states by UUID; partly taken GPUs sorted by free fraction; nodes
    sorted by wholly free GPUs. ``workload`` is the scheduler's expected
    mix (assign :attr:`workload` to change it). ``hosts``: node -> its host
    (:class:`.hosts.HostState`), for nodes that report one. Call
    :meth:`update` / :meth:`update_host` (or :meth:`take` / :meth:`give`)
    whenever a GPU's or a host's state changes."""

    def __init__(self, gpus: Iterable[GPUState], workload: Workload = DEFAULT_WORKLOAD,
                 hosts: dict[str, HostState] | None = None) -> None:
        self.workload = workload
        self.hosts: dict[str, HostState] = dict(hosts or {})
        self.states: dict[str, GPUState] = {}
        self._node_gpus: dict[str, list[str]] = {}
        self._idle: dict[str, int] = {}
        self._free: dict[str, float] = {}  # node -> the sum of its usable GPUs' free fractions
        self._unusable = 0  # GPUs on lost nodes or unhealthy
        for gpu in gpus:
            self._unusable += _unusable(gpu)
            self.states[gpu.uuid] = gpu
            self._node_gpus.setdefault(gpu.node, []).append(gpu.uuid)
            self._idle[gpu.node] = self._idle.get(gpu.node, 0) + _whole_free(gpu)
            self._free[gpu.node] = self._free.get(gpu.node, 0.0) + max(0.0, _usable_free(gpu))
        for uuids in self._node_gpus.values():
            uuids.sort(key=lambda u: self.states[u].index)
        self._partial = sorted(_key(g) for g in self.states.values() if not _whole_free(g))
        self._nodes = sorted((idle, node) for node, idle in self._idle.items())
        self._tight: set[str] = set()
        for node in self.hosts:
            self._retight(node)

    def all(self) -> list[GPUState]:
        """Every GPU state, in no set order."""
        return list(self.states.values())

    def node_gpus(self, node: str) -> list[str]:
        """UUIDs of ``node``'s GPUs by index (empty for a node not indexed)."""
        return list(self._node_gpus.get(node, ()))

    def update(self, gpu: GPUState) -> None:
        """Replace the state of ``gpu.uuid`` (a GPU already indexed, on the same node)."""
        old = self.states[gpu.uuid]
        if not _whole_free(old):
            del self._partial[bisect.bisect_left(self._partial, _key(old))]
        if not _whole_free(gpu):
            bisect.insort(self._partial, _key(gpu))
        self.states[gpu.uuid] = gpu
        self._free[gpu.node] += max(0.0, _usable_free(gpu)) - max(0.0, _usable_free(old))
        self._retight(gpu.node)
        self._unusable += _unusable(gpu) - _unusable(old)
        if _whole_free(old) != _whole_free(gpu):
            before = self._idle[gpu.node]
            after = before + (1 if _whole_free(gpu) else -1)
            del self._nodes[bisect.bisect_left(self._nodes, (before, gpu.node))]
            bisect.insort(self._nodes, (after, gpu.node))
            self._idle[gpu.node] = after

    def update_host(self, host: HostState) -> None:
        """Replace (or add) the host of ``host.node``."""
        self.hosts[host.node] = host
        self._retight(host.node)

    def take(self, placement: Placement) -> None:
        """Add what ``placement`` grants to its GPUs' allocation."""
        self._add(placement, 1)

    def give(self, placement: Placement) -> None:
        """Remove what ``placement`` granted from its GPUs' allocation."""
        self._add(placement, -1)

    def _add(self, placement: Placement, sign: int) -> None:
        host = self.hosts.get(placement.node)
        if host is not None:
            self.hosts[placement.node] = host.taken(placement.cpus or 0.0, placement.host_memory or 0, sign)
            self._retight(placement.node)
        for uuid in placement.gpus:
            g = self.states[uuid]
            fraction = g.allocated_fraction + sign * placement.fraction
            self.update(dataclasses.replace(g, allocated_fraction=0.0 if abs(fraction) <= EPSILON else fraction,
                                            allocated_memory=g.allocated_memory + sign * placement.memory))

    def place(self, demand: Demand, *, explain: bool = True) -> Placement | Refusal:
        """``place(demand, self.all(), self.workload)``, found faster (module
        docstring). ``explain=False`` returns a refusal without its reasons
        and message when the index alone knows nothing fits (no scan of every
        GPU; for callers that only need the decision, like the queue)."""
        if self.hosts and (demand.cpus is not None or demand.host_memory is not None):
            candidates = None  # a named host ask may bind on any node: scan everything
        elif demand.gpu_count > 1:
            candidates = self._whole(demand)
            if candidates:
                return place(demand, candidates, self.workload, hosts=self.hosts, node_gpus=self._gpus_of)
        else:
            candidates = self._slice(demand)
            if candidates:
                return place(demand, candidates, self.workload, idle=self._idle, hosts=self.hosts,
                             node_gpus=self._gpus_of)
        if candidates is not None and not explain:
            return Refusal()
        return place(demand, self.all(), self.workload, hosts=self.hosts)

    def _fits(self, demand: Demand, gpu: GPUState) -> bool:
        return slice_misfit(demand, gpu, self.hosts.get(gpu.node)) is None

    def _retight(self, node: str) -> None:
        """Keep :attr:`_tight`: nodes whose host has less than its default share of their free GPUs."""
        host = self.hosts.get(node)
        if host is not None and node in self._free and not proportional(_DEFAULT, host, self._free[node]):
            self._tight.add(node)
        else:
            self._tight.discard(node)

    def _slice(self, demand: Demand) -> list[GPUState]:
        found: dict[str, GPUState] = {}
        keys, i = self._partial, bisect.bisect_left(self._partial, (demand.fraction - WINDOW,))
        while i < len(keys):
            free = keys[i][0]
            gpu = self.states[keys[i][3]]
            if gpu.node in self._tight or not self._fits(demand, gpu):
                i += 1
            else:
                found[gpu.uuid] = gpu
                # The rest of this class differs only by (node, index), and comes later.
                i = bisect.bisect_left(keys, (math.nextafter(free, math.inf),))
        nodes, j = self._nodes, bisect.bisect_left(self._nodes, (1, ""))
        while j < len(nodes):
            idle, node = nodes[j]
            gpu = None if node in self._tight else next(
                (g for g in map(self.states.get, self._node_gpus[node]) if _whole_free(g) and self._fits(demand, g)),
                None)
            if gpu is None:
                j += 1
            else:
                found[gpu.uuid] = gpu
                j = bisect.bisect_left(nodes, (idle + 1, ""))
        for node in self._tight:  # a growth of their own: place() weighs each fitting GPU
            found.update((u, self.states[u]) for u in self._node_gpus[node] if self._fits(demand, self.states[u]))
        return list(found.values())

    @property
    def _gpus_of(self) -> "_NodeGPUs":
        return _NodeGPUs(self)

    def _whole(self, demand: Demand) -> list[GPUState] | None:
        """The candidates (none: nothing fits), or None when only a scan of every GPU can tell."""
        if self._unusable or demand.model or demand.memory is not None:
            return None  # idle is not the same as eligible here: scan everything
        found, nodes = [], self._nodes
        j = bisect.bisect_left(nodes, (demand.gpu_count, ""))
        while j < len(nodes):
            idle, node = nodes[j]
            if node in self._tight or host_misfit(demand, self.hosts.get(node)) is not None:
                j += 1  # the next node of this class may be the first that fits
                continue
            found.extend(self.states[u] for u in self._node_gpus[node])
            j = bisect.bisect_left(nodes, (idle + 1, ""))
        for node in self._tight:
            if self._idle[node] >= demand.gpu_count and host_misfit(demand, self.hosts.get(node)) is None:
                found.extend(self.states[u] for u in self._node_gpus[node])
        return found


class _NodeGPUs:
    """Tight node -> its GPU states by index, read from the index (for
    ``place(node_gpus=...)``); other nodes are missing: a request of the
    default share cannot bind there (:meth:`PlacementIndex._retight`)."""

    def __init__(self, index: PlacementIndex) -> None:
        self.index = index

    def __getitem__(self, node: str) -> list[GPUState]:
        return [self.index.states[u] for u in self.index._node_gpus[node]]

    def get(self, node: str, default=()):
        return self[node] if node in self.index._tight else default


_DEFAULT = Demand()  # a request that takes the default host share (at host_share 1: the strictest)


def _usable_free(gpu: GPUState) -> float:
    return gpu.free_fraction if not _unusable(gpu) else -1.0


def _key(gpu: GPUState) -> tuple[float, str, int, str]:
    return (gpu.free_fraction, gpu.node, gpu.index, gpu.uuid)


def _unusable(gpu: GPUState) -> bool:
    return not (gpu.node_up and gpu.healthy) or gpu.node_degraded
