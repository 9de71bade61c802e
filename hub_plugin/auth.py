"""Who is calling: a request's token -> :class:`Identity`.

The seam: handlers only call ``Authenticator.authenticate(token)`` and look
at the :class:`Identity`. Standalone mode uses :class:`TokenAuthenticator`
(``c.GPUPool.api_tokens`` and the agent token); a JupyterHub implementation
(asking the hub about a user's API token) can subclass
:class:`Authenticator` without any handler changing.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from gpupool.errors import GPUPoolError

AGENT = "agent"


@dataclass(frozen=True)
class Identity:
    """A caller: a user (``admin`` or not) or a node agent (``agent``)."""

    name: str
    admin: bool = False
    agent: bool = False


class Authenticator:
    """Base class: maps a token to an Identity.

    ``authenticate`` is awaited by the base handler for every call but
    ``/health``. Return None for an unknown token (the handler answers 401);
    raise GPUPoolError when the identity source itself fails (e.g. 503 when
    the hub cannot be reached).
    """

    async def authenticate(self, token: str) -> Identity | None:
        raise NotImplementedError


class TokenAuthenticator(Authenticator):
    """Standalone tokens. ``user_tokens`` maps token -> user name;
    ``admin_users`` are user names with admin scope; ``agent_token`` is the
    one token of node agents. Comparisons take constant time."""

    def __init__(self, user_tokens: dict[str, str], admin_users: set[str], agent_token: str) -> None:
        if not agent_token:
            raise ValueError("an agent token is required")
        self._users = dict(user_tokens)
        self._admins = frozenset(admin_users)
        self._agent_token = agent_token

    async def authenticate(self, token: str) -> Identity | None:
        if hmac.compare_digest(token.encode(), self._agent_token.encode()):
            return Identity(AGENT, agent=True)
        name = None
        # Check every token (no early exit) so timing does not reveal a prefix match.
        for candidate, user in self._users.items():
            if hmac.compare_digest(token.encode(), candidate.encode()):
                name = user
        if name is None:
            return None
        return Identity(name, admin=name in self._admins)


def token_from_header(value: str | None) -> str | None:
    """The token of an ``Authorization: token T`` (or ``Bearer T``) header."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() not in ("token", "bearer") or not token.strip():
        return None
    return token.strip()


def unauthorized() -> GPUPoolError:
    return GPUPoolError("unauthorized", "missing or unknown token: send 'Authorization: token TOKEN' "
                        "(standalone: the token in the service's STATE_DIR/user_token)", 401)


def forbidden(message: str) -> GPUPoolError:
    return GPUPoolError("forbidden", message, 403)
