"""A notebook replay's ETA check (``simulate_notebooks(with_eta=True)``): for
every interactive request that waits, the service's ETA
(:func:`gpupool.hub_plugin.rules.eta.eta_seconds`) and the queue's old
estimate (:func:`gpupool.hub_plugin.rules.queue.estimate`) when it was
queued, next to the wait it then had (``bench/REPORT.md``).

What the ETA is given is what the service would know: the pool's free room,
the recent lengths of cells per class (and of leases, for the old estimate),
and each held lease as the service sees it (:meth:`EtaLog.held`)."""

from __future__ import annotations

import math
from collections import deque

from gpupool.leaseclasses import default as default_class, lease_class, names as class_names

from ..rules.eta import Room, eta_seconds, typical_lengths
from ..rules.priority import Held
from ..rules.queue import estimate
from .policies import NotebookPolicy
from .pool import FULL, SimulatedPool
from .sweep import SWEEP_S, at

#: How many recent cell and lease lengths the estimates learn from.
HISTORY = 200


class EtaLog:
    """The history the estimates read, and ``errors``: ``(eta, old estimate,
    wait)`` seconds per interactive request that waited (None: no estimate)."""

    def __init__(self, policy: NotebookPolicy) -> None:
        self.policy = policy
        self.cells: dict[str, deque] = {name: deque(maxlen=HISTORY) for name in class_names()}
        self.holds: deque = deque(maxlen=HISTORY)
        self.pending: dict[int, tuple[float | None, float | None]] = {}  # waiting cell -> (eta, old)
        self.errors: list[tuple[float | None, float | None, float]] = []

    def record(self, cell: int, predicted: float | None, place: int, holding: int) -> None:
        """Keep ``predicted`` and the old estimate for waiting ``cell`` (at queue
        ``place``, with ``holding`` leases active) until it starts."""
        self.pending[cell] = (predicted, estimate(place, list(self.holds), holding))

    def waiting(self, cell: int, milli: int, gpus: int, ahead: list[tuple[int, int]], leased: list[tuple],
                pool: SimulatedPool, now: float) -> None:
        """Record the ETA and the old estimate of ``cell``, which asks for a ``milli`` slice or
        ``gpus`` whole GPUs behind ``ahead`` (``(milli, gpus)`` of the interactive requests queued
        before it) while ``leased`` hold capacity (``(class, cell started at, idle since or None,
        GPU uuids, milli)`` per active lease) in ``pool``."""
        room = Room(tuple((FULL - m) / FULL for m in pool.milli), tuple(pool.node_of), tuple(pool.uuid_index))
        holding = [self.held(*lease) for lease in leased]
        typical = typical_lengths((klass, seconds) for klass, cells in self.cells.items() for seconds in cells)
        person = default_class().name  # the requests the ETA is shown for: a person at a notebook
        asks = [(m / FULL, g, person) for m, g in ahead] + [(milli / FULL, gpus, person)]
        predicted = eta_seconds(asks, room, holding, typical, at(now), self.policy.pressure_grace)[-1]
        self.record(cell, predicted, len(ahead) + 1, len(leased))

    def held(self, klass: str, run_start: float, idle_since: float | None, uuids, milli: int) -> Held:
        """A held lease as the service's ETA sees it: an idle notebook is parked at the first sweep
        tick after its idle timeout; a batch job ends with its cell (the trace has no quotas:
        nothing is guaranteed). Only what the ETA reads is filled in."""
        timeout = (self.policy.idle_timeout or None) if lease_class(klass).idles else 0.0
        deadline = (None if idle_since is None or timeout is None
                    else at(math.ceil((idle_since + timeout) / SWEEP_S) * SWEEP_S))
        busy = idle_since is None
        return Held("", "", milli / FULL * len(uuids), klass, False, busy, at(run_start),
                    None if busy else at(idle_since), deadline, gpu_ids=tuple(uuids),
                    cell_started=at(run_start) if busy else None, idle_timeout=timeout)

    def started(self, cell: int, wait: float) -> None:
        """``cell`` started after waiting ``wait`` seconds."""
        if cell in self.pending:
            self.errors.append((*self.pending.pop(cell), wait))
