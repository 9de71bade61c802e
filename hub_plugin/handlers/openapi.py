"""``/api/v1/openapi.json``: the OpenAPI 3.1 document, no token needed."""

from __future__ import annotations

from ..openapi import document
from .base import APIHandler


class OpenAPIHandler(APIHandler):
    auth_required = False

    def get(self) -> None:
        self.write_json(document(self.ctx.settings.base_url))


routes = [
    (r"/api/v1/openapi.json", OpenAPIHandler),
]
