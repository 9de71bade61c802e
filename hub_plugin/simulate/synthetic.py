"""Generated traces, so ``gpupool simulate`` runs from the wheel without the public ones.

The two public traces (``--data``, docs/simulate.md) cannot ship: their
licences are unconfirmed. These generators give data of the same form,
seeded, shaped after the traces' published summary figures (not copied
from them):

- :func:`sensei_rows`: notebook cells, ``(job_id, num_gpu, submit_s,
  duration_s)`` sorted, as :func:`.workload.read_sensei` returns.
  Arrivals Poisson at ``per_hour`` (43/h, as the sensei month), sizes 1, 4
  and 8 GPUs (49 %, 20 %, 31 %), durations whole minutes, log-normal with a
  median of 5 min and p90 of 32 min, plus 2 % long cells (median 10 h).
- :func:`openb_tables`: a GPU cluster and its tasks as
  :func:`.workload.read_openb_tasks` returns: nodes of 8, 4 and 2
  GPUs with 96/64/32 cores and 384/256/128 GiB; tasks 13 % CPU-only, 44 %
  GPU slices (fractions 320, 470, 650, 810 milli and a few others), the rest
  1, 2, 4 or 8 whole GPUs, with CPU and memory asks that grow with them;
  lifetimes log-normal, median 9 min, heavy tail.
"""

from __future__ import annotations

import numpy as np

from .workload import OpenbNode, OpenbTasks

GIB_MIB = 1024


def sensei_rows(seed: int = 0, *, days: float = 30.0, per_hour: float = 43.0) -> list[tuple[int, int, float, float]]:
    """Notebook cell rows over ``days`` (module docstring); submit times in seconds, minute resolution."""
    rng = np.random.default_rng(seed)
    count = int(rng.poisson(per_hour * 24 * days))
    submit = np.sort(rng.uniform(0, days * 86400, size=count)) // 60 * 60
    gpus = rng.choice([1, 4, 8], size=count, p=[0.49, 0.20, 0.31])
    minutes = np.exp(rng.normal(np.log(5.0), np.log(32 / 5) / 1.2816, size=count))
    long = rng.random(count) < 0.02
    minutes[long] = np.exp(rng.normal(np.log(600.0), 0.8, size=int(long.sum())))
    duration = np.maximum(1, np.round(minutes)) * 60
    return [(i, int(g), float(s), float(d)) for i, (g, s, d) in enumerate(zip(gpus, submit, duration))]


def slice_millis(seed: int = 0, count: int = 4000) -> np.ndarray:
    """GPU asks of 1-GPU tasks in milli: 56 % whole GPUs, the rest common fractions."""
    rng = np.random.default_rng(seed + 7)
    fractions = rng.choice([810, 470, 320, 650, 250, 500, 100], size=count, p=[.3, .2, .15, .12, .1, .08, .05])
    return np.where(rng.random(count) < 0.56, 1000, fractions).astype(np.int64)


#: (GPUs, cores, GiB, how many) per node type of the generated cluster.
NODE_TYPES = ((8, 96, 384, 120), (4, 64, 256, 60), (2, 32, 128, 60))


def openb_tables(seed: int = 0, tasks: int = 6000) -> tuple[list[OpenbNode], OpenbTasks]:
    """A generated cluster and task list (module docstring)."""
    rng = np.random.default_rng(seed + 11)
    nodes = [OpenbNode(f"gen-{gpus}g-{i:03d}", gpus, "A10", 24 * 10**9, cores * 1000, gib * GIB_MIB)
             for gpus, cores, gib, count in NODE_TYPES for i in range(count)]
    kind = rng.choice(4, size=tasks, p=[0.13, 0.44, 0.33, 0.10])  # cpu-only, slice, 1 whole, several whole
    num = np.select([kind == 0, kind == 1, kind == 2], [0, 1, 1], rng.choice([2, 4, 8], size=tasks, p=[.5, .3, .2]))
    milli = np.where(kind == 1, slice_millis(seed, tasks), np.where(num > 0, 1000, 0))
    gpus = num * milli / 1000
    cpu = np.round(np.where(num == 0, rng.choice([4000, 12000, 32000], size=tasks),
                            gpus * rng.choice([3000, 8000, 12000], size=tasks) + 500), -2)
    mem = np.round(np.where(num == 0, rng.choice([8, 48, 96], size=tasks),
                            gpus * rng.choice([8, 32, 48], size=tasks) + 2) * GIB_MIB)
    life = np.maximum(30, np.exp(rng.normal(np.log(540.0), 2.0, size=tasks)))
    return nodes, OpenbTasks(cpu.astype(np.int64), mem.astype(np.int64), num.astype(np.int64),
                             milli.astype(np.int64), life)
