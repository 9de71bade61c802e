"""The batch backlog of a notebook replay (``gpupool simulate --backlog``):
jobs drawn from a trace's GPU pods, queued as preemptible batch requests."""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from .pool import FULL
from .workload import zipf_weights


class BatchSource:
    """Batch jobs drawn (seeded, with replacement) from ``(milli, gpus,
    seconds)`` arrays, added whenever held plus queued demand falls under
    ``load`` x the pool (a backlog that never runs dry)."""

    def __init__(self, milli: np.ndarray, gpus: np.ndarray, seconds: np.ndarray, *, load: float = 1.2,
                 users: int = 100, seed: int = 0) -> None:
        self.milli, self.gpus, self.seconds, self.load = milli, gpus, seconds, load
        self.rng = np.random.default_rng(seed + 3)
        self.users, self.weights = users, zipf_weights(users, 1.0)
        self.picks: list[int] = []

    def draw(self) -> tuple[int, int, float, int]:
        """``(milli, gpus, seconds, user)`` of the next job."""
        if not self.picks:
            self.picks = self.rng.integers(len(self.milli), size=4096).tolist()[::-1]
        i = self.picks.pop()
        return int(self.milli[i]), int(self.gpus[i]), float(self.seconds[i]), int(self.rng.integers(self.users))

    def jobs(self, demand: Callable[[], float], capacity: int, slices: bool) -> Iterator[tuple[int, int, float, int]]:
        """The jobs to queue now: drawn while ``demand()`` (GPUs held plus queued, which
        queuing each job raises) is under ``load`` x ``capacity`` GPUs. Without ``slices``
        (the policy leases whole GPUs) a slice job asks for a whole GPU."""
        while demand() < self.load * capacity:
            milli, gpus, seconds, user = self.draw()
            yield (milli if slices or gpus > 1 else FULL), gpus, seconds, user
