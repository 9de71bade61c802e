"""A JupyterHub with a GPU pool, on one machine (see README.md beside this file).

    jupyterhub -f deploy/jupyterhub/jupyterhub_config.py

Users ann (group physics), bob (group chemistry) and admin (group gpu-admins,
a hub and pool admin) log in with any password (DummyAuthenticator). Each gets a single-user server
(SimpleLocalProcessSpawner: servers run as the hub's OS user, homes under the
state directory) with the "Python 3 (gpupool)" kernel. The pool service runs
as the managed service ``gpupool`` (``/services/gpupool/``: the admin page,
``/services/gpupool/metrics``), and one node agent with two simulated A100s as
the managed service ``gpupool-agent``.

Ports and places come from the environment, so tests can run it too:
GPUPOOL_HUB_STATE (state directory, default ``./gpupool-hub-state``),
GPUPOOL_HUB_URL (public URL, default ``http://127.0.0.1:8000``),
GPUPOOL_HUB_API_PORT (hub API, 8081), GPUPOOL_PROXY_API_PORT (proxy API, 8001),
GPUPOOL_SERVICE_PORT (pool service, 8765), GPUPOOL_AGENT_PORT (agent, 8766),
GPUPOOL_SIMULATE (the agent's GPUs, ``2xA100-80GB``).
"""

import os
import shutil
import sys
from pathlib import Path

from gpupool.hub_plugin.hub import configure, shared_secret
from gpupool.magics.kernelspec import install as install_kernelspec

c = get_config()  # noqa: F821 (traitlets provides it)

env = os.environ.get
state = Path(env("GPUPOOL_HUB_STATE", "gpupool-hub-state")).resolve()
state.mkdir(parents=True, exist_ok=True)
service_port = int(env("GPUPOOL_SERVICE_PORT", "8765"))

# -- the hub -----------------------------------------------------------------------------------
c.JupyterHub.bind_url = env("GPUPOOL_HUB_URL", "http://127.0.0.1:8000")
c.JupyterHub.hub_bind_url = f"http://127.0.0.1:{env('GPUPOOL_HUB_API_PORT', '8081')}"
c.JupyterHub.db_url = f"sqlite:///{state}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{env('GPUPOOL_PROXY_API_PORT', '8001')}"
c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")
# configurable-http-proxy from PATH, or the copy `make install` puts under .venv/chp.
_chp = shutil.which("configurable-http-proxy") or str(
    Path(__file__).resolve().parents[2] / ".venv/chp/node_modules/.bin/configurable-http-proxy")
c.ConfigurableHTTPProxy.command = [_chp]

# -- users and groups ----------------------------------------------------------------------------
c.JupyterHub.authenticator_class = "dummy"
# Any password is accepted (a demo; use PAMAuthenticator or OAuth for real users).
c.Authenticator.allowed_users = {"ann", "bob", "admin"}
c.Authenticator.admin_users = {"admin"}
c.JupyterHub.load_groups = {
    "physics": {"users": ["ann"]},
    "chemistry": {"users": ["bob"]},
    "gpu-admins": {"users": ["admin"]},
}

# -- single-user servers ---------------------------------------------------------------------
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = str(state / "home" / "{username}")
c.Spawner.cmd = [str(Path(sys.executable).with_name("jupyterhub-singleuser"))]
if os.geteuid() == 0:
    c.Spawner.args = ["--allow-root"]  # jupyter_server refuses to run as root otherwise
c.Spawner.default_url = "/lab"  # JupyterLab (classic Notebook's /tree is a 404 on a server without it)
c.Spawner.start_timeout = 60
c.Spawner.http_timeout = 60
# The "Python 3 (gpupool)" kernelspec, without URL or token: kernels take GPUPOOL_URL
# (set by configure below) and the server's JUPYTERHUB_API_TOKEN from their environment.
_kernels = state / "jupyter"
if not (_kernels / "share/jupyter/kernels/gpupool/kernel.json").exists():
    install_kernelspec(prefix=str(_kernels))
c.Spawner.environment = {"JUPYTER_PATH": str(_kernels / "share/jupyter")}

# -- the pool: service, scopes, roles, server tokens, stop hook, quotas ------------------------------
c.GPUPool.agent_token = shared_secret(state / "pool" / "agent_token.conf")
c.PoolLeases.heartbeat_ttl = "60s"
configure(
    c,
    port=service_port,
    state_dir=state / "pool",
    admin_group="gpu-admins",
    quotas={
        "*": {"max_gpus": 0.5, "gpu_hours_per_day": 8},
        "group:physics": {"max_gpus": 1.0},
        "group:gpu-admins": {"max_gpus": 2.0},
    },
)

# -- a node agent with simulated GPUs, started and stopped by the hub ----------------------------
c.JupyterHub.services.append({
    "name": "gpupool-agent",
    "command": [sys.executable, "-m", "gpupool.cli", "agent",
                f"--service-url=http://127.0.0.1:{service_port}/services/gpupool",
                f"--token-file={state / 'pool' / 'agent_token.conf'}",
                f"--simulate={env('GPUPOOL_SIMULATE', '2xA100-80GB')}", "--name=node-1",
                f"--port={env('GPUPOOL_AGENT_PORT', '8766')}", f"--state-dir={state / 'agent'}"],
})
