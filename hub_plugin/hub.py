"""One call in ``jupyterhub_config.py`` runs gpupool as a JupyterHub service
(:func:`configure`; deploy/jupyterhub/README.md, "In your own hub")::

    from gpupool.hub_plugin.hub import configure
    configure(c, admin_group="gpu-admins",
              quotas={"*": {"max_gpus": 1, "gpu_hours_per_day": 8}, "group:physics": {"max_gpus": 2}})

Call it after any ``c.JupyterHub.load_roles`` / ``services`` /
``c.Spawner.server_token_scopes`` of your own (it extends them); it runs in
the hub and again in the service when the service reads this file, and
imports nothing of the service (no SQLAlchemy in the hub).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Iterable

USE_SCOPE = "custom:gpupool:use"
ADMIN_SCOPE = "custom:gpupool:admin"
#: The hub's own default scopes of a server token (the "server" role), kept when extending.
SERVER_ROLE_SCOPES = ["users:activity!user", "access:servers!server"]


def configure(c: Any, *, name: str = "gpupool", ip: str = "127.0.0.1", port: int = 8765, public_url: str | None = None,
              state_dir: str | os.PathLike | None = None, config_file: str | os.PathLike | None = None,
              quotas: dict | None = None, user_groups: Iterable[str] | None = None,
              admin_group: str | None = None, admin_users: Iterable[str] = (),
              environment: dict[str, str] | None = None) -> dict[str, Any]:
    """Wire the gpupool service into the hub config ``c``; returns the service entry.

    ``ip``/``port``: where the service listens. ``public_url``: the URL kernels
    and agents use to reach it when that is not ``ip:port`` (a bind to
    ``0.0.0.0`` is reached by name): e.g. ``"https://hub.example.org:8765"``, without
    the service prefix; across hosts make it ``https://`` and set
    ``c.GPUPool.ssl_cert``/``ssl_key`` (docs/security.md, "Transport"). It is
    also the URL the proxy forwards ``/services/NAME/`` to. Default: the bound
    address (``127.0.0.1`` for a wildcard). ``state_dir``: its SQLite store and token files (default
    ``gpupool-state`` beside the config file). ``config_file``: the file the
    service reads (default: the file calling this, i.e. ``jupyterhub_config.py``).
    ``quotas``: sets ``c.PoolQuotas.quotas``. ``user_groups``: only these groups'
    members may use the pool (default None: every hub user). ``admin_group`` /
    ``admin_users``: pool admins. ``environment``: more variables for the
    service process (every ``GPUPOOL_*`` variable of the hub is passed on, and
    its working directory is the hub's). Raises ValueError for a bad name or a missing config file.

    It wires, on the hub's config ``c``:

    - the managed service ``gpupool``: the hub starts ``gpupool service`` with
      ``--config`` pointing at this very file, so every service setting here
      (``c.GPUPool.*``, ``c.PoolLeases.*``, ..., quotas included) reaches the
      service; it is proxied at ``/services/gpupool/`` and its own hub API
      token is kept in ``STATE_DIR/hub_service_token`` (mode 0600);
    - the custom scopes ``custom:gpupool:use`` (hold leases) and
      ``custom:gpupool:admin`` (see and end everyone's, set quotas);
    - roles: every user (or the members of ``user_groups``) gets
      ``custom:gpupool:use!user`` and access to the service's page; the members of
      ``admin_group`` and ``admin_users`` get ``custom:gpupool:admin``;
    - ``c.Spawner.server_token_scopes`` extended with ``custom:gpupool:use!user``,
      so a single-user server's ``JUPYTERHUB_API_TOKEN``, which its kernels
      inherit, may call the service (the hub grants only what the user holds);
    - ``GPUPOOL_URL`` in the single-user servers' environment: ``public_url``
      (what kernels on other hosts or in pods use) when given, else the address
      the service binds;
    - a ``c.Spawner.post_stop_hook`` (chained after one set before) that asks
      the service to release the leases of a server that stopped (leases record
      the ``JUPYTERHUB_SERVER_NAME`` of the kernel that asked, so with named
      servers the user's other servers keep theirs).
    """
    if not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"service name {name!r} may only hold letters, digits, '-' and '_'")
    config_path = Path(config_file or _caller_file()).resolve()
    if not config_path.is_file():
        raise ValueError(f"config file {config_path} not found; pass configure(c, config_file=__file__)")
    state = Path(state_dir or config_path.parent / "gpupool-state").resolve()
    prefix = f"/services/{name}/"
    url = service_url(ip, port, public_url)
    token = _service_token(state)

    c.GPUPool.base_url = prefix
    c.GPUPool.public_url = url + prefix
    if quotas is not None:
        c.PoolQuotas.quotas = quotas
    service = {
        "name": name,
        "url": url,
        "api_token": token,
        "command": [sys.executable, "-m", "gpupool.cli", "service", f"--config={config_path}",
                    f"--ip={ip}", f"--port={port}", f"--state-dir={state}"],
        # The service reads this same file in its own process, where the hub passes only a few
        # variables: forward GPUPOOL_* so the file computes the same paths and ports there.
        "environment": {**{k: v for k, v in os.environ.items() if k.startswith("GPUPOOL_")}, **(environment or {})},
        "cwd": os.getcwd(),
        "oauth_client_allowed_scopes": [USE_SCOPE, ADMIN_SCOPE],
        "oauth_no_confirm": True,
        "display": True,
        "info": {"description": "GPU pool: nodes, leases, usage and quotas"},
    }
    c.JupyterHub.services.append(service)
    c.JupyterHub.custom_scopes.update(custom_scopes())
    c.JupyterHub.load_roles.extend(roles(name, user_groups=user_groups, admin_group=admin_group,
                                         admin_users=admin_users))
    _extend_server_token_scopes(c)
    c.Spawner.environment.update({"GPUPOOL_URL": url + prefix.rstrip("/")})
    c.Spawner.post_stop_hook = release_on_stop(url + prefix, token, previous=_previous_hook(c), service=name)
    return service


def service_url(ip: str, port: int, public_url: str | None = None) -> str:
    """The service's URL without its prefix (pure): ``public_url`` when given
    (its path dropped: the prefix is added by the caller), else
    ``http://IP:PORT`` with a wildcard ``ip`` read as ``127.0.0.1``. Raises
    ValueError for a ``public_url`` that is not http(s) with a host."""
    if public_url:
        from urllib.parse import urlsplit

        parts = urlsplit(public_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"public_url must be an http:// or https:// URL with a host, got {public_url!r}")
        return f"{parts.scheme}://{parts.netloc}"
    host = "127.0.0.1" if ip in ("", "0.0.0.0") else ip
    return f"http://{host}:{port}"


def custom_scopes() -> dict[str, dict[str, str]]:
    """The two scopes, as ``c.JupyterHub.custom_scopes`` wants them."""
    return {
        USE_SCOPE: {"description": "Hold GPU leases from the gpupool service."},
        ADMIN_SCOPE: {"description": "Administer the gpupool service: all leases, usage and quotas.",
                      "subscopes": [USE_SCOPE]},
    }


def roles(name: str, *, user_groups: Iterable[str] | None, admin_group: str | None,
          admin_users: Iterable[str]) -> list[dict[str, Any]]:
    """The roles (pure). ``user_groups`` None: the hub's default ``user`` role
    (every user) is extended; else a ``gpupool-users`` role for those groups."""
    access = f"access:services!service={name}"
    use = [f"{USE_SCOPE}!user", access]
    result = []
    if user_groups is None:
        result.append({"name": "user", "description": "Standard user privileges, and the GPU pool",
                       "scopes": ["self", *use]})
    else:
        result.append({"name": f"{name}-users", "description": "May hold GPU leases", "scopes": use,
                       "groups": sorted(user_groups)})
    admins = {"name": f"{name}-admin", "description": "Administers the GPU pool",
              "scopes": [ADMIN_SCOPE, USE_SCOPE, access], "users": sorted(admin_users)}
    if admin_group:
        admins["groups"] = [admin_group]
    result.append(admins)
    return result


def release_on_stop(service_url: str, token: str, *, previous=None, timeout: float = 10.0,
                    service: str | None = None):
    """A ``post_stop_hook``: ``POST {service_url}hub/server-stopped`` with
    ``{"user", "server", "other_servers_running"}`` for the server that
    stopped; the service releases that server's leases, and all the user's
    when no other server of theirs runs (``handlers/hub_events.py``).
    Failures are logged, never raised (the leases' heartbeat TTL still ends
    them). ``previous`` (a hook set before) runs first. ``service``: the name
    of the managed service this hub runs it as, if it does: once the hub has
    stopped it (as it shuts down) the failure is an info line, not a warning."""

    async def hook(spawner) -> None:
        if previous is not None:
            result = previous(spawner)
            if hasattr(result, "__await__"):
                await result
        from gpupool.httpout import JSONClient
        from gpupool.wire.hub import ServerStopped

        user = spawner.user
        others = any(s is not spawner and s.active for s in user.spawners.values())
        body = ServerStopped(user.name, spawner.name, others).to_json()
        http = JSONClient()
        try:
            answer = await http.call("POST", service_url + "hub/server-stopped", body, token=token, timeout=timeout)
            if not 200 <= answer.status < 300:  # in tornado's words for an HTTP error
                raise ValueError(f"HTTP {answer.status}: {answer.reason}")
            released = json.loads(answer.body).get("released", [])
            spawner.log.info("gpupool: released %d lease(s) of %s whose server %r stopped", len(released),
                             user.name, spawner.name)
        except (OSError, ValueError) as exc:  # no answer (NoAnswer), a refusal, a reply that is not JSON
            if service is not None and _service_stopped(service):
                spawner.log.info("gpupool: %s's server stopped as the hub shuts down, after the gpupool service "
                                 "(%s); its leases end by their heartbeat TTL", user.name, exc)
            else:
                spawner.log.warning("gpupool: could not tell the service at %s that %s's server stopped (%s); "
                                    "the leases end by their heartbeat TTL", service_url, user.name, exc)
        finally:
            http.close()

    return hook


def _service_stopped(name: str) -> bool:
    """Whether this hub runs service ``name`` as a managed service and has
    stopped it: JupyterHub's shutdown (``JupyterHub.cleanup``) stops its
    managed services before the user servers it cleans up. Read from the
    hub's private ``_service_map`` (no public accessor); False where it is not found."""
    from jupyterhub.app import JupyterHub

    if not JupyterHub.initialized():
        return False
    found = getattr(JupyterHub.instance(), "_service_map", {}).get(name)
    spawner = getattr(found, "spawner", None)
    return bool(getattr(found, "managed", False)) and spawner is not None and not spawner.pid


def _extend_server_token_scopes(c: Any) -> None:
    current = c.Spawner.server_token_scopes if "server_token_scopes" in c.Spawner else None
    if callable(current):
        raise ValueError("c.Spawner.server_token_scopes is a callable; add 'custom:gpupool:use!user' to what "
                         "it returns and call configure() before setting it")
    scopes = list(current) if isinstance(current, (list, tuple)) else list(SERVER_ROLE_SCOPES)
    if f"{USE_SCOPE}!user" not in scopes:
        scopes.append(f"{USE_SCOPE}!user")
    c.Spawner.server_token_scopes = scopes


def _previous_hook(c: Any):
    hook = c.Spawner.post_stop_hook if "post_stop_hook" in c.Spawner else None
    return hook if callable(hook) else None


def _service_token(state: Path) -> str:
    """The service's hub API token, kept in ``STATE_DIR/hub_service_token`` so
    that the hub and the service, which both read the config, agree on it and it
    stays the same across restarts (the hub keeps every token it was given)."""
    return shared_secret(state / "hub_service_token")


def shared_secret(path: str | os.PathLike) -> str:
    """The secret in ``path``, created (random, mode 0600, parent folders
    too) when missing or empty. For secrets that several processes reading
    the same config file must agree on, e.g. ``c.GPUPool.agent_token``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        token = path.read_text().strip()
        if token:
            return token
    token = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def _caller_file() -> str:
    # The config file that called configure(): traitlets runs it with __file__ set.
    frame = sys._getframe(2)
    path = frame.f_globals.get("__file__")
    if not path:
        raise ValueError("cannot tell which config file called configure(); pass config_file=__file__")
    return path
