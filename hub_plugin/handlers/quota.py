"""``/api/v1/quota``: the caller's own limits and usage (for ``%gpu quota``)."""

from __future__ import annotations

from .base import APIHandler


class QuotaHandler(APIHandler):
    """``GET /quota``: ``{"user", "groups", "limits", "usage"}`` (docs/api.md, "Quotas")."""

    def get(self) -> None:
        who = self.require_user()
        quotas = self.ctx.leases.quotas
        with self.ctx.leases.store.read() as session:
            body = quotas.mine(session, who)
        self.write_json(body)


routes = [
    (r"/api/v1/quota", QuotaHandler),
]
