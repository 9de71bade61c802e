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
the service's placement uses too where host CPU or memory binds; the paper's
definition): the expected GPU capacity of a node that the next task, drawn
from the workload's mix of task types, could not use. For a task type that
does not fit the node at all (too few free cores, too little free memory,
or no GPU with room) every unallocated GPU of the node counts; for one that
fits, the GPUs too small for it (free share below its fraction, or any
partly used GPU for a whole-GPU task); for a CPU-only type, every
unallocated GPU (it can use none). The mix is every task type of the draw,
weighted by its count (exact integer sums, so equal growths tie exactly).

**Policies** (:data:`POLICIES`), ties to the lowest node (name order) and GPU,
as the paper's simulator breaks them:

- ``fgd``: the candidate (node, GPU) that increases the node's fragmentation
  least (Weng et al.'s FGD, with the draw's mix as the workload). As in the
  paper's simulator a task type is its CPU and GPU ask: memory is a
  constraint on where a task goes, not a term of the measure;
- ``fgd+memory``: the same with each type's memory ask in the measure too (a
  type that the node's free memory cannot hold counts all its free GPUs), as
  the service's rule does where host memory binds;
- ``fgd-k8s``: FGD scored as the paper's simulator scores it, a Kubernetes
  score plugin: ``int(100 x sigmoid(-growth / 1 GPU))``, the highest integer
  score wins, ties to the lowest node and GPU. The integer buckets (about 40
  milli-GPUs of growth wide near zero) make near-equal candidates ties, and
  ties go to the first node: a first-fit order among them. Shown to
  explain the gap to the paper's figures, not proposed as a rule;
- ``bestfit``: the paper's BestFit: the node left with the least free
  resources, the equally weighted sum of its free CPU and free GPU after
  placement, each in units of the largest node's (so absolute amounts, not
  shares of the node's own), then its tightest GPU;
- ``firstfit``: the first node (in name order) where the task fits, its first GPU that fits;
- ``random``: a random node where it fits (seeded), a random GPU on it that fits.

All four are measured alike (:class:`.openb.Checkpoints`): unallocated = 1 -
allocated GPU milli / capacity at each step of arrived GPU demand; a task
that fits nowhere fails and is not retried.
"""

from __future__ import annotations

import time

import numpy as np

from ..rules.fragmentation import FULL, TaskTypes, node_fragmentation, task_types  # noqa: F401 (re-exported)
from .openb import Checkpoints, FillResult
from .workload import OpenbNode, OpenbTasks

POLICIES = ("fgd", "fgd+memory", "fgd-k8s", "bestfit", "firstfit", "random")
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
        self.cpu_scale, self.gpu_scale = int(self.cpu_total.max()), int(self.gpu_total.max()) * FULL
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
        if policy.startswith("fgd"):
            return self._fgd(nodes, cpu, mem, num, milli, k8s=policy == "fgd-k8s")
        if policy == "firstfit":
            node = int(nodes[0])
        elif policy == "random":
            node = int(nodes[self.rng.integers(len(nodes))])
        else:
            node = self._bestfit_node(nodes, cpu, mem, num, milli)
        return node, self._gpus_on(node, num, milli, policy)

    def _bestfit_node(self, nodes, cpu, mem, num, milli) -> int:
        # Integers: free CPU x (largest node's GPU milli) + free GPU milli x (largest node's CPU), the
        # equal-weight sum of both in units of the largest node's, scaled so that ties are exact.
        gpu_left = np.maximum(self.gpu[nodes], 0).sum(axis=1) - num * milli
        score = (self.cpu[nodes] - cpu) * self.gpu_scale + gpu_left * self.cpu_scale
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

    def _fgd(self, nodes: np.ndarray, cpu: int, mem: int, num: int, milli: int,
             k8s: bool = False) -> tuple[int, np.ndarray]:
        """The candidate with the least fragmentation increase: for a slice every
        (node, GPU with room) pair, GPUs with the same free share counted once;
        ``k8s``: the first with the highest integer score instead (module docstring)."""
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
        growth = frag - self.frag[cand_node]
        if k8s:
            score = np.floor(100 / (1 + np.exp(growth / (self.types.weight.sum() * FULL))))
            best = int(np.argmax(score))
        else:
            best = int(np.argmin(growth))
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
    memory = tasks.memory if policy == "fgd+memory" else np.zeros_like(tasks.memory)  # fgd: the paper's types
    cluster = MultiCluster(nodes, task_types(tasks.cpu, memory, tasks.num, tasks.milli), seed)
    capacity = int(cluster.gpu_total.sum()) * FULL
    curve = Checkpoints(capacity, step)
    for cpu, mem, num, milli in zip(tasks.cpu.tolist(), tasks.memory.tolist(), tasks.num.tolist(),
                                    tasks.milli.tolist()):
        chosen = cluster.choose(policy, cpu, mem, num, milli)
        if chosen is not None:
            cluster.take(chosen[0], chosen[1], cpu, mem, milli)
        curve.tried_task(num * milli, chosen is not None)
    return curve.result(policy, len(tasks.num), time.perf_counter() - wall)
