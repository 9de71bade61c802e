"""``/api/v1/leases``: create, list, get (with long poll), heartbeat, release."""

from __future__ import annotations

from gpupool.errors import bad_request

from .base import APIHandler


class LeaseListHandler(APIHandler):
    """``POST /leases`` (create) and ``GET /leases`` (own leases)."""

    def post(self) -> None:
        who = self.require_user()
        self.write_json(self.ctx.leases.create(who, self.json_body()), status=201)

    def get(self) -> None:
        who = self.require_user()
        active = self.get_query_argument("active", "1")
        if active not in ("0", "1", "true", "false"):
            raise bad_request(f"'active' must be 1 or 0, got {active!r}")
        kernel_id = self.get_query_argument("kernel_id", None) or None
        leases = self.ctx.leases.list(who, active=active in ("1", "true"), kernel_id=kernel_id)
        self.write_json({"leases": leases})


class LeaseHandler(APIHandler):
    """``GET /leases/{id}`` (``?wait=S&state=X`` long-polls) and ``DELETE /leases/{id}``."""

    async def get(self, lease_id: str) -> None:
        who = self.require_user()
        wait = self.float_argument("wait")
        if wait:
            state = self.get_query_argument("state", None) or None
            self.write_json(await self.ctx.leases.wait(who, lease_id, state, wait))
        else:
            self.write_json(self.ctx.leases.get(who, lease_id))

    async def delete(self, lease_id: str) -> None:
        who = self.require_user()
        reason = self.get_query_argument("reason", None)
        self.write_json(await self.ctx.leases.release_by(who, lease_id, reason))


class LeaseHeartbeatHandler(APIHandler):
    """``POST /leases/{id}/heartbeat``."""

    def post(self, lease_id: str) -> None:
        who = self.require_user()
        self.json_body(optional=True)  # no fields yet, but it must be JSON if sent
        self.write_json(self.ctx.leases.heartbeat(who, lease_id))


routes = [
    (r"/api/v1/leases", LeaseListHandler),
    (r"/api/v1/leases/([^/]+)", LeaseHandler),
    (r"/api/v1/leases/([^/]+)/heartbeat", LeaseHeartbeatHandler),
]
