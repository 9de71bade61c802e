"""The fragmentation measure of Weng et al. ("Beware of Fragmentation",
USENIX ATC '23, section 4), extended to every dimension as the paper does
(section 6): one pure rule that the service's placement (:mod:`.scheduler`,
on nodes where host CPU or memory binds) and the openb simulator
(:mod:`gpupool.hub_plugin.simulate.multidim`, on every node) share. What it
counts, why the weights are integer counts, and the units: docs/placement.md,
"The fragmentation measure".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

#: One whole GPU, in the measure's unit (milli-GPUs).
FULL = 1000


@dataclass(frozen=True)
class TaskTypes:
    """The workload: per type its CPU, memory, GPU count, per-GPU milli and popularity (task counts, or
    shares summing to 1)."""

    cpu: np.ndarray
    memory: np.ndarray
    num: np.ndarray
    milli: np.ndarray
    weight: np.ndarray


def task_types(cpu, memory, num, milli, top: int | None = None) -> TaskTypes:
    """Every ``(cpu, memory, num, milli)`` type of a task list (or the ``top`` most frequent), weighted by
    how many tasks are of it (integer counts: exact sums)."""
    counts = Counter(zip(np.asarray(cpu).tolist(), np.asarray(memory).tolist(), np.asarray(num).tolist(),
                         np.asarray(milli).tolist())).most_common(top)
    arr = np.array([k for k, _ in counts], dtype=np.int64).reshape(-1, 4)
    weight = np.array([c for _, c in counts], dtype=np.int64)
    return TaskTypes(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], weight)


def node_fragmentation(cpu_free: np.ndarray, mem_free: np.ndarray, gpu_free: np.ndarray,
                       types: TaskTypes) -> np.ndarray:
    """Fragmentation (GPU milli) of each of C node states: ``cpu_free`` (C,)
    milli-cores, ``mem_free`` (C,) MiB, ``gpu_free`` (C, G) free milli per GPU
    (-1 pads nodes with fewer GPUs). Returns (C,) milli-GPUs times the weights' unit: integers with
    integer weights (module docstring)."""
    g = np.maximum(gpu_free, 0)
    unallocated = g.sum(axis=1)  # (C,)
    whole_free = (gpu_free >= FULL).sum(axis=1)
    best = gpu_free.max(axis=1)
    host_fits = (cpu_free[:, None] >= types.cpu[None, :]) & (mem_free[:, None] >= types.memory[None, :])  # (C, K)
    is_whole = types.num >= 2
    is_slice = types.num == 1
    gpu_fits = np.where(is_whole[None, :], whole_free[:, None] >= types.num[None, :],
                        np.where(is_slice[None, :], best[:, None] >= types.milli[None, :], True))
    fits = host_fits & gpu_fits
    # GPUs too small for each type: free below its fraction (slices), or partly used (whole GPUs).
    need = np.where(is_whole, FULL, types.milli)  # (K,)
    small = (g[:, :, None] * (gpu_free[:, :, None] < need[None, None, :])).sum(axis=1)  # (C, K)
    small = np.where(types.num[None, :] == 0, unallocated[:, None], small)  # CPU-only: no GPU is of use
    per_type = np.where(fits, small, unallocated[:, None])
    return per_type @ types.weight
