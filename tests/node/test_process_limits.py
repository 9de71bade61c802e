"""Task limits (:mod:`gpupool.node.process_limits`): a cell that forks
without end stops at its own worker's ``pids.max``, and the node goes on.

Without these limits, a cell forking 1,460 sleeping children fills the
node's process budget; another user's cell cannot start a process, the
agent dies, new acquires fail and the bomb's release is not confirmed.
Here, for real: an agent started inside a pids cgroup of 1,500 tasks (what
systemd's TasksMax or a container's limit would be), a real service with two
users, real workers on this host's cgroups (root and a pids controller
needed; otherwise skipped with the reason).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from workercell import run_worker_cell
from gpupool.node import process_limits
from gpupool.node.cgroups import CgroupError, containment
from gpupool.node.cgroups.mounts import own_cgroups, read_mounts
from gpupool.node.process_limits import MIN_WORKER_PIDS, ProcessBudget, node_limit
from gpupool.wire.leases import LeaseRequest
from procs import start_agent, start_service, wait_for

#: The agent's enclosing limit and what it keeps: the workers share 1,200 tasks, a 0.5 lease of 2 GPUs 300.
NODE_TASKS, RESERVE = 1500, 300
PER_HALF = (NODE_TASKS - RESERVE) // 4

# Forks sleeping children until the kernel says no; prints how many and their pids.
BOMB_CELL = """\
import json, os, time
children = []
try:
    while len(children) < 5000:
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        children.append(pid)
    print(json.dumps({"stopped": None, "children": children}))
except BlockingIOError as exc:
    print(json.dumps({"stopped": exc.strerror, "children": children}))
"""
# A neighbour starts processes: 20 forks and a subprocess.
NEIGHBOUR_CELL = """\
import os, subprocess, sys
kids = []
for _ in range(20):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    kids.append(pid)
print(sum(os.waitpid(pid, 0)[1] == 0 for pid in kids), subprocess.run([sys.executable, "-c", "print(7)"],
      capture_output=True, text=True).stdout.strip())
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- the budget, pure ---------------------------------------------------------------------------------------------

def test_a_lease_gets_its_gpu_share_of_the_workers_budget_at_least_the_floor():
    budget = ProcessBudget(workers=1200, node_gpus=2)
    assert budget.for_lease(1, 0.5) == 300 and budget.for_lease(2, 1.0) == 1200 and budget.for_lease(1, 1.0) == 600
    assert budget.for_lease(1, 0.01) == MIN_WORKER_PIDS, "a tiny slice still runs a kernel"
    assert ProcessBudget(workers=50, node_gpus=2).for_lease(1, 0.01) == 50, "never above what workers have"
    assert ProcessBudget(workers=1200, per_lease=4096, node_gpus=2).for_lease(1, 0.5) == 1200
    assert ProcessBudget(workers=9000, per_lease=4096, node_gpus=2).for_lease(1, 0.5) == 4096


def test_the_node_limit_is_the_lowest_of_the_kernels_and_the_cgroups_above(tmp_path):
    kernel = tmp_path / "kernel"
    kernel.mkdir()
    (kernel / "pid_max").write_text("32768\n")
    (kernel / "threads-max").write_text("9000\n")
    cgroup = tmp_path / "pids"
    (cgroup / "system.slice" / "agent.service").mkdir(parents=True)
    (cgroup / "system.slice" / "pids.max").write_text("2300\n")
    (cgroup / "system.slice" / "agent.service" / "pids.max").write_text("max\n")
    mounts = tmp_path / "mounts"
    mounts.write_text(f"cgroup {cgroup} cgroup rw,relatime,pids 0 0\n")
    self_cgroup = tmp_path / "self"
    self_cgroup.write_text("3:pids:/system.slice/agent.service\n0::/\n")
    assert node_limit(mounts=mounts, self_cgroup=self_cgroup, kernel=kernel) == \
        (2300, f"pids.max of {cgroup / 'system.slice'}")
    (cgroup / "system.slice" / "pids.max").write_text("max\n")
    limit = node_limit(mounts=mounts, self_cgroup=self_cgroup, kernel=kernel)
    assert limit[0] <= 9000 and (limit == (9000, "kernel.threads-max") or "RLIMIT_NPROC" in limit[1])


# -- this host's cgroups -----------------------------------------------------------------------------------------

def _pids_mount() -> tuple[Path, str] | None:
    """(where a pids cgroup for the agent can be made, and the kind), or None."""
    mounts, own = read_mounts(), own_cgroups()
    for mount in mounts:
        if mount.fstype == "cgroup" and "pids" in mount.options and "pids" in own:
            return Path(os.path.normpath(f"{mount.path}/{own['pids'].lstrip('/')}")), "v1"
    for mount in mounts:
        if mount.fstype == "cgroup2" and "" in own:
            place = Path(os.path.normpath(f"{mount.path}/{own[''].lstrip('/')}"))
            if "pids" in (place / "cgroup.subtree_control").read_text().split():
                return place, "v2"
    return None


