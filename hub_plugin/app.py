"""``gpupool service``: the pool service as a traitlets application.

    gpupool service [--ip=127.0.0.1] [--port=8765] [--state-dir=.state/service]
                    [--config=gpupool_config.py] [--PoolLeases.idle_timeout=10m ...]
                    [--ssl-cert=tls.crt --ssl-key=tls.key] [--ca-file=ca.crt]

Start-up: read the config file, prepare the state directory (tokens, SQLite
file), bring the store to the latest migration, listen, write
``STATE_DIR/service.json`` (``{"url", "pid"}``, atomically: tests and tools
wait for it), resume leases a previous run left starting or releasing, and
run the reclaim loop. SIGTERM or SIGINT stop it cleanly (exit 0); leases are
kept as they are, and the next start continues with them.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import logging
import os
import secrets
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

from sqlalchemy.exc import SQLAlchemyError
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets
from traitlets import Integer, TraitError, Unicode, default
from traitlets.config import Application, Config

from gpupool import __version__, httpin
from gpupool.config_files import load_config_file
from gpupool.errors import GPUPoolError, Reason
from gpupool.moved_settings import carry_moved, new_homes
from gpupool.statedir import lock_state_dir
from gpupool.tls import server_context

from .agent_client import AgentClient
from .auth import TokenAuthenticator
from .config import GPUPool, PoolLeases, PoolNodes, PoolPressure, PoolQuotas, ServiceSettings
from .db import Store
from .handlers import health, leases as lease_handlers, metrics as metric_handlers, nodes as node_handlers
from .handlers import openapi as openapi_handlers, pool as pool_handlers
from .handlers import admin_page, hub_events
from . import hub_service
from .handlers import admin as admin_handlers, quota as quota_handlers
from .handlers.base import NotFoundHandler, ServiceContext
from .metrics import Metrics
from .pool import Pool
from .store_claim import claim
from .storework import StoreWork

log = logging.getLogger("gpupool.service")

ROUTES = (hub_events.routes + lease_handlers.routes + node_handlers.routes + pool_handlers.routes + health.routes
          + openapi_handlers.routes + metric_handlers.routes + quota_handlers.routes + admin_handlers.routes)


class ServiceApp(Application):
    """The pool service: REST API, scheduler, idle reclaim, SQL store."""

    name = "gpupool-service"
    version = __version__
    description = "The gpupool pool service: hands out slices of pooled GPUs to notebook kernels."
    classes = [GPUPool, PoolNodes, PoolLeases, PoolPressure, PoolQuotas]
    # A broken config file stops the service instead of being skipped.
    raise_config_file_errors = True
    aliases = {
        "ip": "ServiceApp.ip",
        "port": "ServiceApp.port",
        "state-dir": "ServiceApp.state_dir",
        "config": "ServiceApp.config_file",
        "ssl-cert": "GPUPool.ssl_cert",
        "ssl-key": "GPUPool.ssl_key",
        "ca-file": "GPUPool.ca_file",
        "log-level": "Application.log_level",
    }

    ip = Unicode("127.0.0.1", help="Address to listen on. Default: 127.0.0.1.").tag(config=True)
    port = Integer(8765, min=0, max=65535,
                   help="Port to listen on (0: any free port). Default: 8765.").tag(config=True)
    state_dir = Unicode(
        ".state/service",
        help="""Directory for the SQLite store, the token files and service.json;
        created if missing. Default: ``.state/service``.""").tag(config=True)
    config_file = Unicode(
        "", help="""Python config file (``gpupool_config.py`` or ``jupyterhub_config.py``)
        setting ``c.GPUPool.*``, ``c.PoolNodes.*``, ``c.PoolLeases.*``, ``c.PoolPressure.*``
        and ``c.PoolQuotas.*``. Default: none.""").tag(config=True)

    def update_config(self, config: Config) -> None:
        """Take ``config`` (the command line's, then the config file's): a
        setting of another class written ``c.GPUPool.NAME`` is read as that
        class's (:func:`gpupool.moved_settings.carry_moved`), with a warning."""
        carry_moved(config, "GPUPool", new_homes([PoolNodes, PoolLeases, PoolPressure, PoolQuotas]), self.log.warning)
        super().update_config(config)

    @default("log_level")
    def _log_level_default(self) -> int:
        return logging.INFO

    def initialize(self, argv: list[str] | None = None) -> None:
        super().initialize(argv)
        if self.config_file:
            # load_config_file keeps the command line above the file; one line for a file that fails.
            load_config_file(self, Path(self.config_file).expanduser().resolve())
        _setup_logging(self.log_level)
        self.settings = _settings(self)

    def start(self) -> int:
        """Run until SIGTERM/SIGINT; returns the exit code."""
        return asyncio.run(self._serve())

    async def _serve(self) -> int:
        service = self.settings.service  # c.GPUPool: store, URL, TLS, tokens
        # A bad certificate stops the start before anything is written.
        tls = server_context(service.ssl_cert, service.ssl_key, "--ssl-cert / --ssl-key")
        state = Path(self.state_dir).expanduser().resolve()
        with _state_dir_errors(state):
            state.mkdir(parents=True, exist_ok=True)
            self._lock_fd = lock_state_dir(state, "service")  # one service per state dir: it decides in memory
            info_file = state / "service.json"
            info_file.unlink(missing_ok=True)  # a stale one would point at a dead service
            agent_token = _secret_file(state / "agent_token", service.agent_token)
            user_tokens = dict(service.api_tokens)
            hint = {}  # the 401's words: where users get a token (a token of c.GPUPool.api_tokens, by default)
            if not user_tokens and not hub_service.in_jupyterhub(os.environ):
                hint = {"token_hint": "the token in the service's STATE_DIR/user_token"}
                user = getpass.getuser()
                user_tokens = {_secret_file(state / "user_token", ""): user}
                log.info("no c.GPUPool.api_tokens: the token of user %s is in %s", user, state / "user_token")
            store = Store(service.db_url.replace("{state_dir}", str(state)))
        metrics_token = _read_token_file(service.metrics_token_file, "c.GPUPool.metrics_token_file")
        web_settings: dict = {}
        if hub_service.in_jupyterhub(os.environ):
            authenticator, web_settings = hub_service.authentication(agent_token, service.base_url,
                                                                     service.hub_auth_cache_max_age)
        else:
            authenticator = TokenAuthenticator(user_tokens, service.admin_users, agent_token, **hint)

        log.info("store: %s", store.describe())
        held = claim(store)  # one service per store, before the schema is touched
        try:
            store.migrate()
        except GPUPoolError as exc:  # a schema this release does not know: its own words, not the URL's
            raise GPUPoolError(exc.code, f"the store at {store.describe()}: {exc.message}") from None
        except SQLAlchemyError as exc:
            reason = getattr(exc, "orig", None) or exc
            raise GPUPoolError(Reason.store_unavailable, f"cannot open the store at {store.describe()} ({reason}); "
                               "check c.GPUPool.db_url") from None
        metrics = Metrics(store, self.settings.nodes.context_overhead)
        agents = AgentClient(agent_token, ca_file=service.ca_file)
        work = StoreWork()  # every SQL statement from here on runs on its threads, none on the event loop
        pool = Pool(self.settings, store, agents, on_refusal=metrics.refused, on_dequeued=metrics.dequeued,
                    on_parked=metrics.parked, on_resumed=metrics.resumed, work=work)
        ctx = ServiceContext(settings=self.settings, pool=pool, metrics=metrics,
                             authenticator=authenticator, metrics_token=metrics_token)
        app = make_web_app(ctx, **web_settings)

        try:
            sockets = bind_sockets(self.port, self.ip)
        except OSError as exc:
            log.error("cannot listen on %s:%s (%s); choose another --port", self.ip, self.port, exc)
            return 1
        # Bodies of at most 1 MiB, read only once the token was checked; stalled connections closed (httpin).
        server = HTTPServer(app, ssl_options=tls, **httpin.server_options(service.request_header_timeout,
                                                                           service.request_body_timeout))
        server.add_sockets(sockets)
        scheme, port = "https" if tls else "http", sockets[0].getsockname()[1]
        url = _url(self.ip, port, scheme)
        public = service.public_url or url.rstrip("/") + service.base_url  # what kernels and agents use
        with _state_dir_errors(state):
            _write_atomically(info_file, json.dumps({"url": url, "public_url": public, "pid": os.getpid()}))
        bound = url if self.ip not in ("", "0.0.0.0", "::") else \
            f"{scheme}://{'[::]' if self.ip == '::' else '0.0.0.0'}:{port}"
        log.info("gpupool service %s listening on %s (state in %s); kernels and agents use %s", __version__, bound,
                 state, public)
        if public.startswith("http://") and urlsplit(public).hostname not in ("127.0.0.1", "localhost", "::1"):
            log.warning("kernels and agents reach this service over plain HTTP at %s: tokens cross the network "
                        "unencrypted; serve HTTPS (--ssl-cert/--ssl-key) and make c.GPUPool.public_url https://",
                        public)

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await pool.resume()
        reclaimer = pool.reclaimer()
        reclaimer.start()
        await stop.wait()

        log.info("stopping; leases are kept and resumed at the next start")
        server.stop()  # no new connections
        await reclaimer.stop()
        await pool.shutdown()
        await asyncio.sleep(0.1)  # let woken long polls write their answers
        await server.close_all_connections()
        agents.close()
        work.close()
        held.release()
        store.close()
        info_file.unlink(missing_ok=True)
        return 0


