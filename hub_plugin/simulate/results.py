"""What one replay of :mod:`.notebooks` measured, and its figures.

GPU-hours: ``held`` = sum of fraction x GPUs x hours leased; ``busy`` = what
running cells and batch jobs need (slice or whole GPUs) x hours run, for the
work that completed (work a preemption threw away is ``lost``). Cluster
utilization = GPU-hours of completed work done within the period (the
trace's whole days) / (pool GPUs x the period's hours). Waits in
seconds: start minus arrival, per interactive cell and per batch job; a
resumed cell's start is after its resume, whose cost is also kept apart
(``resume_waits``, per interactive resume).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from gpupool.leaseclasses import lease_class

from ..rules.priority import BATCH, INTERACTIVE  # the report's columns: the two shipped classes
from .pool import FULL


@dataclass(frozen=True)
class NotebookResult:
    """One replay (module docstring). ``waits``: seconds each interactive
    cell waited (trace order); ``batch_waits``: each batch job's wait;
    ``parks``: idle leases released while their notebook stayed open (each
    costs a resume), ``early_parks`` of them under pressure; ``preemptions``:
    batch leases stopped to make room; ``users`` x ``period_s`` give
    user-days; ``resume_waits``: seconds each interactive resume cost its
    cell (part of its wait); ``resumes``: resumes by tier (``memory``,
    ``disk``, ``moved``), both classes; ``spills``: parked workers spilled to
    disk by their node's budget."""

    policy: str
    pool_size: int
    held_gpu_hours: float
    busy_gpu_hours: float
    waits: np.ndarray
    acquisitions: int
    peak_held_gpus: float
    held_by_group: dict[int, float]
    seconds: float
    period_s: float = 30 * 86400.0
    users: int = 100
    batch_waits: np.ndarray = field(default_factory=lambda: np.zeros(0))
    busy_by_class: dict[str, float] = field(default_factory=dict)
    lost_gpu_hours: float = 0.0
    parks: int = 0
    early_parks: int = 0
    preemptions: int = 0
    eta_errors: tuple = ()
    busy_in_period_gpu_hours: float = 0.0
    resume_waits: np.ndarray = field(default_factory=lambda: np.zeros(0))
    resumes: dict[str, int] = field(default_factory=dict)
    spills: int = 0

    @property
    def utilization(self) -> float:
        """Busy / held GPU-hours: how much of what was leased did work."""
        return self.busy_gpu_hours / self.held_gpu_hours if self.held_gpu_hours else 0.0

    @property
    def cluster_utilization(self) -> float:
        """GPU-hours busy within the period / pool GPU-hours of the period
        (work that runs on after the period's end is not counted)."""
        return self.busy_in_period_gpu_hours / (self.pool_size * self.period_s / 3600) if self.pool_size else 0.0

    def wait_percentile(self, q: float, klass: str = INTERACTIVE) -> float:
        waits = self.batch_waits if lease_class(klass).yields else self.waits
        return float(np.percentile(waits, q)) if len(waits) else 0.0

    def resume_percentile(self, q: float) -> float:
        """The ``q``-th percentile of interactive resumes' cost, seconds (0 with none)."""
        return float(np.percentile(self.resume_waits, q)) if len(self.resume_waits) else 0.0

    @property
    def waited_share(self) -> float:
        return float(np.mean(self.waits > 0)) if len(self.waits) else 0.0

    def per_user_day(self, count: int) -> float:
        return count / max(1, self.users) / (self.period_s / 86400)

    def row(self) -> dict:
        """Plain numbers for tables and JSON."""
        waits = {f"{k}_p{q}_wait_s": self.wait_percentile(q, k) for k in (INTERACTIVE, BATCH) for q in (50, 95, 99)}
        return {"policy": self.policy, "pool_size": self.pool_size,
                "held_gpu_hours": round(self.held_gpu_hours, 3), "busy_gpu_hours": round(self.busy_gpu_hours, 3),
                "utilization": round(self.utilization, 4), "cluster_utilization": round(self.cluster_utilization, 4),
                **waits, "waited_share": round(self.waited_share, 4),
                "acquired_share": round(self.acquisitions / max(1, len(self.waits)), 4),
                "peak_held_gpus": round(self.peak_held_gpus, 2), "lost_gpu_hours": round(self.lost_gpu_hours, 1),
                "parks_per_user_day": round(self.per_user_day(self.parks), 3),
                "early_parks_per_user_day": round(self.per_user_day(self.early_parks), 3),
                "preemptions_per_user_day": round(self.per_user_day(self.preemptions), 3),
                **{f"resume_p{q}_s": round(self.resume_percentile(q), 3) for q in (50, 95, 99)},
                "resumes": dict(self.resumes), "spills": self.spills,
                "busy_by_class": {k: round(v, 1) for k, v in self.busy_by_class.items()},
                "sim_seconds": round(self.seconds, 2)}