@pytest.fixture
def agent_cgroup():
    """A pids cgroup of NODE_TASKS tasks for the agent (the agent starts in it); removed after."""
    if os.geteuid() != 0:
        pytest.skip("making cgroups needs root")
    found = _pids_mount()
    if found is None:
        pytest.skip("no pids controller here (neither a v1 pids mount nor pids in this cgroup's v2 subtree_control)")
    place = found[0] / f"gpupool-tasks-{secrets.token_hex(4)}"
    place.mkdir()
    (place / "pids.max").write_text(str(NODE_TASKS))
    yield place
    for pid in (int(p) for p in (place / "cgroup.procs").read_text().split()):
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not (place / "cgroup.procs").read_text().split(), 10, "the test cgroup to empty")
    for folder in sorted((p for p in place.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        folder.rmdir()
    place.rmdir()


# Told on stdin, forks sleeping children until refused; prints how many it made.
FORKER = ("import os, sys, time\nsys.stdin.readline()\nn = 0\ntry:\n    for _ in range(20):\n"
          "        if os.fork() == 0:\n            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
          "except BlockingIOError:\n    pass\nprint(n, flush=True)\ntime.sleep(60)\n")


def _forks_in(group) -> int:
    """How many children a one-thread process in ``group`` could fork."""
    proc = subprocess.Popen([sys.executable, "-c", FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        group.add(proc.pid)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        return int(proc.stdout.readline())
    finally:
        group.kill()
        proc.wait(5)
        proc.stdin.close()
        proc.stdout.close()


@pytest.mark.parametrize("mode", ["v2", "v1"])
def test_the_workers_cap_and_a_lease_limit_hold(mode, tmp_path):
    """The subtree's cap holds all lease cgroups together, a lease's pids.max its own (v2 here may be the
    hybrid kind: the v2 cgroup, its tasks limited in the v1 pids hierarchy)."""
    if os.geteuid() != 0:
        pytest.skip("making cgroups needs root")
    try:
        tree = containment(mode, f"gpupool/test-{secrets.token_hex(4)}", tmp_path)
    except CgroupError as exc:
        pytest.skip(f"no cgroup {mode} here: {exc}")
    try:
        try:
            tree.cap_pids(4)
        except CgroupError as exc:
            pytest.skip(f"no pids controller for cgroup {mode} here: {exc}")
        assert _forks_in(tree.create("lease-L-capped")) == 3, "the subtree's 4 tasks: the process and 3 children"
        tree.cap_pids(1000)
        limited = tree.create("lease-L-limited")
        limited.set_limits(pids=3)
        assert _forks_in(limited) == 2, "its own 3 tasks"
        for name in tree.names():
            tree.find(name).remove()
    finally:
        tree.close()


# -- a fork bomb through a real service and agent -----------------------------------------------------------------

def _cell(connection, code: str, timeout: float = 120) -> str:
    return asyncio.run(run_worker_cell(connection, code, timeout=timeout))


@pytest.mark.timeout(300)
def test_a_fork_bomb_stops_at_its_lease_and_the_node_goes_on(agent_cgroup, tmp_path):
    service = start_service(tmp_path, tokens={"bob": "bob-" + secrets.token_hex(8)})
    procs = agent_cgroup / "cgroup.procs"
    launcher = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs)]
    args = ["--warm-workers=1", f"--AgentEnforcement.agent_pids_reserve={RESERVE}"]
    agent = start_agent(tmp_path, service, extra_args=args, launcher=launcher)
    tester, bob = service.client(), service.client("bob")
    children: list[int] = []
    try:
        assert f"workers may have {NODE_TASKS - RESERVE} tasks" in agent.log.read_text()
        bomb = tester.get_lease(tester.create_lease(LeaseRequest(fraction=0.5)).id, wait=60, state="starting")
        neighbour = bob.get_lease(bob.create_lease(LeaseRequest(fraction=0.5)).id, wait=60, state="starting")
        assert bomb.state.value == neighbour.state.value == "active", (bomb.reason, neighbour.reason)

        result = json.loads(_cell(bomb.connection, BOMB_CELL))
        children = result["children"]
        assert result["stopped"] == "Resource temporarily unavailable", "the bomb met its lease's limit"
        assert len(children) < PER_HALF, f"{len(children)} children in a lease of {PER_HALF} tasks"
        assert all(alive(pid) for pid in children[-10:]), "the bomb holds its limit while the node is checked"

        assert _cell(neighbour.connection, NEIGHBOUR_CELL) == "20 7\n", "another user's worker starts processes"
        fresh = bob.get_lease(bob.create_lease(LeaseRequest(fraction=0.25)).id, wait=60, state="starting")
        assert fresh.state.value == "active", fresh.reason
        assert _cell(fresh.connection, "print(6 * 7)") == "42\n"

        agent.proc.kill()  # the agent starts again next to the bomb (re-adopting it) and serves
        agent.proc.wait()
        agent = start_agent(tmp_path, service, extra_args=args, launcher=launcher,
                            port=int(agent.url.rsplit(":", 1)[1]))
        wait_for(lambda: f"of lease {bomb.id}" in agent.log.read_text(), 30, "the re-adoption", agent.proc, agent.log)

        ended = tester.release(bomb.id)
        assert ended.state.value == "released", ended.reason
        assert "not confirmed" not in (ended.reason or ""), ended.reason
        wait_for(lambda: not any(alive(pid) for pid in children), 10, "every child of the bomb to die")
        assert not alive(bomb.worker["pid"])
        assert _cell(neighbour.connection, "print('still here')") == "still here\n"
        for lease in (neighbour, fresh):
            assert bob.release(lease.id).state.value == "released"
    finally:
        agent.stop()
        service.stop()
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_no_cgroup_says_loudly_that_processes_are_not_limited(tmp_path, caplog):
    tree = containment("none", "", tmp_path)
    with caplog.at_level(logging.WARNING, "gpupool.test"):
        assert process_limits.plan(tree, 1024, 0, 2, logging.getLogger("gpupool.test")) is None
    assert "PROCESS LIMITS NOT ENFORCED" in caplog.text and "cgroup_mode = 'none'" in caplog.text
