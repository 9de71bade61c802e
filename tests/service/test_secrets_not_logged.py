"""Tokens and worker keys never show up in logs or error messages.

A real service and agent, both logging at DEBUG, carry leases through their
life (create, a cell on the worker, heartbeats, an admin's release, the
owner's release) and through refusals (no token, a wrong token, 401, 403,
404 for another user's lease, malformed JSON, impossible requests, an agent
with a wrong token). Then every user, admin and agent token, every token
sent by mistake and every worker connection key is looked for in every
file the two processes wrote (logs, their stderr, worker logs) and in every
error body the API returned. Files that hold a secret by design (token
files, the SQLite store, worker connection files) must be readable by their
owner only.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from gpupool import demo_pool
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest
from procs import ServiceProc, free_port, start_agent, stop_process, wait_for
from workercell import run_worker_cell

USERS = ("ann", "bob", "root")  # root is the admin


class Recorder:
    """Raw HTTP calls to the service, keeping every error body."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.errors: list[tuple[int, str]] = []

    def call(self, method: str, path: str, token: str | None = None, *, raw: bytes | None = None,
             header: str | None = None) -> tuple[int, Any]:
        """``header``: the whole Authorization header (default ``token TOKEN``)."""
        request = urllib.request.Request(self.url + path, data=raw, method=method,
                                         headers={"Content-Type": "application/json"} if raw is not None else {})
        if header or token:
            request.add_header("Authorization", header or f"token {token}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            with exc:
                status, text = exc.code, exc.read().decode()
            self.errors.append((status, text))
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text


def start_debug_service(root: Path, tokens: dict[str, str]) -> ServiceProc:
    """``gpupool service`` at DEBUG log level with ``tokens`` (user -> token), ``root`` an admin."""
    state = root / "service"
    state.mkdir(parents=True)
    config = state / "gpupool_config.py"
    config.write_text("\n".join([
        "c.Application.log_level = 'DEBUG'",
        "c.PoolLeases.reclaim_interval = 0.2",
        "c.PoolNodes.node_heartbeat_interval = 0.2",
        f"c.GPUPool.api_tokens = {({token: user for user, token in tokens.items()})!r}",
        "c.GPUPool.admin_users = {'root'}",
    ]) + "\n")
    return ServiceProc(demo_pool.start_service(state, config_file=config), {"tester": tokens["ann"], **tokens})


def refused_agent(root: Path, service: ServiceProc, token: str) -> None:
    """Run an agent whose token file holds ``token`` (not the agent token) until
    it has logged its refused registration, then stop it."""
    state = root / "agent-refused"
    state.mkdir()
    token_file = state / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    log = state / "agent.log"
    args = [*demo_pool.GPUPOOL, "agent", f"--service-url={service.url}", f"--token-file={token_file}",
            "--name=node-refused", f"--port={free_port()}", f"--state-dir={state}", "--simulate=1xA100-80GB",
            "--log-level=DEBUG"]
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: "registration with" in log.read_text(), 30, "the refused agent's log", proc, log)
    finally:
        stop_process(proc)
    assert "HTTP 401" in log.read_text(), log.read_text()


def written_files(root: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in root.rglob("*") if path.is_file()}


