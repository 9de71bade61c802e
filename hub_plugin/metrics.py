"""Prometheus metrics at ``/metrics``, on a registry of this service's own.

Gauges are read from the store at scrape time (allocation is always summed
from the leases that hold capacity, so the metrics cannot drift from the
scheduler's view); refusals are counted as they happen.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from gpupool.schema import LeaseState

from .capacity import Allocation, allocations, nodes_with_gpus, usable_memory
from .db import Store
from .models import Lease

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """The service's registry. ``refused(reasons)`` counts one refusal under
    each reason the scheduler gave."""

    def __init__(self, store: Store, context_overhead: int) -> None:
        self.registry = CollectorRegistry()
        self.refusals = Counter("gpupool_lease_refusals", "Lease requests refused, by scheduler reason",
                                ["reason"], registry=self.registry)
        self.registry.register(_PoolCollector(store, context_overhead))

    def refused(self, reasons: dict[str, int]) -> None:
        for reason in reasons:
            self.refusals.labels(reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector(Collector):
    """Per-GPU allocation and leases/nodes by state, read at scrape time."""

    def __init__(self, store: Store, context_overhead: int) -> None:
        self.store = store
        self.context_overhead = context_overhead

    def describe(self) -> Iterator[Metric]:
        # Registering must not query the store; names are declared here instead.
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        fraction, memory, usable, used, nodes, leases = self._families()
        with self.store.read() as session:
            alloc = allocations(session)
            for node in nodes_with_gpus(session):
                nodes.add_metric([node.name, node.state], 1)
                for gpu in node.gpus:
                    labels = [node.name, str(gpu.index), gpu.uuid, gpu.name]
                    taken = alloc.get(gpu.uuid, Allocation())
                    fraction.add_metric(labels, taken.fraction)
                    memory.add_metric(labels, taken.memory)
                    usable.add_metric(labels, usable_memory(gpu, self.context_overhead))
                    if gpu.memory_used is not None:
                        used.add_metric(labels, gpu.memory_used)
            counts = dict(session.execute(select(Lease.state, func.count()).group_by(Lease.state)).all())
        for state in LeaseState:
            leases.add_metric([state.value], counts.get(state.value, 0))
        yield from (fraction, memory, usable, used, nodes, leases)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        gpu = ["node", "index", "uuid", "model"]
        return (
            GaugeMetricFamily("gpupool_gpu_allocated_fraction", "Fraction of the GPU held by leases", labels=gpu),
            GaugeMetricFamily("gpupool_gpu_allocated_memory_bytes", "GPU memory held by leases", labels=gpu),
            GaugeMetricFamily("gpupool_gpu_usable_memory_bytes",
                              "GPU memory leases may share (total - reserved - context overhead)", labels=gpu),
            GaugeMetricFamily("gpupool_gpu_memory_used_bytes", "GPU memory in use as last reported by NVML",
                              labels=gpu),
            GaugeMetricFamily("gpupool_nodes", "Nodes by state (1 per node)", labels=["node", "state"]),
            GaugeMetricFamily("gpupool_leases", "Leases by state", labels=["state"]),
        )
