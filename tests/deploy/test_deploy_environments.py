"""Worker environments (``c.AgentWorkers.environments``) of a real agent: checked at start (an
unusable one logged with the reason); a ``POST /workers`` naming one
starts the worker with that interpreter; an unknown or unusable one is a 400 in words.
Through the service: a lease naming one is placed only on a node that offers it, one no
node offers is refused at once, and a notebook kernel's name picks it by default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import free_port, stop_process, wait_for

from agent_api import TOKEN, call
from gpupool.errors import GPUPoolError
from gpupool.node import environments
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest
from gpupool.node.inventory.simulated import simulated_uuid

GiB = 1024**3

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
    config.write_text(
        f"c.AgentWorkers.environments = {{'venv': {str(prefix)!r}, 'gone': {str(tmp_path / 'gone')!r}}}\n")
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
    offer is refused at once (the placement rules: tests/rules/test_scheduler.py)."""
    from procs import start_agent

    from gpupool.tables import environment_table, pool_table

    prefix = Path(sys.executable).parent.parent
    config = tmp_path / "agent_config.py"
    config.write_text(f"c.AgentWorkers.environments = {{'venv': {str(prefix)!r}}}\n")
    node = start_agent(tmp_path, service, extra_args=[f"--config={config}"])
    try:
        pool = service.client().pool()
        envs = {e["name"]: e for e in pool["nodes"][0]["environments"]}
        assert set(envs) == {"default", "venv"} and envs["default"]["default"] and envs["venv"]["usable"]
        text = environment_table(pool)[0]
        assert "venv" in text and text.splitlines()[0].split()[:3] == ["node", "environment", "default"]
        assert "venv" in pool_table(pool)[0] and "venv" in pool_table(pool)[1]  # what %gpu pool shows
        lease = service.client().create_lease(LeaseRequest(fraction=0.5, env="venv"))
        lease = wait_for(lambda: (got := service.client().get_lease(lease.id)).state is not LeaseState.starting
                         and got, 60, "the lease's worker")
        assert lease.state is LeaseState.active, lease.reason
        import psutil

        assert psutil.Process(lease.worker["pid"]).cmdline()[0] == str(prefix / "bin" / "python")
        assert lease.env == "venv"
        service.client().release(lease.id)
        with pytest.raises(GPUPoolError, match="no node offers the worker environment 'torch'") as refused:
            service.client().create_lease(LeaseRequest(fraction=0.5, env="torch"))
        assert refused.value.code == "unknown_environment" and refused.value.extra["environments"] == ["default",
                                                                                                      "venv"]
    finally:
        node.stop()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A service and two agents: ``plain`` (two A100s, only its default environment) and
    ``torchbox`` (one H100, which also offers ``torch``: this test's virtual environment):
    ``(service, prefix of torch)``."""
    from procs import start_agent, start_service

    root = tmp_path_factory.mktemp("envs")
    prefix = Path(sys.executable).parent.parent
    config = root / "torch_config.py"
    config.write_text(f"c.AgentWorkers.environments = {{'torch': {str(prefix)!r}}}\n")
    service = start_service(root, config={"max_wait": "10m"})
    nodes = [start_agent(root, service, name="plain", simulate="2xA100-80GB", extra_args=["--warm-workers=0"])]
    try:
        nodes.append(start_agent(root, service, name="torchbox", simulate="1xH100-80GB",
                                 extra_args=[f"--config={config}", "--warm-workers=0"]))
        yield service, prefix
    finally:
        for node in nodes:
            node.stop()
        service.stop()


def _started(client, lease):
    lease = client.get_lease(lease.id, wait=60, state="starting")
    assert lease.state is LeaseState.active, lease.reason
    return lease


def test_placement_follows_the_environment(two_nodes):
    """``--env torch`` lands on the one node offering it though the other has a gap that
    fits better; full there, it queues; an environment no node offers is refused at once,
    naming what the pool offers, with nothing held or queued; a preferred one no node
    offers falls back to the node's default."""
    import psutil

    service, prefix = two_nodes
    client = service.client()
    gap = client.create_lease(LeaseRequest(fraction=0.5, model="A100"))  # plain GPU 0 now has the best fit
    torch = _started(client, client.create_lease(LeaseRequest(fraction=0.5, env="torch")))
    assert (torch.node, torch.env) == ("torchbox", "torch")
    assert psutil.Process(torch.worker["pid"]).cmdline()[0] == str(prefix / "bin" / "python")
    waiting = client.create_lease(LeaseRequest(fraction=1.0, env="torch", wait=600))
    # Queued, though plain has a free GPU: the queue's words say what it waits for.
    assert waiting.state is LeaseState.queued and "in environment torch" in waiting.events[-1]["reason"]
    client.release(waiting.id)
    before = client.pool()["totals"], len(client.list_leases())
    with pytest.raises(GPUPoolError) as refused:
        client.create_lease(LeaseRequest(fraction=0.25, env="jax", wait=600))
    assert refused.value.status == 409 and refused.value.code == "unknown_environment"
    assert refused.value.message.startswith("no node offers the worker environment 'jax'; the pool offers: "
                                            "default, torch")
    assert (client.pool()["totals"], len(client.list_leases())) == before
    fallback = client.create_lease(LeaseRequest(fraction=0.25, prefer_env="jax"))
    assert fallback.state is LeaseState.starting and fallback.env == "default"
    for lease in (gap, torch, fallback):
        client.release(lease.id)


def test_the_kernel_name_picks_the_environment(two_nodes, tmp_path):
    """A notebook kernel whose kernelspec is named ``gpupool-torch`` gets the ``torch``
    environment from a plain ``%gpu acquire``; the output and ``%gpu status`` say so."""
    from frontend import install_kernelspec, run, start_gpupool_kernel

    service, prefix = two_nodes
    kernels = install_kernelspec(tmp_path / "prefix", service.url, service.user_token, name="gpupool-torch")
    km, kc = start_gpupool_kernel(kernels, tmp_path, name="gpupool-torch")
    try:
        attach = run(kc, "%gpu acquire 0.25")
        assert attach.ok, attach.text()
        assert " on torchbox in environment torch, " in attach.stdout
        assert run(kc, "import sys; print(sys.executable)").stdout.strip() == str(prefix / "bin" / "python")
        status = run(kc, "%gpu status")
        assert "environment" in status.text() and "torch" in status.text()
        assert run(kc, "%gpu release --discard").ok
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
