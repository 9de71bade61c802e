"""``c.AgentEnforcement.require_containment``: an agent that cannot have the containment it is
configured for refuses to serve, in words, instead of running with less.

The pod's case is reproduced as root with ``unshare -m``: in a mount namespace of its own,
every cgroup mount is remounted read-only (an unprivileged container's cgroupfs,
kubernetes#121190), so ``cgroup_mode = auto`` can only end at ``none``. There an agent with
``--require-containment`` never registers, starts no worker, and answers ``/health`` with 503
and the reason (``gpupool health``, the readiness probe, prints it), while the same agent
without it registers with the warning. The host's own mounts are left as they were.
An enforcement mode that cannot set up is refused the same way (a mode plugin that fails).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpupool.demo_pool import GPUPOOL, free_port, stop_process, wait_for
from gpupool.errors import GPUPoolError
from gpupool.node.cgroups.mounts import read_mounts
from procs import start_agent, start_service


def readonly_cgroups() -> list[str]:
    """A launcher: ``unshare -m`` with every cgroup mount (and /sys/fs/cgroup itself) read-only."""
    if os.geteuid() != 0:
        pytest.skip("a mount namespace of its own needs root (unshare -m)")
    if shutil.which("unshare") is None:
        pytest.skip("util-linux's unshare is not installed")
    paths = [str(m.path) for m in read_mounts()]
    if not paths:
        pytest.skip("no cgroup file system is mounted here")
    tops = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines() if line.split()[1] == "/sys/fs/cgroup"]
    remounts = " && ".join(f"mount -o remount,bind,ro {shlex.quote(p)}" for p in [*tops, *paths])
    return ["unshare", "-m", "sh", "-c", f'mount --make-rprivate / && {remounts} && exec "$@"', "sh"]


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_an_agent_requiring_containment_refuses_a_read_only_cgroupfs(tmp_path):
    launcher = readonly_cgroups()
    before = [(m.path, m.options) for m in read_mounts()]
    service = start_service(tmp_path)
    port = free_port()
    state = tmp_path / "agent-refusing"
    state.mkdir()
    log = state / "agent.log"
    args = [*launcher, *GPUPOOL, "agent", f"--service-url={service.url}", f"--token-file={service.process.agent_token_file}",
            "--name=node-ro", "--ip=127.0.0.1", f"--port={port}", f"--state-dir={state}", "--simulate=2xA100-80GB",
            "--require-containment"]
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        def answered():
            try:
                return health(url + "/health")
            except OSError:
                return None

        status, body = wait_for(answered, 30, "the refusing agent's /health", proc, log)
        assert status == 503 and body["status"] == "refused" and body["error"] == "not_configured", body
        words = body["message"]
        assert "refuses to serve (c.AgentEnforcement.require_containment = True)" in words
        assert "the workers' cgroups cannot be made (c.AgentEnforcement.cgroup_mode = 'auto')" in words
        assert "Read-only file system" in words  # the reason, from the kernel
        assert "privileged container" in words and "c.AgentEnforcement.require_containment = False" in words
        # The readiness probe's command says the same, and fails.
        probe = subprocess.run([*GPUPOOL, "health", url + "/health"], capture_output=True, text=True, timeout=60)
        assert probe.returncode == 1 and probe.stdout.startswith(f"{url}/health answered 503: gpupool agent node-ro")
        assert health(url + "/health/live") == (200, {"status": "refused", "node": "node-ro"})  # alive: not restarted
        # It serves nothing else, and never registers: the service knows no node.
        request = urllib.request.Request(url + "/workers", headers={"Authorization": f"token {service.agent_token}"})
        assert pytest.raises(urllib.error.HTTPError, urllib.request.urlopen, request, timeout=5).value.code == 503
        time.sleep(1.0)  # several of the service's heartbeat intervals (0.2 s here)
        assert service.client().pool()["nodes"] == []
        assert proc.poll() is None
        assert "refuses to serve" in log.read_text()
    finally:
        assert stop_process(proc) == 0
    assert not (state / "workers").exists()  # no worker manager was made, so no worker could start
    # Without the setting, the same read-only cgroupfs gives an agent that serves, with the warning.
    agent = start_agent(tmp_path, service, name="node-weak", launcher=launcher)
    try:
        assert health(agent.url + "/health")[0] == 200
        assert "NO CGROUP CONTAINMENT" in agent.log.read_text()
    finally:
        stop_process(agent.proc)
        service.stop()
    assert [(m.path, m.options) for m in read_mounts()] == before  # the host's mounts are untouched


def test_a_named_enforcement_mode_that_cannot_set_up_is_refused(tmp_path):
    """In process: a mode plugin whose setup fails (as ``mps`` does without its daemon) ends the
    start-up with an error without the setting, and becomes the refusal with it."""
    from gpupool.node import enforcement
    from gpupool.node.agent import NodeAgent

    class Broken(enforcement.EnforcementMode):
        name = "broken-test"
        runs_simulated = True

        def setup(self, state_dir, log):
            raise RuntimeError("no control daemon answers on /tmp/nvidia-mps")

    enforcement.register(Broken)
    token = tmp_path / "token"
    token.write_text("t0k")
    argv = ["--service-url=http://127.0.0.1:1", f"--token-file={token}", "--simulate=1xA100-80GB",
            f"--state-dir={tmp_path / 'state'}", "--enforcement=broken-test", "--name=node-e"]
    try:
        with pytest.raises(GPUPoolError, match="no control daemon answers"):
            NodeAgent().initialize(argv)
        agent = NodeAgent()
        agent.initialize([*argv, "--require-containment"])
        assert agent.refusal == "enforcement mode 'broken-test' cannot be had: no control daemon answers on /tmp/nvidia-mps"
        assert agent.node_gpus.enforcement.name == "none"
        assert agent.refusal_words().startswith("gpupool agent node-e refuses to serve")
        agent.inventory.close()
    finally:
        enforcement.unregister(Broken)


def test_a_bare_agent_does_not_require_containment():
    from gpupool.node.settings import AgentEnforcement

    assert AgentEnforcement().require_containment is False  # make demo, laptops: run with what the host has
    help_text = AgentEnforcement.class_traits()["require_containment"].help
    assert "c.AgentEnforcement.require_containment = True" in help_text
