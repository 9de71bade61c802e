"""The simulated pool: GPU allocations, and placement by the real scheduler.

Every placement decision is :func:`.scheduler.place` itself, given
:class:`~.scheduler.GPUState` rows as the service builds them
(:func:`.capacity.gpu_states`), with the allocation summed from what the
simulated leases hold. Nothing here re-decides placement.

Speed: ``place()`` scans every GPU it is given (about 2 microseconds each),
so 10^5 decisions on openb's 6,212 GPUs would take minutes. The pool
therefore hands ``place()`` a candidate subset that provably yields the same
answer (``tests/test_simulator.py`` checks it against the full list):

- a slice: ``place()`` returns the fitting GPU with the least
  ``(free fraction left, node, index)``. GPUs with equal free capacity leave
  equal fractions, so the winner is the ``(node, index)``-least GPU of one of
  the free-capacity classes that fit. The candidates are exactly those:
  for each free capacity (in thousandths) that fits, its least GPU.
- N whole GPUs: ``place()`` returns the node with the least ``(free GPUs,
  name)`` among nodes with at least N free GPUs. The candidates are all GPUs
  of the name-least node of each free-GPU count that fits.

Allocations are kept in integer thousandths of a GPU, so sums are exact;
fractions reach ``place()`` as ``milli / 1000``. Usable memory is a multiple
of 1000 bytes and a slice's memory is its fraction's share, so memory never
refuses a slice whose fraction fits (the floor in ``int(f x memory)`` only
ever rounds down).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .scheduler import Demand, GPUState, Placement, Refusal, place

FULL = 1000  # milli in one GPU


@dataclass(frozen=True)
class GPUSpec:
    """A GPU of the simulated pool: node name, index on the node, model name, usable bytes."""

    node: str
    index: int
    name: str
    memory: int


def demand_of(milli: int, gpus: int) -> Demand:
    """The scheduler's demand for ``gpus`` whole GPUs, or one slice of ``milli`` thousandths."""
    if gpus > 1:
        return Demand(1.0, gpus)
    return Demand(milli / FULL, 1)


class Pool:
    """GPUs, what is allocated on each, and placement through ``place()``.

    ``full_scan=True`` gives ``place()`` every GPU (the service's behaviour,
    slow on big pools); the default gives it the candidate subset described
    in the module docstring.
    """

    def __init__(self, specs: list[GPUSpec], *, full_scan: bool = False) -> None:
        self.specs = specs
        self.full_scan = full_scan
        self.uuid_index = {}
        self.states: list[GPUState] = []
        self.milli = [0] * len(specs)
        self.memory = [0] * len(specs)
        self.node_gpus: dict[str, list[int]] = {}
        for i, spec in enumerate(specs):
            uuid = f"GPU-{spec.node}-{spec.index}"
            self.uuid_index[uuid] = i
            self.states.append(GPUState(uuid=uuid, node=spec.node, name=spec.name, index=spec.index,
                                        memory_total=spec.memory, memory_usable=spec.memory))
            self.node_gpus.setdefault(spec.node, []).append(i)
        self.capacity = len(specs)
        self.allocated_milli = 0
        # free milli -> heap of (node, index, gpu); counts are exact, heaps may hold stale entries
        self._free_count = [0] * (FULL + 1)
        self._free_heap: list[list] = [[] for _ in range(FULL + 1)]
        for i, spec in enumerate(specs):
            self._free_count[FULL] += 1
            self._free_heap[FULL].append((spec.node, spec.index, i))
        heapq.heapify(self._free_heap[FULL])
        # number of idle GPUs on a node -> heap of node names
        self._idle = {node: len(members) for node, members in self.node_gpus.items()}
        most = max((len(m) for m in self.node_gpus.values()), default=0)
        self._idle_count = [0] * (most + 1)
        self._idle_heap: list[list] = [[] for _ in range(most + 1)]
        for node, idle in self._idle.items():
            self._idle_count[idle] += 1
            self._idle_heap[idle].append(node)
        for heap in self._idle_heap:
            heapq.heapify(heap)

    # -- placement ----------------------------------------------------------------

    def place(self, milli: int, gpus: int) -> Placement | Refusal:
        """``place()``'s decision for ``gpus`` whole GPUs or one ``milli`` slice; changes nothing."""
        demand = demand_of(milli, gpus)
        if self.full_scan:
            return place(demand, self.states)
        return place(demand, self.candidates(milli, gpus))

    def candidates(self, milli: int, gpus: int) -> list[GPUState]:
        """The subset of GPUs on which ``place()`` decides as on all of them."""
        if gpus > 1:
            chosen = []
            for count in range(gpus, len(self._idle_count)):
                if self._idle_count[count]:
                    node = self._least(self._idle_heap[count], lambda n, c=count: self._idle[n] == c)
                    chosen.extend(self.states[i] for i in self.node_gpus[node])
            return chosen
        chosen = []
        for free in range(milli, FULL + 1):
            if self._free_count[free]:
                entry = self._least(self._free_heap[free], lambda e, f=free: FULL - self.milli[e[2]] == f)
                chosen.append(self.states[entry[2]])
        return chosen

    @staticmethod
    def _least(heap: list, valid) -> object:
        while not valid(heap[0]):
            heapq.heappop(heap)
        return heap[0]

    # -- allocation ---------------------------------------------------------------

    def take(self, placement: Placement) -> None:
        """Reserve what ``placement`` grants (the lease now holds capacity)."""
        milli = round(placement.fraction * FULL)
        for uuid in placement.gpus:
            self._change(self.uuid_index[uuid], milli, placement.memory)

    def give(self, placement: Placement) -> None:
        """Free what ``placement`` granted (the lease ended)."""
        milli = round(placement.fraction * FULL)
        for uuid in placement.gpus:
            self._change(self.uuid_index[uuid], -milli, -placement.memory)

    def _change(self, i: int, milli: int, memory: int) -> None:
        spec, node = self.specs[i], self.specs[i].node
        old, new = self.milli[i], self.milli[i] + milli
        if not 0 <= new <= FULL:
            raise AssertionError(f"GPU {spec.node}/{spec.index} would hold {new} milli")
        self.milli[i] = new
        self.memory[i] += memory
        self.allocated_milli += milli
        self._free_count[FULL - old] -= 1
        self._free_count[FULL - new] += 1
        heapq.heappush(self._free_heap[FULL - new], (spec.node, spec.index, i))
        if (old == 0) != (new == 0):
            before = self._idle[node]
            after = before + (1 if new == 0 else -1)
            self._idle[node] = after
            self._idle_count[before] -= 1
            self._idle_count[after] += 1
            heapq.heappush(self._idle_heap[after], node)
        state = self.states[i]
        self.states[i] = GPUState(uuid=state.uuid, node=state.node, name=state.name, index=state.index,
                                  memory_total=state.memory_total, memory_usable=state.memory_usable,
                                  allocated_fraction=new / FULL, allocated_memory=self.memory[i])


def uniform_pool(size: int, *, per_node: int = 8, name: str = "NVIDIA A100-SXM4-80GB",
                 memory: int = 80 * 10**9, full_scan: bool = False) -> Pool:
    """``size`` GPUs on nodes of ``per_node`` (the last node may have fewer), named ``node-000``..."""
    specs = [GPUSpec(f"node-{i // per_node:03d}", i % per_node, name, memory) for i in range(size)]
    return Pool(specs, full_scan=full_scan)
