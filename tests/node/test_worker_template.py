"""Cold workers forked from their interpreter's template (gpupool.zygote,
node/workers/launchers/local/template.py): the same worker a boot gives
(environment, folder, sys.path, command line, cgroup, exit code), faster,
and a boot whenever the template cannot serve."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import psutil
import pytest

from gpupool.node.inventory.simulated import SimulatedInventory
from gpupool.node.workers import WorkerLaunch, WorkerManager, WorkerSpec
from gpupool.node.workers.launchers.local.template import ForkedProcess
from gpupool.node.workers.process import LocalProcess
from procs import processes_mentioning
from workercell import run_worker_cell

GiB = 1024**3
GPUS = SimulatedInventory("2xA100-80GB", "node-1").discover()
#: What a cell reports of the process it runs in.
SELF = ("import json, os, sys\n"
        "print(json.dumps({'cwd': os.getcwd(), 'path0': sys.path[0], 'uid': os.getuid(), 'gid': os.getgid(),"
        " 'env': dict(os.environ), 'argv0': sys.argv[0], 'executable': sys.executable,"
        " 'pgid_is_pid': os.getpgid(0) == os.getpid(), 'sid_is_pid': os.getsid(0) == os.getpid(),"
        " 'stdin': os.readlink('/proc/self/fd/0')}))")


def manager(tmp_path, **kwargs) -> WorkerManager:
    return WorkerManager(WorkerLaunch(tmp_path / "state", node="node-1", stop_timeout=5, start_timeout=30,
                                      **kwargs))


def spec(lease_id: str, env_python: str | None = None) -> WorkerSpec:
    return WorkerSpec(lease_id, "ann", (GPUS[0],), 0.5, 40 * GiB)


async def template_of(workers: WorkerManager, timeout: float = 60.0):
    """The running template of this interpreter, once the launcher has it."""
    await workers._launcher.prepare()
    deadline = time.monotonic() + timeout
    while (template := workers._launcher.templates.running(sys.executable)) is None:
        assert time.monotonic() < deadline, "the worker template did not start"
        await asyncio.sleep(0.05)
    return template


def test_a_forked_worker_is_the_worker_a_boot_gives(tmp_path):
    async def scenario():
        forking, booting = manager(tmp_path / "fork"), manager(tmp_path / "boot", templates=False)
        try:
            template = await template_of(forking)
            forked = await forking.start(spec("L-fork"))
            booted = await booting.start(spec("L-fork"))
            assert isinstance(forked.process, ForkedProcess) and isinstance(booted.process, LocalProcess)
            assert psutil.Process(forked.pid).ppid() == template.pid
            seen = [json.loads(await run_worker_cell(w.connection(), SELF)) for w in (forked, booted)]
            for one in seen:  # the two differ only in where their state dir is
                one["env"] = {k: v.replace(str(tmp_path / "fork"), "X").replace(str(tmp_path / "boot"), "X")
                              for k, v in one["env"].items()}
                one["cwd"], one["path0"] = (p.replace(str(tmp_path / "fork"), "X").replace(str(tmp_path / "boot"), "X")
                                            for p in (one["cwd"], one["path0"]))
            forked_env, booted_env = seen[0].pop("env"), seen[1].pop("env")
            assert {k: (forked_env.get(k), booted_env.get(k)) for k in set(forked_env) | set(booted_env)
                    if forked_env.get(k) != booted_env.get(k)} == {}
            assert seen[0] == seen[1]
            assert seen[0]["path0"] == seen[0]["cwd"], "the worker's folder is first on sys.path, as python -m puts it"
            # admins and a restarted agent find it by the connection file its command line names
            assert psutil.Process(forked.pid).cmdline()[:4] == [sys.executable, "-m", "gpupool.kernelapp", "-f"]
            assert processes_mentioning(str(tmp_path / "fork" / "state")) == [forked.pid]
            # in its cgroup, with what its cells start
            child = int(await run_worker_cell(forked.connection(),
                                              "import subprocess\np = subprocess.Popen(['sleep', '60'])\nprint(p.pid)"))
            if forking.cgroups.mode != "none":
                assert {forked.pid, child} <= forked.cgroup.pids()
            await run_worker_cell(forked.connection(), "p.kill(); p.wait()")  # ipykernel's shutdown waits on children
            assert await forking.stop("L-fork") == 0  # the exit code, as the template saw it
            assert not psutil.pid_exists(forked.pid) or psutil.Process(forked.pid).status() == psutil.STATUS_ZOMBIE
        finally:
            for workers in (forking, booting):
                await workers.stop_all()
                workers.close()
        assert template.pid not in [p.pid for p in psutil.process_iter()], "the template outlived its agent"

    asyncio.run(scenario())


def test_a_forked_worker_that_exits_or_is_killed_reports_its_code(tmp_path):
    async def scenario():
        workers = manager(tmp_path)
        try:
            await template_of(workers)
            exiting, killed = await workers.start(spec("L-exit")), await workers.start(spec("L-kill"))
            assert isinstance(exiting.process, ForkedProcess) and isinstance(killed.process, ForkedProcess)
            with pytest.raises(Exception):
                await run_worker_cell(exiting.connection(), "import os; os._exit(3)", timeout=3)
            os.kill(killed.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                reports = {r.lease_id: r for r in workers.reports()}
                if all(r.execution_state == "dead" for r in reports.values()):
                    break
                await asyncio.sleep(0.05)
            assert (reports["L-exit"].exit_code, reports["L-kill"].exit_code) == (3, -9)
            assert await workers.stop("L-exit") == 3 and await workers.stop("L-kill") == -9
        finally:
            await workers.stop_all()
            workers.close()

    asyncio.run(scenario())


def test_a_worker_the_template_cannot_serve_boots(tmp_path):
    async def scenario():
        workers = manager(tmp_path, environ={**os.environ, "PYTHONPATH": str(tmp_path)})
        try:
            template = await template_of(workers)
            # the lease's environment says another library path than the template started with
            template.environ["LD_LIBRARY_PATH"] = "/nowhere"
            booted = await workers.start(spec("L-path"))
            assert isinstance(booted.process, LocalProcess)
            template.environ.pop("LD_LIBRARY_PATH")
            forked = await workers.start(spec("L-forked"))
            assert isinstance(forked.process, ForkedProcess)
            seen = json.loads(await run_worker_cell(forked.connection(), "import os, json, sys\n"
                                                    "print(json.dumps([os.environ.get('PYTHONPATH'), sys.path]))"))
            assert seen[0] == str(tmp_path) and str(tmp_path) in seen[1]

            # the template dies: a cold start boots, the forked worker runs on, a template comes back later
            os.kill(template.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while template.alive:
                assert time.monotonic() < deadline, "the agent did not notice its template's end"
                await asyncio.sleep(0.05)
            after = await workers.start(spec("L-after"))
            assert isinstance(after.process, LocalProcess)
            assert (await run_worker_cell(forked.connection(), "print(6 * 7)")).strip() == "42"
            assert {r.lease_id: r.execution_state for r in workers.reports()}["L-forked"] != "dead"
        finally:
            await workers.stop_all()
            workers.close()
        assert not processes_mentioning(str(tmp_path / "state")), "a worker outlived its lease"

    asyncio.run(scenario())
