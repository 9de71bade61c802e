"""``/api/v1/pool``: nodes, GPUs and what is allocated."""

from __future__ import annotations

from ..views import pool_json
from .base import APIHandler


class PoolHandler(APIHandler):
    """``GET /pool``: any user, or an agent."""

    def get(self) -> None:
        with self.ctx.leases.store.read() as session:
            body = pool_json(session, self.ctx.settings.context_overhead)
        self.write_json(body)


routes = [
    (r"/api/v1/pool", PoolHandler),
]
