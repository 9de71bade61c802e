"""The simulated pool: GPU allocations, and placement by the real scheduler.

Every placement decision is :func:`gpupool.hub_plugin.rules.scheduler.place`'s, given
:class:`~gpupool.hub_plugin.rules.scheduler.GPUState` rows as the service builds them
(:func:`gpupool.hub_plugin.capacity.gpu_states`), with the allocation summed from what the
simulated leases hold. Nothing here re-decides placement: the pool keeps a
:class:`gpupool.hub_plugin.rules.placement_index.PlacementIndex`, which returns ``place()``'s answer
on all GPUs without scanning them (``full_scan=True`` calls ``place()`` on
every GPU, as a check; ``tests/rules/test_simulator.py`` compares the two).

Allocations are kept in integer thousandths of a GPU, so sums are exact;
fractions reach ``place()`` as ``milli / 1000``. Usable memory is a multiple
of 1000 bytes and a slice's memory is its fraction's share, so memory never
refuses a slice whose fraction fits (the floor in ``int(f x memory)`` only
ever rounds down).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..rules import resume
from ..rules.placement_index import PlacementIndex
from ..rules.scheduler import Demand, GPUState, Placement, Refusal, place
from ..rules.workload import DEFAULT_WORKLOAD, Workload

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


class SimulatedPool:
    """GPUs, what is allocated on each, and placement through ``place()``.

    ``workload`` is the scheduler's expected mix of requests (the
    simulators pass the trace's own); ``full_scan=True`` gives ``place()``
    every GPU instead of asking the index (slow on big pools).
    """

    def __init__(self, specs: list[GPUSpec], *, full_scan: bool = False,
                 workload: Workload = DEFAULT_WORKLOAD) -> None:
        self.specs = specs
        names: dict[str, int] = {}
        #: Per GPU, its node's number; per node name, its GPUs.
        self.node_of = [names.setdefault(spec.node, len(names)) for spec in specs]
        self.node_gpus: dict[str, list[int]] = {}
        for g, spec in enumerate(specs):
            self.node_gpus.setdefault(spec.node, []).append(g)
        self.per_node = max((len(gpus) for gpus in self.node_gpus.values()), default=1)
        #: Nodes with nothing allocated.
        self.idle_nodes = len(self.node_gpus)
        self.full_scan = full_scan
        self.uuid_index = {f"GPU-{spec.node}-{spec.index}": i for i, spec in enumerate(specs)}
        self.milli = [0] * len(specs)
        self.memory = [0] * len(specs)
        #: Per GPU, what parked leases claim there for their resume (thousandths, bytes).
        self.claimed_milli = [0] * len(specs)
        self.claimed_memory = [0] * len(specs)
        self.capacity = len(specs)
        self.allocated_milli = 0
        #: Nodes where something was freed since the replay last offered them to parked leases.
        self.freed: set[str] = set()
        self.index = PlacementIndex((GPUState(uuid=uuid, node=specs[i].node, name=specs[i].name,
                                              index=specs[i].index, memory_total=specs[i].memory,
                                              memory_usable=specs[i].memory)
                                     for uuid, i in self.uuid_index.items()), workload)

    def place(self, milli: int, gpus: int) -> Placement | Refusal:
        """``place()``'s decision for ``gpus`` whole GPUs or one ``milli`` slice; changes
        nothing. A refusal comes without its reasons (the replays only count refusals)."""
        demand = demand_of(milli, gpus)
        if self.full_scan:
            return place(demand, self.index.all(), self.index.workload)
        return self.index.place(demand, explain=False)

    def place_off(self, milli: int, gpus: int, nodes: set[str]) -> Placement | Refusal:
        """:meth:`place` on every node but ``nodes`` (held for a person)."""
        return self.index.place_off(demand_of(milli, gpus), nodes)

    def place_resume(self, held: Placement, remap: bool = True) -> Placement | Refusal:
        """Where a lease parked off ``held`` resumes now: the service's rule
        (:func:`gpupool.hub_plugin.rules.resume.place`: its own node only, its
        GPUs first, else, with ``remap``, another GPU of the same model there)."""
        if not self.may_fit(held.node, round(held.fraction * FULL), len(held.gpus)):
            return Refusal({}, f"{held.node} has no room for it")  # a shortcut: the rule would refuse too
        first = self.specs[self.uuid_index[held.gpus[0]]]
        ask = resume.Resume(held.node, held.gpus, first.name, held.fraction, len(held.gpus), held.memory, remap=remap)
        node_uuids = [f"GPU-{held.node}-{self.specs[g].index}" for g in self.node_gpus[held.node]]
        return resume.place(ask, self.index.states, node_uuids, None, self.index.workload)

    def may_fit(self, node: str, milli: int, gpus: int) -> bool:
        """Whether ``node`` has GPUs with room for ``gpus`` whole GPUs or one ``milli`` slice
        (a necessary condition only: ``place()`` decides)."""
        room = [FULL - self.milli[g] for g in self.node_gpus[node]]
        if gpus > 1:
            return room.count(FULL) >= gpus
        return max(room) >= milli

    def whole_free(self, leaving: dict[str, int] | None = None) -> dict[str, float]:
        """Node -> GPUs with nothing allocated on it, or nothing but what ``leaving`` (GPU uuid ->
        thousandths of parks whose state is still moving off it) holds there: on its way back, as
        the service's :func:`gpupool.hub_plugin.rules.clearing.whole_free` counts it (nodes with
        none left out)."""
        leaving = leaving or {}
        free: dict[str, float] = {}
        for g, milli in enumerate(self.milli):
            if not milli or milli == leaving.get(f"GPU-{self.specs[g].node}-{self.specs[g].index}", 0):
                node = self.specs[g].node
                free[node] = free.get(node, 0.0) + 1.0
        return free

    def node_idle(self, node: str) -> bool:
        """Nothing is allocated on ``node``."""
        return not any(self.milli[g] for g in self.node_gpus[node])

    def take(self, placement: Placement) -> None:
        """Reserve what ``placement`` grants (the lease now holds capacity)."""
        self.idle_nodes -= self.node_idle(placement.node)
        milli = round(placement.fraction * FULL)
        for uuid in placement.gpus:
            self._change(self.uuid_index[uuid], milli, placement.memory)

    def give(self, placement: Placement) -> None:
        """Free what ``placement`` granted (the lease ended)."""
        milli = round(placement.fraction * FULL)
        for uuid in placement.gpus:
            self._change(self.uuid_index[uuid], -milli, -placement.memory)
        self.idle_nodes += self.node_idle(placement.node)
        self.freed.add(placement.node)

    def claim(self, placement: Placement, sign: int) -> None:
        """A parked lease's claim on the GPUs of ``placement`` (``sign`` 1 at its park, -1 when it
        resumes or ends), as the service counts it (``GPUState.parked_fraction``): ``place()`` keeps
        it free while other room fits."""
        milli = round(placement.fraction * FULL)
        for uuid in placement.gpus:
            i = self.uuid_index[uuid]
            self.claimed_milli[i] += sign * milli
            self.claimed_memory[i] += sign * placement.memory
            self.index.update(dataclasses.replace(self.index.states[uuid],
                                                  parked_fraction=self.claimed_milli[i] / FULL,
                                                  parked_memory=self.claimed_memory[i]))

    def _change(self, i: int, milli: int, memory: int) -> None:
        spec = self.specs[i]
        new = self.milli[i] + milli
        if not 0 <= new <= FULL:
            raise AssertionError(f"GPU {spec.node}/{spec.index} would hold {new} milli")
        self.milli[i] = new
        self.memory[i] += memory
        self.allocated_milli += milli
        uuid = f"GPU-{spec.node}-{spec.index}"
        self.index.update(dataclasses.replace(self.index.states[uuid], allocated_fraction=new / FULL,
                                              allocated_memory=self.memory[i]))


def uniform_pool(size: int, *, per_node: int = 8, name: str = "NVIDIA A100-SXM4-80GB",
                 memory: int = 80 * 10**9, full_scan: bool = False,
                 workload: Workload = DEFAULT_WORKLOAD) -> SimulatedPool:
    """``size`` GPUs on nodes of ``per_node`` (the last node may have fewer), named ``node-000``..."""
    specs = [GPUSpec(f"node-{i // per_node:03d}", i % per_node, name, memory) for i in range(size)]
    return SimulatedPool(specs, full_scan=full_scan, workload=workload)
