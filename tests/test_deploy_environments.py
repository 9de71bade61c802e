"""Worker environments (``c.NodeAgent.environments``) of a real agent: checked at start (an
unusable one logged with the reason); a ``POST /workers`` naming one
starts the worker with that interpreter; an unknown or unusable one is a 400 in words."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import free_port, stop_process, wait_for
from test_agent import GiB, TOKEN, call

from gpupool.provisioner import environments
from gpupool.provisioner.simulated import simulated_uuid

SYSTEM_PYTHON = "/usr/bin/python3"


def test_check_reports_what_is_missing(tmp_path):
    assert environments.check("here", sys.executable).usable
    prefix = Path(sys.executable).parent.parent  # a prefix, not the interpreter: PREFIX/bin/python
    env = environments.check("venv", str(prefix))
    assert env.usable and env.python == str(prefix / "bin" / "python")
    missing = environments.check("nowhere", str(tmp_path / "none"))
    assert not missing.usable and "does not exist" in missing.problem
    if Path(SYSTEM_PYTHON).is_file() and subprocess.run([SYSTEM_PYTHON, "-c", "import ipykernel"],
                                                        capture_output=True).returncode != 0:
        bare = environments.check("system", SYSTEM_PYTHON)
        assert not bare.usable and "gpupool[worker]" in bare.problem
    with pytest.raises(ValueError, match="has no environment 'gone'"):
        environments.choose([env], "gone")
    with pytest.raises(ValueError, match="cannot run workers"):
        environments.choose([missing], "nowhere")


@pytest.fixture
def agent_with_envs(tmp_path):
    state = tmp_path / "agent"
    state.mkdir()
    config = tmp_path / "agent_config.py"
    prefix = Path(sys.executable).parent.parent
    config.write_text(f"c.NodeAgent.environments = {{'venv': {str(prefix)!r}, 'gone': {str(tmp_path / 'gone')!r}}}\n")
    port = free_port()
    log = state / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpupool.cli", "agent", f"--service-url=http://127.0.0.1:{free_port()}",
             "--simulate=1xA100-80GB", "--name=envs", "--ip=127.0.0.1", f"--port={port}", f"--state-dir={state}",
             f"--config={config}", "--warm-workers=0"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "GPUPOOL_AGENT_TOKEN": TOKEN})
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return call(f"{url}/health", token=None)[0] == 200
        except OSError:
            return False

    wait_for(healthy, 30, "agent", proc, log)
    yield url, prefix, log
    stop_process(proc)


def test_a_worker_runs_in_the_environment_its_request_names(agent_with_envs):
    url, prefix, log = agent_with_envs
    assert "worker environment 'gone' is not usable" in log.read_text()
    gpu = simulated_uuid("envs", 0)
    body = {"lease_id": "L-env", "owner": "ann", "gpus": [gpu], "fraction": 0.5, "memory": 10 * GiB}
    status, reply = call(f"{url}/workers", "POST", {**body, "env": "gone"})
    assert status == 400 and "cannot run workers" in reply["message"]
    status, reply = call(f"{url}/workers", "POST", {**body, "env": "torch"})
    assert status == 400 and "has no environment 'torch'" in reply["message"]
    status, reply = call(f"{url}/workers", "POST", {**body, "env": "venv"})
    assert status == 201, reply
    import psutil

    assert psutil.Process(reply["pid"]).cmdline()[0] == str(prefix / "bin" / "python")
    assert call(f"{url}/workers/L-env", "DELETE")[0] == 200


def test_a_lease_names_an_environment_end_to_end(tmp_path, service):
    """Through the service: the agent's environments are listed by GET /pool (and ``gpupool
    pool``), a lease naming one gets a worker on that interpreter, and one the node does not
    offer ends ``failed`` with the agent's words."""
    from procs import start_agent

    from gpupool.schema import LeaseRequest, LeaseState
    from gpupool.tables import environment_table, pool_table

    prefix = Path(sys.executable).parent.parent
    config = tmp_path / "agent_config.py"
    config.write_text(f"c.NodeAgent.environments = {{'venv': {str(prefix)!r}}}\n")
    node = start_agent(tmp_path, service, extra_args=[f"--config={config}"])
    try:
        pool = service.client().pool()
        envs = {e["name"]: e for e in pool["nodes"][0]["environments"]}
        assert set(envs) == {"default", "venv"} and envs["default"]["default"] and envs["venv"]["usable"]
        assert "venv" in environment_table(pool)[0]
        assert "venv" in pool_table(pool)[0] and "venv" in pool_table(pool)[1]  # what %gpu pool shows
        lease = service.client().create_lease(LeaseRequest(fraction=0.5, env="venv"))
        lease = wait_for(lambda: (got := service.client().get_lease(lease.id)).state is not LeaseState.starting
                         and got, 60, "the lease's worker")
        assert lease.state is LeaseState.active, lease.reason
        import psutil

        assert psutil.Process(lease.worker["pid"]).cmdline()[0] == str(prefix / "bin" / "python")
        service.client().release(lease.id)
        other = service.client().create_lease(LeaseRequest(fraction=0.5, env="torch"))
        other = wait_for(lambda: (got := service.client().get_lease(other.id)).state.value in ("failed", "released")
                         and got, 60, "the refused lease to end")
        assert other.state is LeaseState.failed and "has no environment 'torch'" in other.reason
    finally:
        node.stop()
