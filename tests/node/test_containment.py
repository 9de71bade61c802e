"""No process outlives its lease: a cell that double-forks with
``setsid`` leaves a daemon outside its worker's process group and tree; the
daemon still lives in the worker's cgroup, and dies at release, at agent
stop, and is found again by an agent restarted after a kill -9.

Real workers, a real agent and service, and this host's cgroup v2 and v1
file systems (root needed; otherwise skipped with the reason). Each test
uses a cgroup subtree of its own.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal

import psutil
import pytest

from workercell import run_worker_cell
from gpupool.node.cgroups import CgroupError, containment
from gpupool.node.inventory.simulated import SimulatedInventory
from gpupool.node.workers import WarmSettings, WorkerManager, WorkerLaunch, WorkerSpec
from gpupool.wire.leases import LeaseRequest
from procs import start_agent, wait_for

GiB = 1024**3
GPUS = SimulatedInventory("2xA100-80GB", "node-1").discover()

# The escape to contain: a daemon in a session of its own, reparented to
# init (double fork), no longer the worker's descendant; prints its pid.
DAEMON_CELL = """\
import subprocess, sys
code = ("import os, sys, time\\nif os.fork(): sys.exit(0)\\nos.setsid()\\nif os.fork(): sys.exit(0)\\n"
        "print(os.getpid(), flush=True)\\nos.close(1)\\ntime.sleep(600)")
out = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                     stderr=subprocess.DEVNULL, check=True).stdout
print(int(out))
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def escaped(daemon: int, worker_pid: int) -> bool:
    """True when ``daemon`` left the worker's session and process tree."""
    tree = {child.pid for child in psutil.Process(worker_pid).children(recursive=True)}
    return os.getsid(daemon) != os.getsid(worker_pid) and daemon not in tree


@pytest.fixture(params=["v2", "v1"])
def mode(request):
    if os.geteuid() != 0:
        pytest.skip("making cgroups needs root")
    return request.param


@pytest.fixture
def cgroup_root(mode, tmp_path):
    """A subtree of this test's own, for ``mode``; skipped where the host lacks it."""
    root = f"gpupool/test-{secrets.token_hex(4)}"
    try:
        containment(mode, root, tmp_path).close()
    except CgroupError as exc:
        pytest.skip(f"no cgroup {mode} here: {exc}")
    return root


def spec(lease_id: str) -> WorkerSpec:
    return WorkerSpec(lease_id, "ann", (GPUS[0],), 0.5, 20 * GiB)


def test_a_daemon_a_cell_leaves_dies_when_its_lease_is_stopped(mode, cgroup_root, tmp_path):
    async def scenario():
        workers = WorkerManager(WorkerLaunch(tmp_path / "state", node="node-1", stop_timeout=5, start_timeout=30),
                                cgroups=containment(mode, cgroup_root, tmp_path / "state"))
        try:
            worker = await workers.start(spec("L-escape"))
            other = await workers.start(spec("L-other"))
            assert worker.cgroup.kind == mode and worker.cgroup.name == "lease-L-escape"
            daemon = int(await run_worker_cell(worker.connection(), DAEMON_CELL))
            assert escaped(daemon, worker.pid)
            assert daemon in worker.cgroup.pids() and daemon in {p.pid for p in worker.descendants()}
            assert daemon not in other.cgroup.pids()
            assert await workers.stop("L-escape") == 0
            assert not alive(daemon), "the daemon outlived its lease"
            assert workers.cgroups.names() == ["lease-L-other"], "the stopped lease's cgroup is removed"
            assert alive(other.pid)
        finally:
            await workers.stop_all()
            workers.close()
        assert workers.cgroups.names() == []

    asyncio.run(scenario())


def test_a_restarted_agent_finds_the_leases_processes_by_cgroup(mode, cgroup_root, tmp_path):
    """An agent killed with -9 (the first manager is abandoned, never
    stopped): the restarted one re-adopts the worker with the daemon its cell
    left, kills the warm worker's cgroup and a stray one, and the daemon dies
    when the lease is stopped."""
    state = tmp_path / "state"

    async def scenario():
        first = WorkerManager(WorkerLaunch(state, node="node-1", stop_timeout=5, start_timeout=30,
                                             warm=WarmSettings(size=1)), cgroups=containment(mode, cgroup_root, state))
        first.start_warm_pool()
        kept = await first.start(spec("L-kept"))
        daemon = int(await run_worker_cell(kept.connection(), DAEMON_CELL))
        for _ in range(1200):
            if first.pool.ready:
                break
            await asyncio.sleep(0.05)
        [warm] = first.pool.ready
        assert warm.cgroup.name.startswith("warm-") and len(warm.cgroup.name) == len("warm-") + 16
        for worker in (kept, warm):  # the first agent is gone: nothing of it acts any more
            worker.watcher.cancel()
        first.pool._loop_task.cancel()  # nor does its warm pool refill
        stray = first.cgroups.create("warm-0123456789abcdef")  # a start the killed agent never finished
        sleeper = await asyncio.create_subprocess_exec("sleep", "600", start_new_session=True)
        stray.add(sleeper.pid)

        # What init does for a killed agent's workers: reap them once they die
        # (in v1 a zombie stays in its cgroup, which cannot be removed until then).
        reaped = asyncio.ensure_future(asyncio.to_thread(warm.process.wait))
        second = WorkerManager(WorkerLaunch(state, node="node-1", stop_timeout=5, start_timeout=30),
                               cgroups=containment(mode, cgroup_root, state))
        try:
            [adopted] = await second.recover()
            assert adopted.spec.lease_id == "L-kept" and adopted.pid == kept.pid
            assert adopted.cgroup.name == "lease-L-kept" and daemon in {p.pid for p in adopted.descendants()}
            assert second.cgroups.names() == ["lease-L-kept"], "the warm worker's and the stray cgroup are gone"
            assert not alive(warm.pid) and await sleeper.wait() == -signal.SIGKILL
            assert alive(daemon), "re-adopted: the lease's processes keep running"
            assert await second.stop("L-kept") is None
            assert not alive(daemon) and not alive(kept.pid)
        finally:
            await second.stop_all()
            second.close()
            first.close()
        kept.process.wait()
        await reaped

    asyncio.run(scenario())


