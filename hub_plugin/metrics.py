"""Prometheus metrics at ``/metrics``, on a registry of this service's own.

Two kinds: gauges read from the store at scrape time (GPUs, nodes, leases by
state and class, the queue, usage per user), so they cannot drift from the
scheduler's view and survive restarts; and counters and histograms this
process counts as things happen (refusals by reason, queue waits, parks,
resumes), from 0 when it starts. Each metric, its labels and its units:
docs/api.md (``/metrics``).
"""

from __future__ import annotations

from datetime import timezone
from typing import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpupool.metricsregistry import WithoutCreated
from gpupool.schema import LEASE_CLASSES, LeaseState, utcnow
from gpupool.wire.parking import PARK_TIERS

from .admission import PER_USER_CAPS
from .capacity import HOLDING, Allocation, allocations, moving_host_bytes, nodes_with_gpus, usable_memory
from .db import Store
from .models import Lease, UsageRecord
from .rules.misfits import Misfit, limit_code
from .rules.quotas import REFUSING_LIMITS
from .rules.reclaim import ParkCode, Reclaim

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Upper bounds (seconds) of the queue wait histogram: from a release that frees
#: room at once to the longest waits an admin may allow (c.PoolLeases.max_wait).
QUEUE_WAIT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400)
#: Upper bounds (seconds) of the resume histogram: a thaw in memory (under a second) to a large spill loaded.
RESUME_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
ENDED = (LeaseState.released, LeaseState.reclaimed, LeaseState.failed)
#: The states ``gpupool_leases_by_class`` counts.
CLASS_STATES = (LeaseState.queued.value, LeaseState.active.value)
#: Every ``reason`` of ``gpupool_lease_refusals_total`` a refusal is counted under: the misfits, and
#: ``quota_LIMIT`` for each quota limit and per-user cap that refuses (docs/api.md lists them).
REFUSAL_REASONS = (*map(str, Misfit), *(limit_code(name) for name in (*REFUSING_LIMITS, *PER_USER_CAPS)))


