"""``/metrics``: Prometheus text format (any token, unless
``c.GPUPool.authenticate_prometheus = False``)."""

from __future__ import annotations

from ..metrics import CONTENT_TYPE
from .base import APIHandler


class MetricsHandler(APIHandler):

    async def prepare(self) -> None:
        if self.ctx.settings.authenticate_prometheus:
            await super().prepare()

    def get(self) -> None:
        self.set_header("Content-Type", CONTENT_TYPE)
        self.finish(self.ctx.metrics.render())


routes = [
    (r"/metrics", MetricsHandler),
]
