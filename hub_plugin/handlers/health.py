"""``/health`` and ``/api/v1/health``: liveness, no token needed."""

from __future__ import annotations

from .base import APIHandler


class HealthHandler(APIHandler):
    """``{"status": "ok"}`` while the service answers."""

    auth_required = False

    def get(self) -> None:
        self.write_json({"status": "ok"})


routes = [
    (r"/health", HealthHandler),
    (r"/api/v1/health", HealthHandler),
]
