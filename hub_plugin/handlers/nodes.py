"""``/api/v1/nodes``: agent registration and heartbeats (agent token only)."""

from __future__ import annotations

from .base import APIHandler


class NodeListHandler(APIHandler):
    """``POST /nodes``: register (or re-register) a node and its GPUs."""

    async def post(self) -> None:
        self.require_agent()
        self.write_json(await self.ctx.pool.nodes.register(self.json_body()))


class NodeHeartbeatHandler(APIHandler):
    """``POST /nodes/{name}/heartbeat``: worker reports and GPU readings."""

    async def post(self, name: str) -> None:
        self.require_agent()
        self.write_json(await self.ctx.pool.nodes.heartbeat(name, self.json_body(optional=True)))


routes = [
    (r"/api/v1/nodes", NodeListHandler),
    (r"/api/v1/nodes/([^/]+)/heartbeat", NodeHeartbeatHandler),
]