class Metrics:
    """The service's registry. ``refused(codes)`` counts one refusal under
    each code it was refused for (:class:`.rules.misfits.Misfit` values and
    :func:`~.rules.misfits.limit_code`, as :class:`.admission.Admission` gives
    them); ``dequeued(seconds)`` observes one queued request's wait as it is placed."""

    def __init__(self, store: Store, context_overhead: int) -> None:
        counted = CollectorRegistry()
        #: What ``/metrics`` renders: ``counted`` without the ``*_created`` series (:class:`WithoutCreated`).
        self.registry = WithoutCreated(counted)
        self.refusals = Counter("gpupool_lease_refusals", "Lease requests refused, by reason code",
                                ["reason"], registry=counted)
        for reason in REFUSAL_REASONS:  # every series from the start: increase() needs the zero before the first
            self.refusals.labels(reason=reason)
        self.queue_wait = Histogram("gpupool_queue_wait_seconds",
                                    "Seconds a queued lease request waited until it was placed",
                                    buckets=QUEUE_WAIT_BUCKETS, registry=counted)
        self.parks = Counter("gpupool_parks", "Leases parked in place, by reason code and tier",
                             ["reason", "tier"], registry=counted)
        for code in ParkCode:  # every series from the start: rate() needs the zero before the first park
            for tier in PARK_TIERS:
                self.parks.labels(reason=str(code), tier=tier)
        self.resume_seconds = Histogram("gpupool_resume_seconds",
                                        "Seconds from a parked lease's placement on its node to its worker answering",
                                        buckets=RESUME_BUCKETS, registry=counted)
        counted.register(_PoolCollector(store, context_overhead))

    def parked(self, code: str, tier: str) -> None:
        self.parks.labels(reason=str(code), tier=tier).inc()

    def resumed(self, seconds: float) -> None:
        self.resume_seconds.observe(max(0.0, seconds))

    def refused(self, codes: Mapping[str, int]) -> None:
        for code in codes:
            self.refusals.labels(reason=str(code)).inc()

    def dequeued(self, seconds: float) -> None:
        self.queue_wait.observe(max(0.0, seconds))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector(Collector):
    """Per-GPU allocation, leases/nodes by state, the queue and usage, read at scrape time."""

    def __init__(self, store: Store, context_overhead: int) -> None:
        self.store = store
        self.context_overhead = context_overhead

    def describe(self) -> Iterator[Metric]:
        # Registering must not query the store; names are declared here instead.
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        (fraction, memory, usable, used, nodes, leases, queue, oldest, usage, ended, reclaims, classes, parked,
         budget) = self._families()
        with self.store.read() as session:
            alloc = allocations(session)
            held = dict(session.execute(select(Lease.node_name, func.sum(Lease.parked_host_bytes)).where(
                Lease.state == LeaseState.parked.value).group_by(Lease.node_name)).all())
            moving = moving_host_bytes(session)  # what leases moving away still hold until their spill
            for node in nodes_with_gpus(session):
                nodes.add_metric([node.name, node.state], 1)
                parked.add_metric([node.name], int(held.get(node.name) or 0) + moving.get(node.name, 0))
                if node.parked_memory is not None:
                    budget.add_metric([node.name], node.parked_memory)
                for gpu in node.gpus:
                    labels = [node.name, str(gpu.index), gpu.uuid, gpu.name, node.name]
                    taken = alloc.get(gpu.uuid, Allocation())
                    fraction.add_metric(labels, taken.fraction)
                    memory.add_metric(labels, taken.memory)
                    usable.add_metric(labels, usable_memory(gpu, self.context_overhead))
                    if gpu.memory_used is not None:
                        used.add_metric(labels, gpu.memory_used)
            counts = dict(session.execute(select(Lease.state, func.count()).group_by(Lease.state)).all())
            by_class = dict(((cls, state), n) for cls, state, n in session.execute(
                select(Lease.lease_class, Lease.state, func.count()).where(Lease.state.in_(CLASS_STATES))
                .group_by(Lease.lease_class, Lease.state)))
            first_queued = session.execute(select(func.min(Lease.created_at))
                                           .where(Lease.state == LeaseState.queued.value)).scalar()
            code = func.coalesce(Lease.reclaim_code, "other")  # "other": reclaimed before codes were kept
            reclaimed = dict(session.execute(select(code, func.count()).where(
                Lease.state == LeaseState.reclaimed.value).group_by(code)).all())
            for user, seconds in sorted(_usage_by_user(session).items()):
                usage.add_metric([user], seconds)
        for state in LeaseState:
            family = ended if state in ENDED else leases
            family.add_metric([state.value], counts.get(state.value, 0))
        queue.add_metric([], counts.get(LeaseState.queued.value, 0))
        if first_queued is not None:
            first_queued = first_queued if first_queued.tzinfo else first_queued.replace(tzinfo=timezone.utc)
        oldest.add_metric([], 0.0 if first_queued is None else max(0.0, (utcnow() - first_queued).total_seconds()))
        for reason in sorted({*map(str, Reclaim), *reclaimed}):
            reclaims.add_metric([reason], reclaimed.get(reason, 0))
        for lease_class in LEASE_CLASSES:
            for state in CLASS_STATES:
                classes.add_metric([lease_class, state], by_class.get((lease_class, state), 0))
        yield from (fraction, memory, usable, used, nodes, leases, queue, oldest, usage, ended, reclaims, classes,
                    parked, budget)

    @staticmethod
    def _families() -> tuple[Metric, ...]:
        gpu = ["node", "gpu", "UUID", "modelName", "Hostname"]
        return (
            GaugeMetricFamily("gpupool_gpu_allocated_ratio", "Share of the GPU held by leases, 0 to 1", labels=gpu),
            GaugeMetricFamily("gpupool_gpu_allocated_memory_bytes", "GPU memory held by leases", labels=gpu),
            GaugeMetricFamily("gpupool_gpu_usable_memory_bytes",
                              "GPU memory leases may share (total - reserved - context overhead)", labels=gpu),
            GaugeMetricFamily("gpupool_gpu_memory_used_bytes", "GPU memory in use as last reported by NVML",
                              labels=gpu),
            GaugeMetricFamily("gpupool_nodes", "Nodes by state (1 per node)", labels=["node", "state"]),
            GaugeMetricFamily("gpupool_leases", "Leases now in each live state", labels=["state"]),
            GaugeMetricFamily("gpupool_queue_length", "Lease requests waiting in the queue"),
            GaugeMetricFamily("gpupool_queue_oldest_wait_seconds",
                              "Seconds the longest-waiting queued request has waited (0: none waits)"),
            CounterMetricFamily("gpupool_usage_gpu_seconds",
                                "GPU-seconds (fraction x GPUs x seconds held) used, by user; running leases "
                                "count up to now", labels=["user"]),
            CounterMetricFamily("gpupool_leases_ended", "Leases that ended, by final state", labels=["state"]),
            CounterMetricFamily("gpupool_reclaims", "Leases the service reclaimed, by reason code",
                                labels=["reason"]),
            GaugeMetricFamily("gpupool_leases_by_class", "Queued and active leases by class (interactive, batch)",
                              labels=["class", "state"]),
            GaugeMetricFamily("gpupool_node_parked_host_bytes", "Host RAM the leases parked in memory hold on the node",
                              labels=["node"]),
            GaugeMetricFamily("gpupool_node_parked_memory_bytes",
                              "Host RAM the node's agent lets parked workers hold before it spills them to disk",
                              labels=["node"]),
        )


def _usage_by_user(session: Session) -> dict[str, float]:
    """GPU-seconds per user: the ledger's spans that ended, plus the spans the
    leases holding a share now are in, counted up to now (a span that ends
    moves from the second sum to the first at its final value, so each user's
    total never goes down; parked time is in neither)."""
    totals: dict[str, float] = dict(session.execute(
        select(UsageRecord.owner, func.sum(UsageRecord.gpu_seconds)).group_by(UsageRecord.owner)).all())
    now = utcnow()
    running = session.execute(select(Lease.owner, Lease.fraction, Lease.gpu_count, Lease.held_since)
                              .where(Lease.state.in_(HOLDING), Lease.held_since.is_not(None)))
    for owner, fraction, count, since in running:
        totals[owner] = totals.get(owner, 0.0) + fraction * count * max(0.0, (now - since).total_seconds())
    return totals
