"""An index over GPU states that gives :func:`.scheduler.place`'s answer
without scanning every GPU. Pure, in memory; for big pools (the simulator,
bench/scheduler_bench.py). ``tests/test_scheduler.py::test_placement_index_gives_the_same_answer_under_churn`` checks it
against ``place()`` on random pools under churn.

Why it is the same answer:

- A slice: ``place()`` picks, among the GPUs that fit, the least
  ``(round(free - f, 9), node, index)``. GPUs are kept sorted by ``(free
  fraction, node, index)``. A GPU that fits has ``free >= f - 1e-9``, so the
  search starts at ``f - WINDOW``. GPUs with the same free fraction leave the
  same remainder, so within such a class only the first that fits (least
  node, index) can win. A GPU whose free fraction is more than ``WINDOW``
  above the first fitting one leaves a remainder larger by more than the
  rounding, so it cannot win either. ``place()`` is then called on those
  class winners: it decides by its own rule.
- N whole GPUs: ``place()`` picks the node with the least ``(eligible idle
  GPUs, name)`` among nodes with at least N. When every GPU is usable (node
  up, healthy) and the request names no model and no memory, every idle GPU
  is eligible, so that node is the first of the nodes kept sorted by ``(idle
  GPUs, name)`` with at least N; ``place()`` is then called on its GPUs.
  Otherwise ``place()`` scans every GPU.
- When nothing fits, ``place()`` runs on every GPU, since the refusal's
  tally of reasons covers every GPU.
"""

from __future__ import annotations

import bisect
import math
from typing import Iterable

from .scheduler import EPSILON, Demand, GPUState, Placement, Refusal, _ineligible, _slice_memory, place

#: Width of the free-fraction window searched past the first fit (>> the 1e-9 rounding of ``place()``).
WINDOW = 1e-8


class PlacementIndex:
    """GPU states by UUID, sorted by free fraction, and nodes by idle GPUs.
    Call :meth:`update` with a GPU's new state whenever its allocation changes."""

    def __init__(self, gpus: Iterable[GPUState]) -> None:
        self.states: dict[str, GPUState] = {}
        self._keys: list[tuple[float, str, int, str]] = []
        self._node_gpus: dict[str, list[str]] = {}
        self._idle: dict[str, int] = {}
        self._nodes: list[tuple[int, str]] = []
        self._unusable = 0  # GPUs on lost nodes or unhealthy
        for gpu in gpus:
            self._unusable += not (gpu.node_up and gpu.healthy)
            self.states[gpu.uuid] = gpu
            self._node_gpus.setdefault(gpu.node, []).append(gpu.uuid)
            self._idle[gpu.node] = self._idle.get(gpu.node, 0) + gpu.is_idle
        self._keys = sorted(_key(g) for g in self.states.values())
        self._nodes = sorted((idle, node) for node, idle in self._idle.items())

    def all(self) -> list[GPUState]:
        return list(self.states.values())

    def update(self, gpu: GPUState) -> None:
        """Replace the state of ``gpu.uuid`` (same node)."""
        old = self.states[gpu.uuid]
        del self._keys[bisect.bisect_left(self._keys, _key(old))]
        bisect.insort(self._keys, _key(gpu))
        self.states[gpu.uuid] = gpu
        self._unusable += (not (gpu.node_up and gpu.healthy)) - (not (old.node_up and old.healthy))
        if old.is_idle != gpu.is_idle:
            before = self._idle[gpu.node]
            after = before + (1 if gpu.is_idle else -1)
            del self._nodes[bisect.bisect_left(self._nodes, (before, gpu.node))]
            bisect.insort(self._nodes, (after, gpu.node))
            self._idle[gpu.node] = after

    def place(self, demand: Demand) -> Placement | Refusal:
        """``place(demand, self.all())``, found faster (module docstring)."""
        candidates = self._whole(demand) if demand.gpu_count > 1 else self._slice(demand)
        return place(demand, candidates if candidates else self.all())

    def _slice(self, demand: Demand) -> list[GPUState]:
        keys, found, best = self._keys, [], None
        i = bisect.bisect_left(keys, (demand.fraction - WINDOW,))
        while i < len(keys):
            free = keys[i][0]
            if best is not None and free > best + WINDOW:
                break
            gpu = self.states[keys[i][3]]
            if _fits(demand, gpu):
                best = free if best is None else best
                found.append(gpu)
                # The rest of this class leaves the same remainder and comes later by (node, index).
                i = bisect.bisect_left(keys, (math.nextafter(free, math.inf),))
            else:
                i += 1
        return found

    def _whole(self, demand: Demand) -> list[GPUState]:
        if self._unusable or demand.model or demand.memory is not None:
            return []  # idle is not the same as eligible here: scan everything
        i = bisect.bisect_left(self._nodes, (demand.gpu_count, ""))
        return [] if i == len(self._nodes) else [self.states[u] for u in self._node_gpus[self._nodes[i][1]]]


def _key(gpu: GPUState) -> tuple[float, str, int, str]:
    return (gpu.free_fraction, gpu.node, gpu.index, gpu.uuid)


def _fits(demand: Demand, gpu: GPUState) -> bool:
    """``place()``'s test for a slice on one GPU."""
    return (_ineligible(demand, gpu) is None and gpu.allocated_fraction + demand.fraction <= 1.0 + EPSILON
            and _slice_memory(demand, gpu) <= gpu.free_memory)
