"""A Prometheus registry's series as gpupool exposes them: without the
``NAME_created`` series prometheus_client adds to each counter and histogram
(the Unix time it was made), which docs/api.md does not list. Per registry on
purpose: ``prometheus_client.disable_created_metrics()`` (0.26) would change
every registry of the process (JupyterHub's, where the service runs inside it).
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric


class WithoutCreated:
    """``registry`` as ``generate_latest`` reads it (it needs only ``collect``), less the ``*_created`` series."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if s.name != metric.name + "_created"]
            yield metric
