"""``/api/v1/openapi.json``: the OpenAPI 3.1 document, no token needed."""

from __future__ import annotations

from ..openapi import document
from .base import APIHandler


class OpenAPIHandler(APIHandler):
    auth_required = False

    def get(self) -> None:
        settings = self.ctx.settings
        self.write_json(document(settings.service.base_url, max_wait=settings.leases.max_wait,
                                 max_idle_timeout=settings.leases.max_idle_timeout))


routes = [
    (r"/api/v1/openapi.json", OpenAPIHandler),
]
