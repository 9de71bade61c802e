"""Who is calling: a request's token -> :class:`Identity`.

The seam: handlers only call ``Authenticator.authenticate(token)`` and look
at the :class:`Identity`. Standalone mode uses :class:`TokenAuthenticator`
(``c.GPUPool.api_tokens`` and the agent token); under JupyterHub
:class:`HubAuthenticator` asks the hub about a user's API token
(``HubAuth.user_for_token``) and judges it by its filtered scopes
(``custom:gpupool:use!user=NAME``), with the user's hub groups. jupyterhub is
imported only there, so a standalone service does not need it.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from gpupool.errors import GPUPoolError, Reason

AGENT = "agent"


@dataclass(frozen=True)
class Identity:
    """A caller: a user (``admin`` or not) or a node agent (``agent``).

    ``groups`` are the user's group names (JupyterHub groups under the hub;
    empty standalone), read by quota resolution.
    """

    name: str
    admin: bool = False
    agent: bool = False
    groups: tuple[str, ...] = ()


class Authenticator:
    """Base class: maps a token to an Identity.

    ``authenticate`` is awaited by the base handler for every call but
    ``/health``. Return None for an unknown token (the handler answers 401);
    raise GPUPoolError when the identity source itself fails (e.g. 503 when
    the hub cannot be reached).
    """

    #: Where a caller gets a token this authenticator knows, in words for the 401
    #: (:func:`unauthorized`); a subclass or an instance sets its own.
    token_hint = "a user's API token of this service"
    #: Who makes a user a pool admin, in words for a 403 to one who is not
    #: (``only pool admins may call /admin (...)``); a subclass sets its own.
    admin_hint = "the service's admin setting"

    async def authenticate(self, token: str) -> Identity | None:
        raise NotImplementedError


class TokenAuthenticator(Authenticator):
    """Standalone tokens. ``user_tokens`` maps token -> user name;
    ``admin_users`` are user names with admin scope; ``agent_token`` is the
    one token of node agents; ``token_hint`` where users get theirs (the 401's words:
    a token of ``c.GPUPool.api_tokens``, or the one the service wrote to
    ``STATE_DIR/user_token`` when none is configured). Comparisons take constant time."""

    admin_hint = "c.GPUPool.admin_users"

    def __init__(self, user_tokens: dict[str, str], admin_users: set[str], agent_token: str,
                 token_hint: str = "a token of the service's c.GPUPool.api_tokens: ask the pool's admin") -> None:
        if not agent_token:
            raise ValueError("an agent token is required")
        self.token_hint = token_hint
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


def unauthorized(token_hint: str) -> GPUPoolError:
    """The 401 for a request without a token the service knows; ``token_hint``
    (:attr:`Authenticator.token_hint`) says where a user gets one, in the message
    and as the body's ``token_hint``, which the command line words its own
    message with (it tells the user its options, not the header)."""
    return GPUPoolError(Reason.unauthorized, f"missing or unknown token: send 'Authorization: token TOKEN' "
                        f"({token_hint})", 401, token_hint=token_hint)


def forbidden(message: str) -> GPUPoolError:
    return GPUPoolError(Reason.forbidden, message, 403)


#: The custom JupyterHub scopes (see :mod:`.hub`): using the pool, and administering it.
USE_SCOPE = "custom:gpupool:use"
ADMIN_SCOPE = "custom:gpupool:admin"


def identity_from_hub_model(model: dict) -> Identity:
    """An :class:`Identity` from a JupyterHub user model (``GET /hub/api/user``
    with the caller's token), judged by the scopes that token holds.

    The token must hold ``custom:gpupool:use!user=NAME`` (the filtered form a
    single-user server token gets), ``custom:gpupool:use`` or
    ``custom:gpupool:admin``; else 403 naming the scope. Admin means the
    unfiltered ``custom:gpupool:admin``. Groups come from the model (the hub
    always includes them on this "identify" endpoint). Raises GPUPoolError
    403 for a model that is not a user's (a service token).
    """
    from jupyterhub.services.auth import check_scopes

    if model.get("kind", "user") != "user":
        raise forbidden(f"JupyterHub {model.get('kind')} {model.get('name')!r} is not a user; "
                        "only users' tokens may call the gpupool service")
    name = model["name"]
    scopes = set(model.get("scopes") or ())
    admin = bool(check_scopes({ADMIN_SCOPE}, scopes))
    if not admin and not check_scopes({f"{USE_SCOPE}!user={name}"}, scopes):
        raise forbidden(f"this token of {name} lacks the scope {USE_SCOPE}!user={name}; an admin grants it "
                        "with gpupool.hub_plugin.hub.configure(c, ...) in jupyterhub_config.py (and the "
                        "server must be restarted to get a new token)")
    return Identity(name, admin=admin, groups=tuple(sorted(model.get("groups") or ())))


class HubAuthenticator(Authenticator):
    """Users as JupyterHub knows them (the service runs as a hub service).

    ``hub_auth`` is a ``jupyterhub.services.auth.HubAuth`` (its API URL and
    token come from the ``JUPYTERHUB_*`` environment the hub gives a managed
    service); user tokens are resolved with ``user_for_token`` (cached by
    HubAuth for ``cache_max_age`` seconds). ``agent_token`` is still the node
    agents' own token. ``hub_token`` is the service's own hub API token, which
    only the hub's ``post_stop_hook`` sends: it is no user, so
    :meth:`authenticate` gives None for it and :meth:`is_hub` tells it apart.
    Raises GPUPoolError 503 when the hub cannot be asked.
    """

    token_hint = "a JupyterHub API token with the custom:gpupool:use scope, such as a notebook's $JUPYTERHUB_API_TOKEN"
    # Under the hub c.GPUPool.admin_users is not read: the admin scope is granted by configure(c, admin_group=...,
    # admin_users=...), and, like every hub scope, comes with the user's next token.
    admin_hint = (f"the hub's {ADMIN_SCOPE} scope: the admin_group or admin_users of "
                  "gpupool.hub_plugin.hub.configure(c, ...) in jupyterhub_config.py")

    def __init__(self, hub_auth, agent_token: str) -> None:
        if not agent_token:
            raise ValueError("an agent token is required")
        self.hub_auth = hub_auth
        self._agent_token = agent_token

    def is_hub(self, token: str) -> bool:
        """Whether ``token`` is this service's own hub API token (constant time)."""
        own = self.hub_auth.api_token or ""
        return bool(own) and hmac.compare_digest(token.encode(), own.encode())

    async def authenticate(self, token: str) -> Identity | None:
        if hmac.compare_digest(token.encode(), self._agent_token.encode()):
            return Identity(AGENT, agent=True)
        if self.is_hub(token):
            return None
        from tornado.web import HTTPError

        try:
            model = await self.hub_auth.user_for_token(token, sync=False)
        except HTTPError as exc:  # HubAuth's own failures: hub down, or it refused our token
            raise GPUPoolError(Reason.hub_unavailable, f"cannot check the token with JupyterHub at "
                               f"{self.hub_auth.api_url} ({exc.log_message}); try again shortly", 503) from None
        if not model:
            return None
        return identity_from_hub_model(model)


def in_jupyterhub(environ: dict[str, str]) -> bool:
    """Whether the service runs as a JupyterHub service: the hub gave it an API
    URL and token, and a service name (which a single-user server's terminal,
    where someone may start a standalone pool, does not have)."""
    return all(environ.get(key) for key in ("JUPYTERHUB_API_TOKEN", "JUPYTERHUB_API_URL", "JUPYTERHUB_SERVICE_NAME"))
