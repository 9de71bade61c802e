"""Fill openb's cluster with its tasks and measure the GPUs left unallocated.

The experiment of Weng et al. ("Beware of Fragmentation", USENIX ATC '23,
section 6): tasks drawn (seeded, with replacement) from the openb pod list
arrive one after another and never leave; each is placed by a policy or, if
nothing fits, fails. As the arrived GPU demand grows past the cluster's
capacity, the share of GPU capacity left unallocated shows how much
fragmentation wastes.

Model: GPUs only. A task with ``num_gpu == 1`` needs ``gpu_milli``
thousandths of one GPU, one with ``num_gpu >= 2`` that many whole GPUs on one
node; CPU-only pods are left out, and CPU and memory of nodes and pods are
not modelled (the paper models them, so its numbers are not directly
comparable). GPU models are ignored (``gpu_spec`` is empty in every row).

Policies (:data:`OPENB_POLICIES`):

- ``gpupool``: :func:`gpupool.hub_plugin.rules.scheduler.place` (fragmentation-aware best fit, with
  the sampled tasks' mix as the expected workload, as Weng et al.'s FGD
  uses the target workload), through :class:`.pool.SimulatedPool`;
- ``firstfit``: the first GPU by (node, index) that fits; whole GPUs: the first node with enough free GPUs;
- ``bestfit``: the node left with the least free GPU capacity, then the
  tightest GPU on it (Weng et al.'s BestFit, on the GPU dimension);
- ``random``: a random node that fits (seeded), then a random GPU on it that fits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..rules.scheduler import Placement
from ..rules.workload import workload_of
from .pool import FULL, GPUSpec, SimulatedPool, demand_of
from .workload import OpenbNode

OPENB_POLICIES = ("gpupool", "firstfit", "bestfit", "random")


@dataclass(frozen=True)
class FillResult:
    """``arrived`` (arrived GPU demand / capacity) at each checkpoint, with the
    ``unallocated`` share of GPU capacity and the share of ``failed`` tasks there."""

    policy: str
    arrived: np.ndarray
    unallocated: np.ndarray
    failed: np.ndarray
    decisions: int
    seconds: float

    def at(self, load: float) -> float:
        """Unallocated share at the first checkpoint at or above ``load``."""
        return float(self.unallocated[np.searchsorted(self.arrived, load - 1e-9)])


class Checkpoints:
    """A fill's curve: each time arrived GPU demand passes another ``step`` of
    ``capacity`` (milli), the unallocated share and the share of failed tasks."""

    def __init__(self, capacity: int, step: float) -> None:
        self.capacity, self.step, self.mark = capacity, step, step
        self.points: list[float] = []
        self.unallocated: list[float] = []
        self.failed: list[float] = []
        self.arrived = self.allocated = self.tried = self.refused = 0

    def tried_task(self, want: int, placed: bool) -> None:
        """A task asking ``want`` milli was placed (or refused); record the checkpoints it passes."""
        self.tried += 1
        self.arrived += want
        self.allocated += want if placed else 0
        self.refused += not placed
        while self.arrived >= self.mark * self.capacity - 1e-6:
            self.points.append(round(self.mark, 6))
            self.unallocated.append(1 - self.allocated / self.capacity)
            self.failed.append(self.refused / self.tried)
            self.mark += self.step

    def result(self, policy: str, decisions: int, seconds: float) -> FillResult:
        return FillResult(policy, np.array(self.points), np.array(self.unallocated), np.array(self.failed),
                          decisions, seconds)


def openb_specs(nodes: list[OpenbNode]) -> list[GPUSpec]:
    """The cluster's GPUs, ordered by (node name, index) as ``place()`` breaks ties."""
    return [GPUSpec(n.name, i, n.model, n.memory) for n in sorted(nodes, key=lambda n: n.name)
            for i in range(n.gpus)]


def sample_tasks(num: np.ndarray, milli: np.ndarray, capacity: int, max_load: float,
                 seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Tasks drawn with replacement until their GPU demand reaches ``max_load x capacity``."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(len(num), size=int(2 * max_load * capacity / max(1e-9, np.mean(num * milli / FULL))) + 10)
    demand = np.cumsum(num[picks] * milli[picks] / FULL)
    last = int(np.searchsorted(demand, max_load * capacity)) + 1
    return num[picks[:last]], milli[picks[:last]]


class _ArrayPool:
    """Free thousandths per GPU as arrays, for the baseline policies."""

    def __init__(self, specs: list[GPUSpec], seed: int) -> None:
        self.free = np.full(len(specs), FULL, dtype=np.int64)
        names = [s.node for s in specs]
        self.node = np.cumsum([0] + [int(a != b) for a, b in zip(names, names[1:])])
        self.start = np.flatnonzero(np.r_[True, self.node[1:] != self.node[:-1]])
        self.rng = np.random.default_rng(seed + 1)

    def choose(self, policy: str, milli: int, gpus: int) -> np.ndarray | None:
        fits = self.free >= (FULL if gpus > 1 else milli)
        per_node = np.add.reduceat(fits.astype(np.int64), self.start)
        ok_nodes = np.flatnonzero(per_node >= gpus)
        if not len(ok_nodes):
            return None
        if policy == "firstfit":
            node = ok_nodes[0]
        elif policy == "random":
            node = ok_nodes[self.rng.integers(len(ok_nodes))]
        else:  # bestfit: least free capacity left on the node
            node_free = np.add.reduceat(self.free, self.start)[ok_nodes]
            node = ok_nodes[int(np.argmin(node_free))]
        lo = self.start[node]
        hi = self.start[node + 1] if node + 1 < len(self.start) else len(self.free)
        members = lo + np.flatnonzero(fits[lo:hi])
        if gpus > 1:
            return members[:gpus]
        if policy == "random":
            return members[[self.rng.integers(len(members))]]
        if policy == "bestfit":
            return members[[int(np.argmin(self.free[members]))]]
        return members[:1]


def fill(specs: list[GPUSpec], num: np.ndarray, milli: np.ndarray, policy: str, *,
         step: float = 0.05) -> FillResult:
    """Place tasks ``(num[i], milli[i])`` in order under ``policy``; no task leaves."""
    wall = time.perf_counter()
    capacity = len(specs) * FULL
    pool = None
    if policy == "gpupool":
        pool = SimulatedPool(specs, workload=workload_of(map(demand_of, milli.tolist(), num.tolist())))
    arrays = _ArrayPool(specs, seed=0) if pool is None else None
    curve = Checkpoints(capacity, step)
    for gpus, m in zip(num.tolist(), milli.tolist()):
        if pool is not None:
            placement = pool.place(m, gpus)
            placed = isinstance(placement, Placement)
            if placed:
                pool.take(placement)
        else:
            chosen = arrays.choose(policy, m, gpus)
            placed = chosen is not None
            if placed:
                arrays.free[chosen] -= m
        curve.tried_task(gpus * m, placed)
    return curve.result(policy, len(num), time.perf_counter() - wall)