def test_a_daemon_dies_at_release_survives_an_agent_kill9_with_its_lease_and_dies_at_agent_stop(
        mode, cgroup_root, tmp_path, service):
    """Through the service and a real agent: lease 1's daemon dies at
    release; the agent is killed with -9 and started again on its state dir
    and port, re-adopts lease 2's worker by its cgroup (the daemon, outside
    its tree, is still the lease's), and its stop kills the daemon."""
    args = ["--warm-workers=1", f"--cgroup-mode={mode}", f"--AgentEnforcement.cgroup_root={cgroup_root}"]
    agent = start_agent(tmp_path, service, name="node-c", extra_args=args)
    client = service.client()
    daemons = []
    try:
        for _ in range(2):
            lease = client.get_lease(client.create_lease(LeaseRequest(fraction=0.25)).id, wait=30, state="starting")
            assert lease.state.value == "active", lease.reason
            daemons.append(int(asyncio.run(run_worker_cell(lease.connection, DAEMON_CELL))))
            assert escaped(daemons[-1], lease.worker["pid"])
            if len(daemons) == 1:
                assert client.release(lease.id).state.value == "released"
                wait_for(lambda: not alive(daemons[0]), 10, "the daemon to die with its lease")
        agent.proc.kill()
        agent.proc.wait()
        assert alive(daemons[1]) and alive(lease.worker["pid"]), "workers outlive a killed agent"
        agent = start_agent(tmp_path, service, name="node-c", extra_args=args, port=int(agent.url.rsplit(":", 1)[1]))
        wait_for(lambda: f"re-adopted the worker (pid {lease.worker['pid']}) of lease {lease.id}" in
                 agent.log.read_text(), 30, "the re-adoption", agent.proc, agent.log)
        assert client.get_lease(lease.id).state.value == "active"
        assert asyncio.run(run_worker_cell(lease.connection, "print(6 * 7)")) == "42\n"
        assert alive(daemons[1])
    finally:
        assert agent.stop() == 0
        for pid in daemons:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not alive(daemons[1]), "the daemon outlived the agent's stop"
    assert f"worker cgroups: {mode} under " in agent.log.read_text()


def test_a_cgroup_mode_that_cannot_be_had_is_one_clear_line(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "gpupool.cli", "agent", "--service-url=http://127.0.0.1:1",
                             f"--state-dir={tmp_path / 'agent'}", "--simulate=1xA100-80GB", "--cgroup-mode=v2",
                             "--AgentEnforcement.cgroup_root=/../../../../.."], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "GPUPOOL_AGENT_TOKEN": "t"})
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert "cgroup v2 containment is not available" in result.stderr, result.stderr
    assert "cgroup_mode = 'auto'" in result.stderr, "it names the way out"


def test_an_agent_that_cannot_listen_removes_the_cgroups_it_made(mode, tmp_path):
    """``cannot listen on ...: Address already in use`` (exit 1) leaves no
    ``gpupool/agent-<id>`` cgroup behind, in v2 or under any v1 controller, and no state folder."""
    import socket
    import subprocess
    import sys

    state = tmp_path / "agent"
    try:
        made = containment(mode, "", state)  # the same subtree the agent makes (its default root)
    except CgroupError as exc:
        pytest.skip(f"no cgroup {mode} here: {exc}")
    made.close()
    folders = [path for path in (getattr(made, "root", None), *getattr(made, "v1_roots", {}).values(),
                                 *getattr(made, "roots", {}).values()) if path is not None]
    assert folders and not any(path.exists() for path in folders)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "gpupool.cli", "agent", "--service-url=http://127.0.0.1:1",
                                 f"--state-dir={state}", "--simulate=1xL4", f"--cgroup-mode={mode}",
                                 "--ip=127.0.0.1", f"--port={port}"], capture_output=True, text=True, timeout=60,
                                env={**os.environ, "GPUPOOL_AGENT_TOKEN": "t"})
    assert result.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in result.stderr, result.stderr
    assert [path for path in folders if path.exists()] == []
    assert not state.exists(), "the port is tried before the state folder is made"
