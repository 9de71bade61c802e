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
  A worker environment (``demand.env``) is a node filter: every GPU of a
  node offers the same ones, so the winner is the first node of each idle
  count that offers it. Otherwise ``place()`` scans every GPU.
- Either way ``place()`` gives the GPUs of nodes lacking ``demand.env``
  reason ``NO_ENVIRONMENT``; the index skips them as it looks for each
  class's first fitting member. :meth:`PlacementIndex.offers` says whether
  any GPU's node offers an environment at all (kept as a count per name).
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
        self._env_gpus: Counter[str] = Counter()  # environment name -> GPUs whose node offers it
        for gpu in gpus:
            self._unusable += _unusable(gpu)
            self._env_gpus.update(gpu.environments)
            self.states[gpu.uuid] = gpu
            self._node_gpus.setdefault(gpu.node, []).append(gpu.uuid)
            self._idle[gpu.node] = self._idle.get(gpu.node, 0) + _whole_free(gpu)
        for uuids in self._node_gpus.values():
            uuids.sort(key=lambda u: self.states[u].index)
        self._partial = sorted(_key(g) for g in self.states.values() if not _whole_free(g))
        self._nodes = sorted((idle, node) for node, idle in self._idle.items())

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
        if not _whole_free(old):
            del self._partial[bisect.bisect_left(self._partial, _key(old))]
        if not _whole_free(gpu):
            bisect.insort(self._partial, _key(gpu))
        self.states[gpu.uuid] = gpu
        self._unusable += _unusable(gpu) - _unusable(old)
        if gpu.environments is not old.environments:
            self._env_gpus.subtract(old.environments)
            self._env_gpus.update(gpu.environments)
        if _whole_free(old) != _whole_free(gpu):
            before = self._idle[gpu.node]
            after = before + (1 if _whole_free(gpu) else -1)
            del self._nodes[bisect.bisect_left(self._nodes, (before, gpu.node))]
            bisect.insort(self._nodes, (after, gpu.node))
            self._idle[gpu.node] = after

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
        keys, i = self._partial, bisect.bisect_left(self._partial, (demand.fraction - WINDOW,))
        while i < len(keys):
            free = keys[i][0]
            gpu = self.states[keys[i][3]]
            if slice_misfit(demand, gpu) is None:
                found.append(gpu)
                # The rest of this class differs only by (node, index), and comes later.
                i = bisect.bisect_left(keys, (math.nextafter(free, math.inf),))
            else:
                i += 1
        nodes, j = self._nodes, bisect.bisect_left(self._nodes, (1, ""))
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
        found, nodes = [], self._nodes
        j = bisect.bisect_left(nodes, (demand.gpu_count, ""))
        while j < len(nodes):
            idle, node = nodes[j]
            gpus = [self.states[u] for u in self._node_gpus[node]]
            if demand.env is not None and demand.env not in gpus[0].environments:
                j += 1  # the next node of this idle count may offer it
                continue
            found.extend(gpus)
            j = bisect.bisect_left(nodes, (idle + 1, ""))
        return found


def _key(gpu: GPUState) -> tuple[float, str, int, str]:
    return (gpu.free_fraction, gpu.node, gpu.index, gpu.uuid)


def _unusable(gpu: GPUState) -> bool:
    return not (gpu.node_up and gpu.healthy) or gpu.node_degraded