def _settings(app: ServiceApp) -> ServiceSettings:
    """The service's settings, one of each class read from ``app``'s config; a
    bad value (or two that disagree, such as an ``idle_timeout`` above
    ``max_idle_timeout``) is a GPUPoolError naming it (``gpupool`` prints it and
    exits 1), not a traceback."""
    where = app.config_file or "the command line"
    try:
        return ServiceSettings.configured(app)
    except TraitError as exc:
        raise GPUPoolError(Reason.not_configured, f"{exc} (set in {where})") from None


def make_web_app(ctx: ServiceContext, **extra: Any) -> web.Application:
    """The tornado application with every route under ``base_url``."""
    prefix = ctx.settings.service.base_url
    # The admin page (and its OAuth callback) exist only under JupyterHub (``hub_auth`` in ``extra``).
    page = admin_page.routes_for(extra.get("hub_auth"))
    routes = [(prefix + path.lstrip("/"), handler) for path, handler in [*ROUTES, *page]]
    return web.Application(routes, gpupool=ctx, default_handler_class=NotFoundHandler,
                           log_function=_log_request, **extra)


def _log_request(handler: web.RequestHandler) -> None:
    """Access log: errors loud, routine calls (heartbeats, polls) at debug."""
    status = handler.get_status()
    request = handler.request
    if status >= 500:
        level = logging.ERROR
    elif status >= 400 or (request.method != "GET" and not request.path.endswith("/heartbeat")):
        level = logging.INFO
    else:
        level = logging.DEBUG
    logging.getLogger("gpupool.service.access").log(
        level, "%d %s %s %.1fms", status, request.method, request.path, 1000 * request.request_time())


