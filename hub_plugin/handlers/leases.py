"""``/api/v1/leases``: create, list, get (with long poll), heartbeat, release,
park in place and resume."""

from __future__ import annotations

import re

from gpupool.errors import bad_request, not_found
from gpupool.schema import LeaseState, has_control_characters

from ..auth import forbidden
from .base import APIHandler

#: What ``models.new_lease_id`` makes. Any other id is answered 404 before the
#: store is asked, so odd bytes (NUL, which PostgreSQL refuses) never reach it.
LEASE_ID = re.compile(r"L-[0-9a-f]{12}")


def _lease_id(text: str) -> str:
    """``text`` if it has the form of a lease id; else 404, as for an unknown one."""
    if not LEASE_ID.fullmatch(text):
        raise not_found(f"lease {text[:40]!r}")
    return text


class LeaseListHandler(APIHandler):
    """``POST /leases`` (create; ``?start_wait=S`` answers once the worker started, within S seconds)
    and ``GET /leases`` (own leases; ``?all_users=1``: every user's, for admins)."""

    async def post(self) -> None:
        who = self.require_user()
        start_wait = self.float_argument("start_wait", 0.0)
        self.write_json(await self.ctx.pool.intake.create(who, self.json_body(), start_wait), status=201)

    async def get(self) -> None:
        who = self.require_user()
        active = self.get_query_argument("active", "1")
        if active not in ("0", "1", "true", "false"):
            raise bad_request(f"'active' must be 1, 0, true or false, got {active!r:.40}")
        kernel_id = self.get_query_argument("kernel_id", None) or None
        all_users = self.get_query_argument("all_users", "0")
        if all_users not in ("0", "1", "true", "false"):
            raise bad_request(f"'all_users' must be 1, 0, true or false, got {all_users!r:.40}")
        all_users = all_users in ("1", "true")
        if all_users and not who.admin:
            raise forbidden(f"only pool admins may list every user's leases ({self.ctx.authenticator.admin_hint}); "
                            "without all_users you get your own")
        leases = await self.ctx.pool.views.list(who, active=active in ("1", "true"), kernel_id=kernel_id,
                                                all_users=all_users)
        self.write_json({"leases": leases})


class LeaseHandler(APIHandler):
    """``GET /leases/{id}`` (``?wait=S&state=X`` long-polls) and ``DELETE /leases/{id}``."""

    async def get(self, lease_id: str) -> None:
        who = self.require_user()
        lease_id = _lease_id(lease_id)
        wait = self.float_argument("wait")
        state = self.get_query_argument("state", None)
        if state is not None and state not in LeaseState.__members__:
            raise bad_request(f"'state' must be one of {', '.join(LeaseState.__members__)}, got {state!r:.40}")
        if wait:
            self.write_json(await self.ctx.pool.views.wait(who, lease_id, state, wait))
        else:
            self.write_json(await self.ctx.pool.views.get(who, lease_id))

    async def delete(self, lease_id: str) -> None:
        who = self.require_user()
        lease_id = _lease_id(lease_id)
        reason = self.get_query_argument("reason", None)
        if reason is not None and has_control_characters(reason):
            raise bad_request("'reason' must be words without control characters")
        self.write_json(await self.ctx.pool.leases.release_by(who, lease_id, reason))


class LeaseHeartbeatHandler(APIHandler):
    """``POST /leases/{id}/heartbeat``."""

    async def post(self, lease_id: str) -> None:
        who = self.require_user()
        self.empty_body()
        self.write_json(await self.ctx.pool.leases.heartbeat(who, _lease_id(lease_id)))


class LeaseParkHandler(APIHandler):
    """``POST /leases/{id}/park``: park in place now (its owner only; docs/parking.md)."""

    async def post(self, lease_id: str) -> None:
        who = self.require_user()
        lease_id = _lease_id(lease_id)
        self.empty_body()
        self.write_json(await self.ctx.pool.parking.park_by(who, lease_id))


class LeaseResumeHandler(APIHandler):
    """``POST /leases/{id}/resume``: resume a parked lease once there is room (its owner only;
    idempotent); body ``{}`` or ``{"in_place": true}`` (asked ahead of a cell: never moved)."""

    async def post(self, lease_id: str) -> None:
        who = self.require_user()
        lease_id = _lease_id(lease_id)
        body = self.json_object_body(optional=True) or {}
        unknown = sorted(set(body) - {"in_place"})
        if unknown:
            raise bad_request(f"a resume takes only 'in_place'; got {', '.join(map(repr, unknown))}")
        in_place = body.get("in_place", False)
        if not isinstance(in_place, bool):
            raise bad_request(f"'in_place' must be true or false, got {in_place!r:.40}")
        self.write_json(await self.ctx.pool.parking.resume_by(who, lease_id, in_place))


routes = [
    (r"/api/v1/leases", LeaseListHandler),
    (r"/api/v1/leases/([^/]+)", LeaseHandler),
    (r"/api/v1/leases/([^/]+)/heartbeat", LeaseHeartbeatHandler),
    (r"/api/v1/leases/([^/]+)/park", LeaseParkHandler),
    (r"/api/v1/leases/([^/]+)/resume", LeaseResumeHandler),
]