def private(path: Path) -> bool:
    return stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def test_no_token_or_worker_key_in_logs_or_error_messages(tmp_path, monkeypatch):
    tokens = {user: f"{user}-token-{os.urandom(12).hex()}" for user in USERS}
    service = start_debug_service(tmp_path, tokens)
    # Secrets in the agent's environment, which its workers (user code) must not inherit.
    monkeypatch.setenv("GPUPOOL_AGENT_TOKEN", service.agent_token)
    monkeypatch.setenv("SOME_API_TOKEN", tokens["bob"])
    agent = start_agent(tmp_path, service, extra_args=["--log-level=DEBUG"])
    api = Recorder(service.url + "/api/v1")
    ann, admin = service.client("ann"), service.client("root")
    mistaken = [f"wrong-{os.urandom(12).hex()}", tokens["ann"] + "x", f"agent-wrong-{os.urandom(12).hex()}"]
    keys: list[str] = []
    worker_files: dict[Path, bytes] = {}
    connection_files: list[Path] = []
    try:
        # A lease through its life: created, a cell on its worker, heartbeats, reads.
        lease = ann.get_lease(ann.create_lease(LeaseRequest(fraction=0.25)).id, wait=30, state="starting")
        assert lease.state is LeaseState.active and lease.connection["key"]
        keys.append(lease.connection["key"])
        environ = asyncio.run(run_worker_cell(lease.connection, "import os; print(dict(os.environ))"))
        assert "GPUPOOL_LEASE_ID" in environ and "PATH" in environ
        assert tokens["bob"] not in environ and service.agent_token not in environ, "user code sees no token"
        ann.heartbeat(lease.id)
        ann.list_leases()
        # The worker's own files exist only while it runs: keep them for the scan.
        worker_files = {path: data for path, data in written_files(agent.state_dir).items() if "workers" in path.parts}
        connection_files = [path for path in worker_files if path.suffix == ".json" and b'"key"' in worker_files[path]]
        assert connection_files and all(private(path) for path in connection_files)

        # The key goes to the owner only: not to an admin, not to another user.
        status, seen_by_admin = api.call("GET", f"/leases/{lease.id}", tokens["root"])
        assert status == 200 and seen_by_admin["connection"] is None
        for method, path in [("GET", f"/leases/{lease.id}"), ("DELETE", f"/leases/{lease.id}"),
                             ("POST", f"/leases/{lease.id}/heartbeat")]:
            assert api.call(method, path, tokens["bob"])[0] == 404

        # Refusals, with every kind of token sent wrong.
        assert api.call("GET", "/leases")[0] == 401
        for token in mistaken:
            assert api.call("GET", "/leases", token)[0] == 401
            assert api.call("POST", "/nodes", token, raw=b"{}")[0] == 401
        assert api.call("GET", "/leases", header=f"Basic {tokens['ann']}")[0] == 401
        assert api.call("GET", f"/leases?token={tokens['ann']}")[0] == 401
        assert api.call("GET", "/leases", service.agent_token)[0] == 403
        assert api.call("POST", "/nodes", tokens["ann"], raw=b"{}")[0] == 403
        assert api.call("GET", "/admin/quotas", tokens["ann"])[0] == 403
        assert api.call("POST", "/leases", tokens["ann"], raw=b'{"fraction": 0.5,')[0] == 400
        assert api.call("POST", "/leases", tokens["ann"], raw=json.dumps({"fraction": 1.5}).encode())[0] == 400
        assert api.call("POST", "/leases", tokens["ann"], raw=json.dumps({"memory": 200 * 2**30}).encode())[0] == 400
        assert api.call("GET", "/leases/L-000000000000", tokens["ann"])[0] == 404
        refused_agent(tmp_path, service, mistaken[2])

        # An admin's release of another lease, then the owner's release of the first.
        second = ann.get_lease(ann.create_lease(LeaseRequest(fraction=0.25)).id, wait=30, state="starting")
        keys.append(second.connection["key"])
        assert admin.release(second.id).reason == "released by admin root"
        assert ann.release(lease.id).state is LeaseState.released
    finally:
        agent.stop()
        service.stop()

    secrets = {**{f"{user}'s token": token for user, token in tokens.items()}, "the agent token": service.agent_token,
               **{f"mistaken token {i}": token for i, token in enumerate(mistaken)},
               **{f"worker key {i}": key for i, key in enumerate(keys)}}
    # The test's own config file and token file, the agent token, worker connection files.
    by_design = {service.state_dir / "agent_token", service.state_dir / "gpupool_config.py",
                 tmp_path / "agent-refused" / "token", *connection_files}
    store = sorted(service.state_dir.glob("gpupool.sqlite*"))
    assert store and all(private(path) for path in [*store, service.state_dir / "agent_token"]), \
        {path.name: oct(path.stat().st_mode) for path in store}
    scanned = {path: data for path, data in {**written_files(tmp_path), **worker_files}.items()
               if path not in by_design and path not in store}
    logs = [path.name for path in scanned]
    assert {"service.log", "agent.log"} <= set(logs) and any(path.parent.name == "workers" for path in scanned), logs
    assert b"[D " in scanned[service.log] and b"/heartbeat" in scanned[service.log], "the service logged at DEBUG"
    assert b" DEBUG " in scanned[agent.log], "the agent logged at DEBUG"
    leaks = [(what, str(path)) for path, data in scanned.items() for what, secret in secrets.items()
             if secret.encode() in data]
    leaks += [(what, f"HTTP {status} body") for status, body in api.errors for what, secret in secrets.items()
              if secret in body]
    assert leaks == []
    assert len(api.errors) == 19, api.errors  # every refusal above was checked
