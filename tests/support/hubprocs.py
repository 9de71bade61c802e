"""A real JupyterHub running ``deploy/jupyterhub/jupyterhub_config.py`` for tests.

The hub runs the example config as it is (configurable-http-proxy, the
``gpupool`` and ``gpupool-agent`` managed services, real single-user
servers), on free ports, with two additions: a ``test-driver`` service whose
token may start and stop servers and make tokens for users, standing in for
the people who would click in a browser; and named servers allowed, so a
user may run several.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jupyter_client import BlockingKernelClient
from traitlets.config.loader import LazyConfigValue

from frontend import run
from gpupool.demo_pool import free_port, stop_process, wait_for

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_CONFIG = ROOT / "deploy" / "jupyterhub" / "jupyterhub_config.py"
CHP_CACHED = ROOT / ".venv" / "chp" / "node_modules" / ".bin" / "configurable-http-proxy"


def chp_path() -> str | None:
    """configurable-http-proxy from PATH or the copy ``make install`` puts under .venv/chp."""
    return shutil.which("configurable-http-proxy") or (str(CHP_CACHED) if CHP_CACHED.exists() else None)


def missing() -> str | None:
    """Why a hub cannot run here, or None."""
    try:
        import jupyterhub  # noqa: F401
        import jupyter_server  # noqa: F401
    except ImportError as exc:
        return f"JupyterHub tests need jupyterhub and jupyter_server installed ({exc}); run `make install`"
    if chp_path() is None:
        return ("JupyterHub tests need configurable-http-proxy: `make install` puts it under .venv/chp "
                "(npm install configurable-http-proxy)")
    return None


@dataclass
class Hub:
    proc: subprocess.Popen
    url: str  # public, through the proxy
    state: Path
    log: Path
    driver_token: str

    def api(self, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
        """A call to ``{url}/hub/api{path}`` (driver token by default); returns (status, JSON or None)."""
        return http(method, f"{self.url}/hub/api{path}", body, token or self.driver_token)

    def user_token(self, user: str) -> str:
        """A new API token of ``user`` with all of the user's permissions."""
        status, body = self.api("POST", f"/users/{user}/tokens", {"note": "gpupool tests", "expires_in": 3600})
        assert status == 201, (status, body)
        return body["token"]

    def start_server(self, user: str) -> None:
        status, body = self.api("POST", f"/users/{user}/server")
        assert status in (201, 202), (status, body)

    def wait_server(self, user: str, ready: bool = True, timeout: float = 90) -> None:
        def settled() -> bool:
            _, model = self.api("GET", f"/users/{user}")
            server = (model.get("servers") or {}).get("")
            if ready:
                return bool(server and server.get("ready"))
            return server is None

        wait_for(settled, timeout, f"{user}'s server {'start' if ready else 'stop'}", self.proc, self.log)

    def stop_server(self, user: str) -> None:
        status, body = self.api("DELETE", f"/users/{user}/server")
        assert status in (202, 204), (status, body)
        self.wait_server(user, ready=False)

    def pool(self, token: str, method: str = "GET", path: str = "/pool", body: Any = None) -> tuple[int, Any]:
        """A call to the gpupool service through the proxy."""
        return http(method, f"{self.url}/services/gpupool/api/v1{path}", body, token)

    def connection_file(self, user: str, kernel_id: str) -> Path:
        """The connection file of a kernel that ``user``'s server started
        (jupyter_server writes it under the user's home, which the spawner set)."""
        path = self.state / "home" / user / ".local/share/jupyter/runtime" / f"kernel-{kernel_id}.json"
        wait_for(path.exists, 30, f"the connection file of kernel {kernel_id}", self.proc, self.log)
        return path

    def stop(self) -> int:
        return stop_process(self.proc, timeout=30)


def http(method: str, url: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if token:
        req.add_header("Authorization", f"token {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def start_hub(root: Path, timeout: float = 90, servers: tuple[str, ...] = ()) -> Hub:
    """Start ``jupyterhub`` with the example config under ``root``; ready once
    the agent's node is registered with the pool service. The ``servers`` of
    these users are asked to start then, and not waited for (use
    :meth:`Hub.wait_server`): single-user servers take a while to start, and
    other tests can run meanwhile."""
    state = root / "hub"
    state.mkdir(parents=True, exist_ok=True)
    driver_token = secrets.token_hex(24)
    overlay = state / "test_config.py"
    overlay.write_text(
        f"c = get_config()\n"
        f"load_subconfig({str(DEPLOY_CONFIG)!r})\n"
        f"c.JupyterHub.allow_named_servers = True\n"
        f"c.JupyterHub.services.append({{'name': 'test-driver', 'api_token': {driver_token!r}}})\n"
        f"c.JupyterHub.load_roles.append({{'name': 'test-driver', 'services': ['test-driver'], 'scopes': "
        f"['admin:users', 'admin:servers', 'tokens', 'list:users', 'read:users']}})\n")
    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "GPUPOOL_HUB_STATE": str(state), "GPUPOOL_HUB_URL": url,
           "GPUPOOL_HUB_API_PORT": str(free_port()), "GPUPOOL_PROXY_API_PORT": str(free_port()),
           "GPUPOOL_SERVICE_PORT": str(free_port()), "GPUPOOL_AGENT_PORT": str(free_port()),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = state / "jupyterhub.log"
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(overlay)], cwd=state, env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    hub = Hub(proc, url, state, log, driver_token)
    try:
        wait_for(lambda: _answers(url), timeout, "jupyterhub", proc, log)
        token = hub.user_token("admin")

        def node_up() -> bool:
            status, body = hub.pool(token)
            return status == 200 and any(n["state"] == "up" for n in body["nodes"])

        wait_for(node_up, timeout, "the gpupool agent under jupyterhub", proc, log)
        for user in servers:
            hub.start_server(user)
    except BaseException:
        hub.stop()
        raise
    return hub


def _answers(url: str) -> bool:
    try:
        status, _ = http("GET", f"{url}/hub/api/")
    except OSError:
        return False
    return status == 200


def resolved(value, initial):
    """A config value as the hub will see it (``configure`` extends lists and dicts lazily)."""
    return value.get_value(initial) if isinstance(value, LazyConfigValue) else value


def open_kernel(hub, user, token, server: str = ""):
    """A gpupool kernel started by ``user``'s server (``server``: a named one; through
    the proxy), and a client of it."""
    prefix = f"{hub.url}/user/{user}/{server}/" if server else f"{hub.url}/user/{user}/"
    status, kernel = http("POST", prefix + "api/kernels", {"name": "gpupool"}, token)
    assert status == 201, (status, kernel)
    kc = BlockingKernelClient()
    kc.load_connection_file(str(hub.connection_file(user, kernel["id"])))
    # No heartbeat channel: without a kernel manager it would declare a slow kernel dead.
    kc.start_channels(hb=False)
    kc.wait_for_ready(timeout=60)
    return kc


def ok(kc, code):
    """Run ``code`` in ``kc``'s kernel; its stdout (the cell must succeed)."""
    cell = run(kc, code, timeout=90)
    assert cell.ok, cell.text()
    return cell.stdout
