"""JupyterHub -> service: the ``post_stop_hook`` that ``hub_plugin.hub.configure``
installs tells the service a user's server stopped (``POST /hub/server-stopped``,
an internal callback, not in the OpenAPI document; docs/api.md, "JupyterHub").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import bad_request
from .fields import Body, Spec, wired

_USER = "'user' must be the JupyterHub user name whose server stopped"


@dataclass(frozen=True)
class ServerStopped(Body):
    """``user``'s server ``server`` (``""``: the default one, at most 255
    characters) stopped; ``other_servers_running``: whether another server
    of theirs still runs (then only that server's leases are released)."""

    user: str = wired(Spec("string", required=True, min_length=1, error=_USER))
    server: str = wired(Spec("string", "\"\": the default server", max_length=255,
                             error="'server' must be the name of the server that stopped (\"\" for the default "
                             "one)"), "")
    other_servers_running: bool = wired(Spec("boolean", "read as true or false whatever it is"), False)

    @classmethod
    def from_json(cls, body: Any) -> "ServerStopped":
        """Validate the hook's body; 400 naming ``user`` or ``server``. A
        missing ``server`` is the default one; ``other_servers_running`` is
        read for its truth (absent: false)."""
        if not isinstance(body, dict):
            raise bad_request(_USER)
        values = cls.read(body, "user", "server")
        return cls(values["user"], values["server"] or "", bool(body.get("other_servers_running")))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