def _secret_file(path: Path, configured: str) -> str:
    """The token to use: ``configured`` if set, else the one in ``path``, else
    a new one; always (re)written to ``path`` with mode 0600."""
    token = configured
    if not token and path.exists():
        token = path.read_text().strip()
    token = token or secrets.token_hex(32)
    _write_atomically(path, token + "\n", mode=0o600)
    return token


def _write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``path`` through a temporary file beside it; on any failure the
    temporary file is removed (and the OSError raised)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # a full disk shows here, not after the rename
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def _state_dir_errors(state: Path) -> Iterator[None]:
    """An OSError preparing the state directory (read-only, full, not ours)
    becomes a GPUPoolError naming the path and the fix (printed in one line)."""
    try:
        yield
    except OSError as exc:
        where = exc.filename or state
        raise GPUPoolError(Reason.not_configured, f"cannot write the state directory {state} ({exc.strerror or exc} at "
                           f"{where}); make it writable by user {getpass.getuser()} with free space, or "
                           "choose another with --state-dir") from None


def _read_token_file(path: str, setting: str) -> str:
    """The token in ``path`` ("" when ``path`` is ""); GPUPoolError naming ``setting`` when it cannot be read."""
    if not path:
        return ""
    try:
        token = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise GPUPoolError(Reason.not_configured, f"cannot read {setting} {path} ({exc.strerror}); create it with one "
                           "token in it (e.g. `openssl rand -hex 32 > FILE; chmod 600 FILE`)") from None
    if not token:
        raise GPUPoolError(Reason.not_configured, f"{setting} {path} is empty; put one token in it")
    return token


def _url(ip: str, port: int, scheme: str = "http") -> str:
    host = "127.0.0.1" if ip in ("", "0.0.0.0") else "[::1]" if ip == "::" else ip
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def _setup_logging(level: int | str) -> None:
    """Log lines for an admin on stderr: ``[I 2026-11-29 17:00:00 gpupool.service.leases] ...``."""
    logger = logging.getLogger("gpupool")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(levelname)1.1s %(asctime)s %(name)s] %(message)s",
                                               "%Y-%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gpupool service``; returns the exit code."""
    app = ServiceApp()
    app.initialize(argv)
    return app.start()
