"""``/api/v1/pool``: nodes, GPUs and what is allocated."""

from __future__ import annotations

from ..views import pool_json
from .base import APIHandler


class PoolHandler(APIHandler):
    """``GET /pool``: any user, or an agent."""

    async def get(self) -> None:
        self.write_json(await self.ctx.work.read(self._pool_now))

    def _pool_now(self) -> dict:
        with self.ctx.pool.state.reading() as session:
            return pool_json(session, self.ctx.settings.nodes.context_overhead)


routes = [
    (r"/api/v1/pool", PoolHandler),
]