HEADERS = ("policy", "GPUs", "GPU-h held", "GPU-h busy", "cluster util", "held util", "int. p50/p95/p99 s",
           "batch p50/p95/p99 s", "parks /user-day", "preempt. /user-day", "resume p50/p95/p99 s")


def gpu_hours(hours: float) -> str:
    """GPU-hours for a table: whole ones from 100 on, else three significant digits (a young pool's store)."""
    return f"{hours:,.0f}" if hours >= 100 else f"{hours:.3g}"


def rows(results) -> list[list]:
    """Table rows (:data:`HEADERS`) for results."""
    def waits(r, k):
        if k == BATCH and not len(r.batch_waits):
            return "-"
        return "/".join(f"{r.wait_percentile(q, k):.0f}" for q in (50, 95, 99))

    return [[r.policy, r.pool_size, gpu_hours(r.held_gpu_hours), gpu_hours(r.busy_gpu_hours),
             f"{r.cluster_utilization:.1%}", f"{r.utilization:.1%}", waits(r, INTERACTIVE), waits(r, BATCH),
             f"{r.per_user_day(r.parks):.2f}", f"{r.per_user_day(r.preemptions):.2f}", resumes(r)] for r in results]


def resumes(result) -> str:
    """Interactive resumes' cost for a table: p50/p95/p99 seconds, '-' with none."""
    if not len(result.resume_waits):
        return "-"
    return "/".join(seconds(result.resume_percentile(q)) for q in (50, 95, 99))


def seconds(value: float) -> str:
    """Seconds for a table: one decimal under 100 s, whole ones above."""
    return f"{value:.1f}" if value < 100 else f"{value:,.0f}"


@dataclass
class Tally:
    """What a replay counts while it runs, in seconds and GPU-seconds
    (:meth:`result` gives hours). ``period``: seconds cluster utilization is
    measured over; ``waits``: per interactive cell (NaN until it starts)."""

    period: float
    waits: list[float]
    batch_waits: list[float] = field(default_factory=list)
    held: float = 0.0
    busy: float = 0.0
    lost: float = 0.0
    busy_in_period: float = 0.0
    busy_by_class: dict[str, float] = field(default_factory=dict)
    held_by_group: dict[int, float] = field(default_factory=dict)
    acquisitions: int = 0
    peak_milli: int = 0
    parks: int = 0
    early_parks: int = 0
    preemptions: int = 0
    resume_waits: list[float] = field(default_factory=list)
    resumes: dict[str, int] = field(default_factory=dict)
    spills: int = 0

    def resumed(self, tier: str, seconds: float, klass: str) -> None:
        """A lease of ``klass`` resumed from ``tier``, costing its cell ``seconds``."""
        self.resumes[tier] = self.resumes.get(tier, 0) + 1
        if not lease_class(klass).yields:
            self.resume_waits.append(seconds)

    def ran(self, gpus: float, seconds: float, klass: str, run_start: float, now: float) -> None:
        """``gpus`` of class ``klass`` did ``seconds`` of useful work, running from ``run_start`` to ``now``."""
        work = gpus * seconds
        self.busy += work
        self.busy_in_period += gpus * max(0.0, min(now, self.period) - run_start)
        self.busy_by_class[klass] = self.busy_by_class.get(klass, 0.0) + work

    def released(self, gpu_seconds: float, group: int) -> None:
        """A lease of ``group`` ended, having held ``gpu_seconds``."""
        self.held += gpu_seconds
        self.held_by_group[group] = self.held_by_group.get(group, 0.0) + gpu_seconds

    def result(self, policy: str, pool_size: int, seconds: float, users: int, eta_errors,
               batch_cells: Sequence[int] = ()) -> NotebookResult:
        """The replay's :class:`NotebookResult` (``seconds``: its wall-clock time); the waits of
        ``batch_cells`` (trace cells of batch sessions: a store's batch leases) count as batch waits."""
        waits = np.array(self.waits)
        if len(batch_cells):
            self.batch_waits.extend(waits[list(batch_cells)].tolist())
            waits = np.delete(waits, list(batch_cells))
        return NotebookResult(policy, pool_size, self.held / 3600, self.busy / 3600, waits,
                              self.acquisitions - len(self.batch_waits), self.peak_milli / FULL,
                              {g: h / 3600 for g, h in sorted(self.held_by_group.items())},
                              seconds, self.period, users, np.array(self.batch_waits),
                              {k: v / 3600 for k, v in self.busy_by_class.items()}, self.lost / 3600,
                              self.parks, self.early_parks, self.preemptions, tuple(eta_errors),
                              self.busy_in_period / 3600, np.array(self.resume_waits), dict(self.resumes),
                              self.spills)
