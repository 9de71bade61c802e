"""The hub example (deploy/jupyterhub/) sends users to a page their single-user server has:
``c.Spawner.default_url`` is asked of a real Jupyter server of this environment (JupyterLab's
server extension loaded as the hub's ``jupyterhub-singleuser`` loads it), which must answer 200.
It was ``/tree``, classic Notebook's page, which a JupyterLab-only server answers 404."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from procs import free_port, stop_process, wait_for

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "jupyterhub"


def default_url() -> str:
    """``c.Spawner.default_url`` as the example config sets it (read, not run: running it starts nothing
    but writes the hub's state)."""
    for node in ast.walk(ast.parse((DEPLOY / "jupyterhub_config.py").read_text())):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "c.Spawner.default_url":
            return ast.literal_eval(node.value)
    raise AssertionError("deploy/jupyterhub/jupyterhub_config.py sets no c.Spawner.default_url")


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code
    except OSError:
        return 0


def test_the_example_sends_users_to_a_page_their_server_has(tmp_path):
    pytest.importorskip("jupyterlab", reason="the example's servers run JupyterLab (pip install jupyterlab)")
    landing = default_url()
    assert f"the hub sends users to `{landing}`" in (DEPLOY / "README.md").read_text()
    port, token = free_port(), "landing-test-token"
    log = tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "jupyter_server", "--no-browser", f"--port={port}",
                                   "--ip=127.0.0.1", f"--ServerApp.root_dir={tmp_path}",
                                   f"--IdentityProvider.token={token}",
                                   *(["--allow-root"] if os.geteuid() == 0 else [])],  # as the example does
                                  stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp_path,
                                  env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
                                       "JUPYTER_CONFIG_DIR": str(tmp_path / "config")})
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: status(f"{base}/api/status?token={token}") == 200, 60, "the Jupyter server", server, log)
        assert status(f"{base}{landing}?token={token}") == 200, log.read_text()[-2000:]
    finally:
        stop_process(server)
