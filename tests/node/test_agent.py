"""The node agent as a real process: its HTTP API, registration and shutdown.

The first group runs an agent whose service is not there (it keeps retrying
its registration and serves the service's calls all the same); the second
uses the real ``gpupool service`` from ``conftest``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent_api import TOKEN, call
from gpupool.errors import GPUPoolError
from gpupool.node.inventory.simulated import simulated_uuid
from procs import free_port, processes_mentioning, stop_process, wait_for
from workercell import run_worker_cell

GiB = 1024**3
needs_service = pytest.mark.skipif(importlib.util.find_spec("gpupool.hub_plugin.app") is None,
                                   reason="gpupool service (hub_plugin/app.py) not built yet")


class LoneAgent:
    """``gpupool agent`` with its token in GPUPOOL_AGENT_TOKEN and no service."""

    def __init__(self, root: Path, name: str = "lone", relative: bool = False, simulate: str | None = "2xA100-80GB",
                 args: tuple[str, ...] = ()) -> None:
        """``relative``: run in ``root`` and pass ``--state-dir`` as a relative path (as the README does).
        ``simulate``: its ``--simulate`` (None: none on the command line); ``args``: more options."""
        self.name = name
        self.state_dir = root / f"agent-{name}"
        self.state_dir.mkdir(parents=True)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = self.state_dir / "agent.log"
        self.gpus = [simulated_uuid(name, 0), simulated_uuid(name, 1)]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpupool.cli", "agent", f"--service-url=http://127.0.0.1:{free_port()}",
                 *([f"--simulate={simulate}"] if simulate else []), f"--name={name}", "--ip=127.0.0.1",
                 f"--port={port}", f"--state-dir={self.state_dir.name if relative else self.state_dir}", *args],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=root,
                env={**os.environ, "GPUPOOL_AGENT_TOKEN": TOKEN, "SOME_SERVICE_PASSWORD": "hunter2"})
        wait_for(self.healthy, 30, "lone agent", self.proc, self.log)

    def healthy(self) -> bool:
        try:
            return call(f"{self.url}/health", token=None) == (200, {"status": "ok", "node": self.name})
        except OSError:
            return False

    def start_worker(self, lease_id: str, gpus: list[str] | None = None, fraction: float = 0.5) -> tuple[int, Any]:
        return call(f"{self.url}/workers", "POST", {"lease_id": lease_id, "owner": "ann", "gpus": gpus or self.gpus[:1],
                                                    "fraction": fraction, "memory": 40 * GiB})

    def stop(self) -> int:
        code = stop_process(self.proc)
        assert not processes_mentioning(str(self.state_dir)), "the agent left workers behind"
        return code


@pytest.fixture
def lone_agent(tmp_path):
    agent = LoneAgent(tmp_path)
    yield agent
    agent.stop()


def test_agent_api_needs_the_agent_token(lone_agent):
    for method, path in [("GET", "/workers"), ("POST", "/workers"), ("DELETE", "/workers/L-1")]:
        for token in (None, "wrong-token"):
            status, body = call(f"{lone_agent.url}{path}", method, {} if method == "POST" else None, token=token)
            assert status == 401, (method, path, token)
            assert body["error"] == "unauthorized" and "agent token" in body["message"]
    assert call(f"{lone_agent.url}/workers") == (200, {"workers": []})


@pytest.mark.parametrize("body, words", [
    ([], "JSON object"),
    ({"lease_id": "L-1", "owner": "ann", "gpus": ["GPU-nope"], "fraction": 0.5}, "unknown: GPU-nope"),
    ({"lease_id": "L-1", "owner": "ann", "gpus": [], "fraction": 0.5}, "non-empty list"),
    ({"lease_id": "L-1", "owner": "ann", "gpus": "GPU", "fraction": 0.5}, "non-empty list"),
    ({"lease_id": "../x", "owner": "ann", "gpus": None, "fraction": 2}, "non-empty list"),
    ({"lease_id": "L-1", "owner": "", "gpus": None}, "'owner'"),
])
def test_bad_worker_requests_get_400(lone_agent, body, words):
    status, reply = call(f"{lone_agent.url}/workers", "POST", body)
    assert status == 400 and reply["error"] == "bad_request"
    assert words in reply["message"]


def test_bad_values_get_400(lone_agent):
    for change, words in [({"fraction": 1.5}, "'fraction'"), ({"memory": 10**15}, "'memory'"),
                          ({"lease_id": "../etc"}, "lease id"), ({"gpus": [lone_agent.gpus[0]] * 2}, "distinct")]:
        body = {"lease_id": "L-1", "owner": "ann", "gpus": lone_agent.gpus[:1], "fraction": 0.5, **change}
        status, reply = call(f"{lone_agent.url}/workers", "POST", body)
        assert status == 400, change
        assert words in reply["message"]
    status, reply = call(f"{lone_agent.url}/nothing-here")
    assert status == 404 and reply["error"] == "not_found"


def test_start_use_and_stop_a_worker_over_http(lone_agent):
    status, started = lone_agent.start_worker("L-0000000000aa", gpus=lone_agent.gpus, fraction=1)
    assert status == 201, started
    connection = started["connection"]
    assert connection["ip"] == "127.0.0.1" and connection["key"]
    env = json.loads(asyncio.run(run_worker_cell(connection, "import os, json; print(json.dumps(dict(os.environ)))")))
    assert env["GPUPOOL_LEASE_ID"] == "L-0000000000aa"
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(lone_agent.gpus)
    assert env["GPUPOOL_NODE"] == "lone"
    assert "GPUPOOL_AGENT_TOKEN" not in env and "SOME_SERVICE_PASSWORD" not in env
    assert TOKEN not in json.dumps(env)

    again_status, again = lone_agent.start_worker("L-0000000000aa")  # idempotent
    assert (again_status, again["pid"]) == (201, started["pid"])
    # The agent hears the worker go idle after the cell's reply reached us: wait for it, under load too.
    states = lambda: [(w["lease_id"], w["pid"], w["execution_state"])  # noqa: E731
                      for w in call(f"{lone_agent.url}/workers")[1]["workers"]]
    wait_for(lambda: states() == [("L-0000000000aa", started["pid"], "idle")], 10, "the worker idle in the listing")

    assert call(f"{lone_agent.url}/workers/L-0000000000aa", "DELETE") == (
        200, {"lease_id": "L-0000000000aa", "exit_code": 0})
    assert not psutil.pid_exists(started["pid"]) or psutil.Process(started["pid"]).status() == psutil.STATUS_ZOMBIE
    status, reply = call(f"{lone_agent.url}/workers/L-0000000000aa", "DELETE")
    assert status == 404 and reply["error"] == "not_found"
    assert TOKEN not in lone_agent.log.read_text()


def test_a_relative_state_dir_works_for_workers_started_elsewhere(tmp_path):
    # Workers start in folders of their own; with --state-dir=.state/agent-1 (the README's) their
    # history database path was relative and every worker exited at start.
    agent = LoneAgent(tmp_path, relative=True)
    try:
        status, started = agent.start_worker("L-0000000000rel")
        assert status == 201, started
        out = asyncio.run(run_worker_cell(started["connection"], "print(6 * 7)"))
        assert out.strip() == "42"
        assert (agent.state_dir / "workers" / "L-0000000000rel.history.sqlite").exists()
    finally:
        agent.stop()


def test_killed_worker_is_reported_dead(lone_agent):
    status, started = lone_agent.start_worker("L-dies")
    assert status == 201
    os.kill(started["pid"], signal.SIGKILL)

    def dead():
        [worker] = call(f"{lone_agent.url}/workers")[1]["workers"]
        return worker if worker["execution_state"] == "dead" else None

    assert wait_for(dead, 10, "dead worker report")["exit_code"] == -9
    assert call(f"{lone_agent.url}/workers/L-dies", "DELETE") == (200, {"lease_id": "L-dies", "exit_code": -9})


def test_sigterm_stops_every_worker(tmp_path):
    agent = LoneAgent(tmp_path, name="lone")
    pids = [agent.start_worker(lease)[1]["pid"] for lease in ("L-one", "L-two")]
    assert set(pids) <= set(processes_mentioning(str(agent.state_dir)))
    assert agent.stop() == 0  # asserts nothing under its state dir is left
    assert "stopping: shutting down 2 worker(s)" in agent.log.read_text()


def run_agent_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpupool.cli", "agent", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_agent_command_line_errors_are_one_clear_line(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("t\n")
    result = run_agent_cli("--service-url=http://127.0.0.1:1", f"--token-file={token_file}", "--simulate=9xB300")
    assert result.returncode == 1
    assert "unknown GPU model 'B300'" in result.stderr and "Traceback" not in result.stderr
    result = run_agent_cli("--service-url=http://127.0.0.1:1", f"--token-file={tmp_path / 'missing'}",
                           "--simulate=A100-80GB")
    assert result.returncode == 1 and "cannot read the agent token file" in result.stderr
    result = run_agent_cli("--simulate=A100-80GB", env={"GPUPOOL_AGENT_TOKEN": "x"})
    assert result.returncode == 1 and "--service-url" in result.stderr
    result = run_agent_cli("--help")
    assert result.returncode == 0 and "--simulate" in result.stdout and "--token-file" in result.stdout


def test_help_all_lists_each_setting_under_its_own_class():
    from gpupool.moved_settings import new_homes
    from gpupool.node.agent import SETTINGS_PARTS

    result = run_agent_cli("--help-all")
    assert result.returncode == 0, result.stderr
    assert "--AgentWorkers.warm_workers=<Int>" in result.stdout and "--NodeAgent.service_url=" in result.stdout
    for name, home in new_homes(SETTINGS_PARTS).items():
        assert f"--{home}.{name}=" in result.stdout
        assert f"--NodeAgent.{name}=" not in result.stdout, f"{name} is shown under NodeAgent too"
    for launcher in ("SlurmLauncher", "KubernetesLauncher"):
        assert f"{launcher}(LoggingConfigurable) options" in result.stdout


def test_a_config_file_with_the_old_spelling_still_configures_the_agent(tmp_path):
    """The old spellings ``c.NodeAgent.simulate`` and ``c.NodeAgent.warm_workers`` in a config file
    reach ``c.AgentInventory`` and ``c.AgentWorkers``: the agent serves the simulated GPU the file
    names (no ``--simulate``: NVML otherwise, which has no GPU here), starts a lease's worker cold,
    and its log names the new spellings."""
    config = tmp_path / "gpupool_config.py"
    config.write_text('c.NodeAgent.simulate = "1xA100-80GB"\nc.NodeAgent.warm_workers = 0\n')
    agent = LoneAgent(tmp_path, name="old", simulate=None, args=(f"--config={config}",))
    try:
        request = urllib.request.Request(f"{agent.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            metrics = response.read().decode()
        assert f'UUID="{simulated_uuid("old", 0)}"' in metrics and f'UUID="{simulated_uuid("old", 1)}"' not in metrics
        assert agent.start_worker("L-old", gpus=[simulated_uuid("old", 0)])[0] == 201
        log = agent.log.read_text()
        assert "worker for lease L-old of ann started cold" in log, log
        assert "warm worker" not in log
        for name, home in (("simulate", "AgentInventory"), ("warm_workers", "AgentWorkers")):
            assert f"c.NodeAgent.{name} is now c.{home}.{name}; the old spelling is read for now" in log
    finally:
        assert agent.stop() == 0


def test_an_old_spelling_on_the_command_line_or_in_a_config_file_reaches_the_agents_parts(tmp_path, monkeypatch,
                                                                                          caplog):
    """In process: each moved setting lands in its part, from a config file or the command line;
    where both spellings are given, the new one wins."""
    import logging

    from gpupool.node.agent import NodeAgent

    monkeypatch.setenv("GPUPOOL_AGENT_TOKEN", "t")
    monkeypatch.setenv("GPUPOOL_SIMGPU_ROOT", str(tmp_path / "simgpu"))
    config = tmp_path / "gpupool_config.py"
    config.write_text('c.NodeAgent.parked_memory = "3GiB"\nc.NodeAgent.cgroup_mode = "none"\n'
                      'c.NodeAgent.warm_workers = 5\nc.NodeAgent.port = 0\n')
    app = NodeAgent()
    app.log = logging.getLogger("test-old-spellings")
    app.initialize(["--service-url=http://127.0.0.1:1", "--simulate=1xA100-80GB", f"--state-dir={tmp_path / 'state'}",
                    f"--config={config}", "--NodeAgent.worker_start_timeout=7", "--warm-workers=2"])
    try:
        assert (app.agent_workers.warm_workers, app.agent_workers.worker_start_timeout) == (2, 7)
        assert app.agent_parking.parked_memory == 3 * GiB and app.parked_budget() == 3 * GiB
        assert app.agent_enforcement.cgroup_mode == "none" and app.port == 0
        assert "parked_memory" not in app.config.NodeAgent and "port" in app.config.NodeAgent
    finally:
        app.inventory.close()
    said = [r.getMessage() for r in caplog.records if r.name == "test-old-spellings"]
    assert "c.NodeAgent.worker_start_timeout is now c.AgentWorkers.worker_start_timeout; the old spelling is read " \
           "for now, please change it" in said
    assert "c.NodeAgent.warm_workers is now c.AgentWorkers.warm_workers, which is also set: c.NodeAgent.warm_workers " \
           "is ignored" in said


# -- with the real service -------------------------------------------------------------------------------------

@needs_service
def test_agent_registers_its_gpus(pool):
    service, agent = pool
    [node] = [n for n in service.client().pool()["nodes"] if n["name"] == "node-1"]
    assert node["state"] == "up" and node["inventory"] == "simulated"
    assert [(g["name"], g["index"], g["memory_total"]) for g in node["gpus"]] == [
        ("NVIDIA A100-SXM4-80GB", 0, 80 * GiB), ("NVIDIA A100-SXM4-80GB", 1, 80 * GiB)]
    assert [g["uuid"] for g in node["gpus"]] == [simulated_uuid("node-1", 0), simulated_uuid("node-1", 1)]
    info = json.loads((agent.state_dir / "agent.json").read_text())
    assert info == {"name": "node-1", "url": agent.url, "pid": agent.proc.pid}


@needs_service
def test_service_token_drives_the_agent(pool):
    service, agent = pool
    body = {"lease_id": "L-00000000beef", "owner": "tester", "gpus": [simulated_uuid("node-1", 0)],
            "fraction": 0.5, "memory": 40 * GiB}
    status, reply = call(f"{agent.url}/workers", "POST", body, token="not-the-agent-token")
    assert status == 401
    status, reply = call(f"{agent.url}/workers", "POST", body, token=service.user_token)
    assert status == 401  # a user token is not the agent token
    status, started = call(f"{agent.url}/workers", "POST", body, token=service.agent_token)
    assert status == 201
    # No lease holds this worker, so the service may tell the agent to stop it
    # with its next heartbeat reply, before or after this DELETE.
    status, stopped = call(f"{agent.url}/workers/L-00000000beef", "DELETE", token=service.agent_token)
    assert (status, stopped.get("exit_code", 0)) in ((200, 0), (404, 0))
    wait_for(lambda: not psutil.pid_exists(started["pid"]), 10, "worker gone")


@needs_service
def test_a_lease_whose_worker_could_not_be_saved_at_the_stop_ends_saying_so(tmp_path, service):
    from gpupool.wire.leases import LeaseRequest
    from procs import start_agent

    agent = start_agent(tmp_path, service, name="node-8", extra_args=["--AgentParking.park_on_stop_timeout=0.001"])
    client = service.client()
    lease = client.get_lease(client.create_lease(LeaseRequest(fraction=0.25)).id, wait=30, state="starting")
    assert lease.state.value == "active" and lease.node == "node-8", lease.reason
    assert agent.stop() == 0
    ended = client.get_lease(lease.id, wait=10, state="active")
    assert ended.state.value == "failed", ended.events
    assert ended.reason.startswith("the node agent on node-8 was stopped and could not save the worker to disk (not "
                                   "done within c.AgentParking.park_on_stop_timeout"), ended.reason


@needs_service
def test_sigterm_with_a_leased_worker_leaves_nothing(tmp_path, service):
    """Without ``c.AgentParking.park_on_stop`` (tests/service/test_park_service.py has it on, the
    default), a stop ends the node's leases at once."""
    from gpupool.wire.leases import LeaseRequest
    from procs import start_agent

    agent = start_agent(tmp_path, service, name="node-9", extra_args=["--AgentParking.park_on_stop=False"])
    client = service.client()
    lease = client.create_lease(LeaseRequest(fraction=0.25))
    lease = client.get_lease(lease.id, wait=30, state="starting")
    assert lease.state.value == "active" and lease.node == "node-9"
    pid = lease.worker["pid"]
    assert pid in processes_mentioning(str(agent.state_dir))
    assert agent.stop() == 0  # raises if a process under its state dir survived
    assert not psutil.pid_exists(pid)
    # the agent's last heartbeat said the worker is dead: the lease ends now,
    # not when the node's TTL runs out
    ended = client.get_lease(lease.id, wait=10, state="active")
    assert ended.state.value == "failed" and ended.reason == "the node agent on node-9 was stopped"
    # it also said it is leaving: nothing new goes there, at once (not after node_ttl)
    node = next(n for n in client.pool()["nodes"] if n["name"] == "node-9")
    assert (node["state"], node["state_reason"]) == ("lost", "its agent stopped")
    try:
        after = client.create_lease(LeaseRequest(fraction=0.25))
    except GPUPoolError as exc:
        assert exc.status == 409 and exc.message, exc
    else:
        assert after.state.value == "queued" and after.node is None, after
