"""``POST /hub/server-stopped``: JupyterHub tells the service that a
user's server stopped (sent by the ``post_stop_hook`` that
:func:`..hub.configure` installs).

It is an internal callback of the hub, not part of the public ``/api/v1``
(so not in the OpenAPI document). Only the hub may call it, with this service's own hub API token (which the
hub set in the service entry). Every lease of the user that still holds or
waits for capacity is released with the reason "the Jupyter server stopped",
unless ``other_servers_running`` is true: leases do not record which of a
user's named servers they came from, so then the kernels' own shutdown and
the heartbeat TTL are left to end them. Answers ``{"released": [ids]}``.
"""

from __future__ import annotations

from gpupool.errors import bad_request
from gpupool.schema import LeaseState

from ..auth import forbidden, token_from_header, unauthorized
from ..capacity import HOLDING
from ..models import Lease
from .base import APIHandler

#: The reason a released lease shows its owner.
REASON = "the Jupyter server stopped"


class ServerStoppedHandler(APIHandler):

    async def prepare(self) -> None:
        token = token_from_header(self.request.headers.get("Authorization"))
        if not token:
            raise unauthorized()
        is_hub = getattr(self.ctx.authenticator, "is_hub", None)
        if is_hub is None or not is_hub(token):
            raise forbidden("only JupyterHub (with this service's own API token) may report stopped servers")

    async def post(self) -> None:
        body = self.json_body()
        user = body.get("user") if isinstance(body, dict) else None
        if not isinstance(user, str) or not user:
            raise bad_request("'user' must be the JupyterHub user name whose server stopped")
        released: list[str] = []
        if not body.get("other_servers_running"):
            released = await self._release_all(user)
        self.write_json({"released": released})

    async def _release_all(self, user: str) -> list[str]:
        from sqlalchemy import select

        waiting = (*HOLDING, LeaseState.queued.value)
        with self.ctx.leases.store.read() as session:
            ids = list(session.scalars(select(Lease.id).where(Lease.owner == user, Lease.state.in_(waiting))))
        for lease_id in ids:
            await self.ctx.leases.release(lease_id, LeaseState.released, REASON)
        return ids


routes = [
    (r"/hub/server-stopped", ServerStoppedHandler),
]
