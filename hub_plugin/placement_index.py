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
- A worker environment (``demand.env``) is a node filter (``place()`` rules
  out the GPUs of nodes lacking it). For each environment that only some
  nodes offer, the index keeps the same two sorted lists over just those
  nodes' GPUs, and searches them instead: the classes are then the same,
  and a request for a rare environment does not wade through the GPUs of
  nodes without it. An environment every node offers filters nothing and
  uses the main lists. :meth:`PlacementIndex.offers` says whether any GPU's
  node offers an environment at all.
- When nothing fits, ``place()`` runs on every GPU, since the refusal's
  tally of reasons covers every GPU (unless the caller asks for no
  explanation: the queue only needs to know).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import Counter
from typing import Iterable

from .scheduler import (DEFAULT_WORKLOAD, EPSILON, Demand, GPUState, Placement, Refusal, Workload, _whole_free,
                        place, slice_misfit)

#: How far below the asked fraction the search for partly taken GPUs starts (>> float noise).
WINDOW = 1e-8


class PlacementIndex:
    """GPU states by UUID; partly taken GPUs sorted by free fraction; nodes
    sorted by wholly free GPUs. ``workload`` is the scheduler's expected
    mix (assign :attr:`workload` to change it). Call :meth:`update` (or
    :meth:`take` / :meth:`give`) whenever a GPU's state changes."""

    def __init__(self, gpus: Iterable[GPUState], workload: Workload = DEFAULT_WORKLOAD) -> None:
        self.workload = workload
        self.states: dict[str, GPUState] = {}
        self._node_gpus: dict[str, list[str]] = {}
        self._idle: dict[str, int] = {}
        self._unusable = 0  # GPUs on lost nodes or unhealthy
        for gpu in gpus:
            self._unusable += _unusable(gpu)
            self.states[gpu.uuid] = gpu
            self._node_gpus.setdefault(gpu.node, []).append(gpu.uuid)
            self._idle[gpu.node] = self._idle.get(gpu.node, 0) + _whole_free(gpu)
        for uuids in self._node_gpus.values():
            uuids.sort(key=lambda u: self.states[u].index)
        self._partial = sorted(_key(g) for g in self.states.values() if not _whole_free(g))
        self._nodes = sorted((idle, node) for node, idle in self._idle.items())
        self._index_environments()

    def _index_environments(self) -> None:
        """Count the GPUs offering each environment; for those only some nodes
        offer, the lists of :meth:`_slice` and :meth:`_whole` over just their GPUs."""
        self._env_gpus = Counter(env for g in self.states.values() for env in g.environments)
        some = {env for env, count in self._env_gpus.items() if count < len(self.states)}
        self._env_partial = {env: sorted(_key(g) for g in self.states.values()
                                         if env in g.environments and not _whole_free(g)) for env in some}
        self._env_nodes = {env: sorted((self._idle[node], node) for node, uuids in self._node_gpus.items()
                                       if env in self.states[uuids[0]].environments) for env in some}

    def all(self) -> list[GPUState]:
        """Every GPU state, in no set order."""
        return list(self.states.values())

    def offers(self, env: str) -> bool:
        """Whether some GPU's node reports worker environment ``env`` usable (whatever its load or state)."""
        return self._env_gpus[env] > 0

    def environments(self) -> list[str]:
        """The worker environments some GPU's node reports usable, by name."""
        return sorted(name for name, count in self._env_gpus.items() if count > 0)

    def node_gpus(self, node: str) -> list[str]:
        """UUIDs of ``node``'s GPUs by index (empty for a node not indexed)."""
        return list(self._node_gpus.get(node, ()))

    def update(self, gpu: GPUState) -> None:
        """Replace the state of ``gpu.uuid`` (a GPU already indexed, on the same node)."""
        old = self.states[gpu.uuid]
        same_envs = gpu.environments is old.environments or gpu.environments == old.environments
        envs = [env for env in gpu.environments if env in self._env_partial] if same_envs else []
        partial = [self._partial, *(self._env_partial[env] for env in envs)]
        if not _whole_free(old):
            key = _key(old)
            for keys in partial:
                del keys[bisect.bisect_left(keys, key)]
        if not _whole_free(gpu):
            key = _key(gpu)
            for keys in partial:
                bisect.insort(keys, key)
        self.states[gpu.uuid] = gpu
        self._unusable += _unusable(gpu) - _unusable(old)
        if _whole_free(old) != _whole_free(gpu):
            before = self._idle[gpu.node]
            after = before + (1 if _whole_free(gpu) else -1)
            for nodes in (self._nodes, *(self._env_nodes[env] for env in envs)):
                del nodes[bisect.bisect_left(nodes, (before, gpu.node))]
                bisect.insort(nodes, (after, gpu.node))
            self._idle[gpu.node] = after
        if not same_envs:  # its agent registered again, offering others: rare, so count and sort again
            self._index_environments()

    def take(self, placement: Placement) -> None:
        """Add what ``placement`` grants to its GPUs' allocation."""
        self._add(placement, 1)

    def give(self, placement: Placement) -> None:
        """Remove what ``placement`` granted from its GPUs' allocation."""
        self._add(placement, -1)

    def _add(self, placement: Placement, sign: int) -> None:
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
        if demand.gpu_count > 1:
            candidates = self._whole(demand)
            if candidates:
                return place(demand, candidates, self.workload)
        else:
            candidates = self._slice(demand)
            if candidates:
                return place(demand, candidates, self.workload, idle=self._idle)
        if candidates is not None and not explain:
            return Refusal()
        return place(demand, self.all(), self.workload)

    def _slice(self, demand: Demand) -> list[GPUState]:
        found = []
        keys, nodes = self._lists(demand.env)
        i = bisect.bisect_left(keys, (demand.fraction - WINDOW,))
        while i < len(keys):
            free = keys[i][0]
            gpu = self.states[keys[i][3]]
            if slice_misfit(demand, gpu) is None:
                found.append(gpu)
                # The rest of this class differs only by (node, index), and comes later.
                i = bisect.bisect_left(keys, (math.nextafter(free, math.inf),))
            else:
                i += 1
        j = bisect.bisect_left(nodes, (1, ""))
        while j < len(nodes):
            idle, node = nodes[j]
            gpu = next((g for g in map(self.states.get, self._node_gpus[node])
                        if _whole_free(g) and slice_misfit(demand, g) is None), None)
            if gpu is None:
                j += 1
            else:
                found.append(gpu)
                j = bisect.bisect_left(nodes, (idle + 1, ""))
        return found

    def _whole(self, demand: Demand) -> list[GPUState] | None:
        """The candidates (none: nothing fits), or None when only a scan of every GPU can tell."""
        if self._unusable or demand.model or demand.memory is not None:
            return None  # idle is not the same as eligible here: scan everything
        found, nodes = [], self._lists(demand.env)[1]
        j = bisect.bisect_left(nodes, (demand.gpu_count, ""))
        while j < len(nodes):
            idle, node = nodes[j]
            found.extend(self.states[u] for u in self._node_gpus[node])
            j = bisect.bisect_left(nodes, (idle + 1, ""))
        return found

    def _lists(self, env: str | None) -> tuple[list, list]:
        """``(partly taken GPU keys, (idle, node) pairs)`` of the nodes offering ``env``
        (None, or one every node offers: all of them; one none offers: empty)."""
        if env is None or env not in self._env_partial:
            return (self._partial, self._nodes) if env is None or self._env_gpus[env] else ([], [])
        return self._env_partial[env], self._env_nodes[env]


def _key(gpu: GPUState) -> tuple[float, str, int, str]:
    return (gpu.free_fraction, gpu.node, gpu.index, gpu.uuid)


def _unusable(gpu: GPUState) -> bool:
    return not (gpu.node_up and gpu.healthy) or gpu.node_degraded
