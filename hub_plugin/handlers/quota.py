"""``/api/v1/quota``: the caller's own limits and usage (for ``%gpu quota``)."""

from __future__ import annotations

from .base import APIHandler


class QuotaHandler(APIHandler):
    """``GET /quota``: ``{"user", "groups", "limits", "usage"}`` (docs/api.md, "Quotas")."""

    async def get(self) -> None:
        self.write_json(await self.ctx.work.read(self._mine_now, self.require_user()))

    def _mine_now(self, who) -> dict:
        with self.ctx.pool.state.reading() as session:
            return self.ctx.pool.quotas.mine(session, who)


routes = [
    (r"/api/v1/quota", QuotaHandler),
]
