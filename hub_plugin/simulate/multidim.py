"""openb with CPU and memory: fill a cluster whose nodes have cores and RAM,
and place by the fragmentation measure extended to every dimension.

The experiment of Weng et al. ("Beware of Fragmentation", USENIX ATC '23,
section 6) in the paper's own setting: every pod (CPU-only ones too) asks
for CPU (milli-cores), host memory (MiB) and GPUs; a node runs it only if
all three fit. Tasks drawn (seeded, with replacement) arrive one after
another and never leave; unallocated GPU share is measured as the arrived
GPU demand grows past capacity.

**Fragmentation, every dimension**
(:func:`gpupool.hub_plugin.rules.fragmentation.node_fragmentation`, the rule
the service's placement uses too; the paper's definition): the expected GPU
capacity of a node that the next task, drawn from the workload's mix of task types, could not use. For a task type that
does not fit the node at all (too few free cores, too little free memory,
or no GPU with room) every unallocated GPU of the node counts; for one that
fits, the GPUs too small for it (free share below its fraction, or any
partly used GPU for a whole-GPU task). CPU-only types count nothing when
they fit (every placement of a given task changes their term by the same
amount, so their definition does not change a decision).

**Policies** (:data:`POLICIES`):

- ``fgd``: the candidate (node, GPU) that increases the node's fragmentation
  least (Weng et al.'s FGD, with the sampled tasks' mix as the workload);
  ties to the lowest node and GPU. This is the rule proposed for the
  service's multi-dimension placement too (``scheduler.place`` calls the
  same :func:`gpupool.hub_plugin.rules.fragmentation.node_fragmentation` on nodes where host CPU or
  memory binds);
- ``bestfit``: the node left with the least free resources, the sum of its
  free GPU, CPU and memory shares after placement, then its tightest GPU;
- ``firstfit``: the first node (in name order) where the task fits, its first GPU that fits;
- ``random``: a random node where it fits (seeded), a random GPU on it that fits.
"""

from __future__ import annotations

import time

import numpy as np

from ..rules.fragmentation import FULL, TaskTypes, node_fragmentation, task_types  # noqa: F401 (re-exported)
from .openb import Checkpoints, FillResult
from .workload import OpenbNode, OpenbTasks

