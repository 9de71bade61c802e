"""``c.AgentWorkers.worker_user`` as a template (``"{username}"``, here ``"gpupool-test-{username}"``):
each lease's worker runs as the account its owner's name gives, and a lease whose owner has no
account on the node is refused with words naming the setting. Needs root (the agent switches
user), as tests/node/test_worker_user.py, whose account and fixtures it shares."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
from procs import free_port, stop_process, wait_for

from agent_api import TOKEN, call
from worker_account import worker_account
from gpupool.errors import GPUPoolError
from gpupool.node.agent_accounts import expand_worker_user
from gpupool.node.inventory.simulated import simulated_uuid

GiB = 1024**3

TEMPLATE = "gpupool-test-{username}"  # owner "worker" -> tests/node/test_worker_user.py's account


def test_expand_worker_user():
    assert expand_worker_user("{username}", "ann") == "ann"
    assert expand_worker_user(TEMPLATE, "worker") == "gpupool-test-worker"
    for owner in ("Ann", "ann smith", "../root", "a" * 40, ""):
        with pytest.raises(GPUPoolError) as refused:
            expand_worker_user("{username}", owner)
        assert refused.value.status == 400
    with pytest.raises(GPUPoolError, match="only field"):
        expand_worker_user("{user}", "ann")


@pytest.mark.skipif(os.geteuid() != 0, reason="starting workers as another user needs an agent running as root")
def test_each_worker_runs_as_its_owners_account(shared_root, python_reachable):  # noqa: F811
    account = worker_account()
    state = shared_root / "agent"
    port = free_port()
    log = shared_root / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpupool.cli", "agent", f"--service-url=http://127.0.0.1:{free_port()}",
             "--simulate=1xA100-80GB", "--name=tmpl", "--ip=127.0.0.1", f"--port={port}", f"--state-dir={state}",
             f"--worker-user={TEMPLATE}", "--warm-workers=0"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "GPUPOOL_AGENT_TOKEN": TOKEN})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: b"serving on" in log.read_bytes(), 30, "agent", proc, log)
        body = {"lease_id": "L-t1", "gpus": [simulated_uuid("tmpl", 0)], "fraction": 0.5, "memory": 10 * GiB}
        status, reply = call(f"{url}/workers", "POST", {**body, "owner": "nosuchuser"})
        assert status == 400 and reply["error"] == "worker_user_unknown"
        assert "gpupool-test-nosuchuser" in reply["message"] and "c.AgentWorkers.worker_user" in reply["message"]
        status, reply = call(f"{url}/workers", "POST", {**body, "owner": "worker"})
        assert status == 201, reply
        assert psutil.Process(reply["pid"]).uids().real == account.pw_uid
        assert call(f"{url}/workers/L-t1", "DELETE")[0] == 200
    finally:
        stop_process(proc)
