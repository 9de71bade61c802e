"""The batch backlog of a notebook replay (``gpupool simulate --backlog``):
jobs drawn from a trace's GPU pods, queued as preemptible batch requests."""

from __future__ import annotations

import numpy as np

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