POLICIES = ("fgd", "bestfit", "firstfit", "random")
class MultiCluster:
    """Free CPU, memory and GPU share per node, and the four policies' choices."""

    def __init__(self, nodes: list[OpenbNode], types: TaskTypes, seed: int = 0) -> None:
        nodes = sorted(nodes, key=lambda n: n.name)
        width = max(n.gpus for n in nodes)
        self.cpu_total = np.array([n.cpu_milli for n in nodes], dtype=np.int64)
        self.mem_total = np.array([n.memory_mib for n in nodes], dtype=np.int64)
        self.gpu_total = np.array([n.gpus for n in nodes], dtype=np.int64)
        self.cpu = self.cpu_total.copy()
        self.mem = self.mem_total.copy()
        self.gpu = np.full((len(nodes), width), -1, dtype=np.int64)
        for i, n in enumerate(nodes):
            self.gpu[i, :n.gpus] = FULL
        self.types = types
        self.rng = np.random.default_rng(seed + 1)
        self.frag = node_fragmentation(self.cpu, self.mem, self.gpu, types)

    def fitting(self, cpu: int, mem: int, num: int, milli: int) -> np.ndarray:
        """Indexes of the nodes where the task fits in every dimension."""
        ok = (self.cpu >= cpu) & (self.mem >= mem)
        if num >= 2:
            ok &= (self.gpu >= FULL).sum(axis=1) >= num
        elif num == 1:
            ok &= self.gpu.max(axis=1) >= milli
        return np.flatnonzero(ok)

    def choose(self, policy: str, cpu: int, mem: int, num: int, milli: int) -> tuple[int, np.ndarray] | None:
        """``(node, GPU columns)`` for the task under ``policy``, or None when no node fits."""
        nodes = self.fitting(cpu, mem, num, milli)
        if not len(nodes):
            return None
        if policy == "fgd":
            return self._fgd(nodes, cpu, mem, num, milli)
        if policy == "firstfit":
            node = int(nodes[0])
        elif policy == "random":
            node = int(nodes[self.rng.integers(len(nodes))])
        else:
            node = self._bestfit_node(nodes, cpu, mem, num, milli)
        return node, self._gpus_on(node, num, milli, policy)

    def _bestfit_node(self, nodes, cpu, mem, num, milli) -> int:
        gpu_left = (np.maximum(self.gpu[nodes], 0).sum(axis=1) - num * milli) / (self.gpu_total[nodes] * FULL)
        score = (gpu_left + (self.cpu[nodes] - cpu) / self.cpu_total[nodes]
                 + (self.mem[nodes] - mem) / self.mem_total[nodes])
        return int(nodes[int(np.argmin(score))])

    def _gpus_on(self, node: int, num: int, milli: int, policy: str) -> np.ndarray:
        free = self.gpu[node]
        if num == 0:
            return np.zeros(0, dtype=np.int64)
        if num >= 2:
            return np.flatnonzero(free >= FULL)[:num]
        fits = np.flatnonzero(free >= milli)
        if policy == "random":
            return fits[[self.rng.integers(len(fits))]]
        if policy == "bestfit":
            return fits[[int(np.argmin(free[fits]))]]
        return fits[:1]

    def _fgd(self, nodes: np.ndarray, cpu: int, mem: int, num: int, milli: int) -> tuple[int, np.ndarray]:
        """The candidate with the least fragmentation increase: for a slice every
        (node, GPU with room) pair, GPUs with the same free share counted once."""
        if num == 1 and milli < FULL:
            free = self.gpu[nodes]  # (N, G)
            same_before = np.tril(free[:, :, None] == free[:, None, :], k=-1).any(axis=2)  # an earlier twin
            rows, cols = np.nonzero((free >= milli) & ~same_before)
            cand_node = nodes[rows]
            after = free[rows].copy()
            after[np.arange(len(rows)), cols] -= milli
        else:
            cand_node = nodes
            after = self.gpu[nodes].copy()
            if num >= 1:
                for row, n in enumerate(nodes.tolist()):
                    after[row, np.flatnonzero(self.gpu[n] >= FULL)[:num]] = 0
        frag = node_fragmentation(self.cpu[cand_node] - cpu, self.mem[cand_node] - mem, after, self.types)
        best = int(np.argmin(frag - self.frag[cand_node]))
        node = int(cand_node[best])
        gpus = np.flatnonzero(after[best] != self.gpu[node])
        return node, gpus

    def take(self, node: int, gpus: np.ndarray, cpu: int, mem: int, milli: int) -> None:
        self.cpu[node] -= cpu
        self.mem[node] -= mem
        self.gpu[node, gpus] -= milli
        self.frag[node] = node_fragmentation(self.cpu[[node]], self.mem[[node]], self.gpu[[node]], self.types)[0]


def sample(tasks: OpenbTasks, gpus: int, max_load: float, seed: int) -> OpenbTasks:
    """Tasks (CPU-only ones too) drawn with replacement until their GPU demand is ``max_load x gpus``."""
    rng = np.random.default_rng(seed)
    demand_each = tasks.num * tasks.milli / FULL
    picks = rng.integers(len(tasks.num), size=int(3 * max_load * gpus / max(1e-9, demand_each.mean())) + 10)
    last = int(np.searchsorted(np.cumsum(demand_each[picks]), max_load * gpus)) + 1
    p = picks[:last]
    return OpenbTasks(tasks.cpu[p], tasks.memory[p], tasks.num[p], tasks.milli[p], tasks.lifetime[p])


def fill(nodes: list[OpenbNode], tasks: OpenbTasks, policy: str, *, step: float = 0.05,
         seed: int = 0) -> FillResult:
    """Place ``tasks`` in order under ``policy``; no task leaves; checkpoints every ``step`` of GPU capacity."""
    wall = time.perf_counter()
    cluster = MultiCluster(nodes, task_types(tasks.cpu, tasks.memory, tasks.num, tasks.milli), seed)
    capacity = int(cluster.gpu_total.sum()) * FULL
    curve = Checkpoints(capacity, step)
    for cpu, mem, num, milli in zip(tasks.cpu.tolist(), tasks.memory.tolist(), tasks.num.tolist(),
                                    tasks.milli.tolist()):
        chosen = cluster.choose(policy, cpu, mem, num, milli)
        if chosen is not None:
            cluster.take(chosen[0], chosen[1], cpu, mem, milli)
        curve.tried_task(num * milli, chosen is not None)
    return curve.result(policy, len(tasks.num), time.perf_counter() - wall)
