"""The agent's Prometheus metrics at ``GET /metrics`` (metrics token or agent token).

Per GPU, with the labels of NVIDIA's DCGM exporter (``gpu`` index, ``UUID``,
``modelName``, ``Hostname``: the node's name) so dashboards can join both:

- ``gpupool_agent_gpu_memory_used_bytes`` / ``..._memory_total_bytes``: NVML's readings;
- ``gpupool_agent_gpu_utilization_ratio``: NVML's utilization, 0 to 1;
- ``gpupool_agent_gpu_workers``: workers bound to the GPU;

and for the node: ``gpupool_agent_workers{state}`` (``starting``, ``idle``,
``busy``, ``dead``), ``gpupool_agent_nvml_up`` (1 while NVML answers, 0 while
the node is degraded) and the counter ``gpupool_agent_nvml_errors_total``
(heartbeats at which NVML could not be read).

The numbers are those of the last heartbeat (:meth:`AgentMetrics.update`), so a
scrape never calls NVML itself; a reading NVML could not give is left out,
never written as 0.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpupool.metricsregistry import WithoutCreated
from gpupool.schema import WorkerState
from gpupool.wire.nodes import GPUInfo, WorkerReport

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: DCGM exporter's label names, in its order.
GPU_LABELS = ("gpu", "UUID", "modelName", "Hostname")


def workers_by_gpu(specs: Iterable[Any]) -> dict[str, int]:
    """GPU UUID -> lease workers bound to it, from the workers' specs
    (:class:`~.workers.WorkerSpec`; None for a worker that has none yet)."""
    counts: dict[str, int] = {}
    for spec in specs:
        for gpu in spec.gpus if spec is not None else ():
            counts[gpu.uuid] = counts.get(gpu.uuid, 0) + 1
    return counts


class AgentMetrics(Collector):
    """The agent's registry. ``update(...)`` at each heartbeat; ``render()`` per scrape."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._gpus: list[GPUInfo] = []
        self._readings: dict[str, dict[str, Any]] = {}
        self._workers_by_gpu: dict[str, int] = {}
        self._states: dict[str, int] = {}
        self._nvml_up = 1
        self.registry = CollectorRegistry()
        self.nvml_errors = Counter("gpupool_agent_nvml_errors", "Heartbeats at which NVML could not be read",
                                   registry=self.registry)
        self.registry.register(self)

    def update(self, gpus: Iterable[GPUInfo], readings: Iterable[Mapping[str, Any]],
               workers_by_gpu: Mapping[str, int], error: str | None,
               reports: Iterable[WorkerReport] = ()) -> None:
        """Keep one heartbeat's view: the node's ``gpus``, NVML ``readings``
        (``{"uuid", "memory_used", "utilization"}``, bytes and percent, None when
        unknown), workers per GPU UUID, the inventory's ``error`` (None when NVML
        answers; else counted once) and the workers' ``reports``."""
        self._gpus = list(gpus)
        self._readings = {r["uuid"]: dict(r) for r in readings if "uuid" in r}
        self._workers_by_gpu = dict(workers_by_gpu)
        states: dict[str, int] = {state: 0 for state in WorkerState}
        for report in reports:
            states[report.execution_state] = states.get(report.execution_state, 0) + 1
        self._states = states
        self._nvml_up = 0 if error else 1
        if error:
            self.nvml_errors.inc()

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        used, total, util, workers, states, up = self._families()
        for gpu in self._gpus:
            labels = [str(gpu.index), gpu.uuid, gpu.name, self.node]
            reading = self._readings.get(gpu.uuid, {})
            total.add_metric(labels, gpu.memory_total)
            if reading.get("memory_used") is not None:
                used.add_metric(labels, reading["memory_used"])
            if reading.get("utilization") is not None:
                util.add_metric(labels, reading["utilization"] / 100.0)
            workers.add_metric(labels, self._workers_by_gpu.get(gpu.uuid, 0))
        for state, count in sorted(self._states.items()):
            states.add_metric([state], count)
        up.add_metric([], self._nvml_up)
        yield from (used, total, util, workers, states, up)

    @staticmethod
    def _families() -> tuple[Metric, ...]:
        return (
            GaugeMetricFamily("gpupool_agent_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=GPU_LABELS),
            GaugeMetricFamily("gpupool_agent_gpu_memory_total_bytes", "GPU memory in all (NVML)", labels=GPU_LABELS),
            GaugeMetricFamily("gpupool_agent_gpu_utilization_ratio", "GPU utilization, 0 to 1 (NVML)",
                              labels=GPU_LABELS),
            GaugeMetricFamily("gpupool_agent_gpu_workers", "Workers bound to the GPU", labels=GPU_LABELS),
            GaugeMetricFamily("gpupool_agent_workers", "Workers of this node by execution state", labels=["state"]),
            GaugeMetricFamily("gpupool_agent_nvml_up", "1 while NVML answers, 0 while the node is degraded"),
        )

    def render(self) -> bytes:
        return generate_latest(WithoutCreated(self.registry))
