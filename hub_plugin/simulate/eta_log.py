"""A notebook replay's ETA check (``simulate_notebooks(with_eta=True)``): for
every interactive request that waits, the ETA (:func:`.estimates.eta`) and
the queue's old estimate (:func:`gpupool.hub_plugin.rules.queue.estimate`)
when it was queued, next to the wait it then had (``bench/REPORT.md``).

What the ETA is given is what the service would know: the recent lengths of
cells per class and of leases, and when each held lease is expected to free
its capacity (:meth:`EtaLog.expected_end`)."""

from __future__ import annotations

import math
import statistics
from collections import deque

from ..rules.priority import BATCH, INTERACTIVE
from ..rules.queue import estimate
from .estimates import eta
from .policies import NotebookPolicy
from .pool import FULL, Pool
from .sweep import SWEEP_S

#: How many recent cell and lease lengths the estimates learn from.
HISTORY = 200


class EtaLog:
    """The history the estimates read, and ``errors``: ``(eta, old estimate,
    wait)`` seconds per interactive request that waited (None: no estimate)."""

    def __init__(self, policy: NotebookPolicy) -> None:
        self.policy = policy
        self.cells: dict[str, deque] = {INTERACTIVE: deque(maxlen=HISTORY), BATCH: deque(maxlen=HISTORY)}
        self.holds: deque = deque(maxlen=HISTORY)
        self.pending: dict[int, tuple[float | None, float | None]] = {}  # waiting cell -> (eta, old)
        self.errors: list[tuple[float | None, float | None, float]] = []

    def record(self, cell: int, predicted: float | None, place: int, holding: int) -> None:
        """Keep ``predicted`` and the old estimate for waiting ``cell`` (at queue
        ``place``, with ``holding`` leases active) until it starts."""
        self.pending[cell] = (predicted, estimate(place, list(self.holds), holding))

    def waiting(self, cell: int, milli: int, gpus: int, ahead: list[tuple[int, int]], leased: list[tuple],
                pool: Pool, now: float) -> None:
        """Record the ETA (:func:`.estimates.eta`) and the old estimate of ``cell``, which asks for a
        ``milli`` slice or ``gpus`` whole GPUs behind ``ahead`` (``(milli, gpus)`` of the interactive
        requests queued before it) while ``leased`` hold capacity (``(class, cell started at, idle
        since or None, GPU uuids, milli)`` per active lease) in ``pool``."""
        frees = [(self.expected_end(klass, run_start, idle_since, now), [pool.uuid_index[u] for u in uuids], held)
                 for klass, run_start, idle_since, uuids, held in leased]
        predicted = eta(milli, gpus, ahead, [FULL - m for m in pool.milli], pool.node_of, frees, now)
        self.record(cell, predicted, len(ahead) + 1, len(leased))

    def started(self, cell: int, wait: float) -> None:
        """``cell`` started after waiting ``wait`` seconds."""
        if cell in self.pending:
            self.errors.append((*self.pending.pop(cell), wait))

    def expected_end(self, klass: str, run_start: float, idle_since: float | None, now: float) -> float:
        """When a lease of ``klass`` whose cell started at ``run_start`` (idle
        since ``idle_since``, None: running) is expected to free its capacity."""
        if klass == BATCH:
            history = self.cells[BATCH]
            return max(now, run_start + (statistics.median(history) if history else 0.0))
        timeout, pressure = self.policy.idle_timeout or 0.0, self.policy.pressure_grace
        after = min(timeout, pressure) if pressure is not None else timeout
        if idle_since is not None:
            return max(now, math.ceil((idle_since + after) / SWEEP_S) * SWEEP_S)
        history = self.cells[INTERACTIVE]
        ends = max(now, run_start + (statistics.median(history) if history else 0.0))
        return math.ceil((ends + after) / SWEEP_S) * SWEEP_S
