"""``/metrics``: Prometheus text format (any token, unless
``c.GPUPool.authenticate_prometheus = False``).

Series labelled with a ``user`` (GPU-seconds per user) go only to admins and
to the metrics token (``c.GPUPool.metrics_token_file``); everyone else gets
the pool-wide series: one user's scrape does not show what others use.
"""

from __future__ import annotations

import hmac

from prometheus_client import generate_latest

from ..auth import token_from_header
from ..metrics import CONTENT_TYPE
from ..storework import CALLER
from .base import APIHandler


class MetricsHandler(APIHandler):

    async def prepare(self) -> None:
        token = token_from_header(self.request.headers.get("Authorization")) or ""
        own = self.ctx.metrics_token
        self.full = bool(own) and hmac.compare_digest(token.encode(), own.encode())
        if self.full:
            CALLER.set("metrics")  # its store work takes turns like a user's (storework)
            return self.start_body()
        if self.ctx.settings.service.authenticate_prometheus or token:
            await super().prepare()
        self.full = self.identity is not None and self.identity.admin

    async def get(self) -> None:
        registry = self.ctx.metrics.registry if self.full else _PoolWide(self.ctx.metrics.registry)
        body = await self.ctx.work.read(generate_latest, registry)  # the collector reads the store
        self.set_header("Content-Type", CONTENT_TYPE)
        self.finish(body)


class _PoolWide:
    """A registry's series without those labelled ``user`` (what ``generate_latest`` needs: ``collect``)."""

    def __init__(self, registry) -> None:
        self.registry = registry

    def collect(self):
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if "user" not in s.labels]
            yield metric


routes = [
    (r"/metrics", MetricsHandler),
]
