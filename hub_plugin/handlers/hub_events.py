"""``POST /hub/server-stopped``: JupyterHub tells the service that a
user's server stopped (sent by the ``post_stop_hook`` that
:func:`..hub.configure` installs).

It is an internal callback of the hub, not part of the public ``/api/v1``
(so not in the OpenAPI document). Only the hub may call it, with this service's own hub API token (which the
hub set in the service entry). Body: :class:`gpupool.wire.hub.ServerStopped`,
``{"user", "server", "other_servers_running"}`` (``server``: the stopped
server's name, ``""`` for the default one).

The user's leases that still hold or wait for capacity are released with the
reason "the Jupyter server stopped": those whose ``server_name`` is
``server``; and, when ``other_servers_running`` is false, all the others too
(those of no known server, from clients that did not say, and any a server
that stopped earlier left behind). Answers ``{"released": [ids]}``.
"""

from __future__ import annotations

from gpupool.schema import LeaseState
from gpupool.wire.hub import ServerStopped

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
            raise unauthorized("only JupyterHub posts here, with this service's own hub API token")
        is_hub = getattr(self.ctx.authenticator, "is_hub", None)
        if is_hub is None or not is_hub(token):
            raise forbidden("only JupyterHub (with this service's own API token) may report stopped servers")
        self.start_body()

    async def post(self) -> None:
        stopped = ServerStopped.from_json(self.json_body())
        self.write_json({"released": await self._release(stopped.user, stopped.server,
                                                          stopped.other_servers_running)})

    async def _release(self, user: str, server: str, others: bool) -> list[str]:
        """Release ``user``'s leases from ``server``, or all of them when no
        other server of theirs runs; returns their ids."""
        from sqlalchemy import select

        waiting = (*HOLDING, LeaseState.queued.value, LeaseState.parked.value)  # a parked one's kernel went too
        query = select(Lease.id).where(Lease.owner == user, Lease.state.in_(waiting))
        if others:
            query = query.where(Lease.server_name == server)
        ids = await self.ctx.work.read(self._ids_now, query)
        for lease_id in ids:
            await self.ctx.pool.leases.release(lease_id, LeaseState.released, REASON)
        return ids


    def _ids_now(self, query) -> list[str]:
        with self.ctx.pool.state.reading() as session:
            return list(session.scalars(query))


routes = [
    (r"/hub/server-stopped", ServerStoppedHandler),
]
