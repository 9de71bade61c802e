"""Workers: real ipykernel processes started, watched and stopped by WorkerManager."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from datetime import datetime

import psutil
import pytest

from gpupool.node.activity import WorkerActivity
from gpupool.node.enforcement import MPS
from gpupool.node.inventory.simulated import SimulatedInventory
from gpupool.node.workers import (WORKER_EXTENSION, WorkerManager, WorkerLaunch, WorkerSpec,
                                         WorkerStartError, worker_environment)
from gpupool.node.workers.kernel import KernelManagers, kernel_arguments
from gpupool.node.workers.process import AdoptedProcess, LocalProcess
from procs import processes_mentioning
from workercell import run_worker_cell

GiB = 1024**3
GPUS = SimulatedInventory("2xA100-80GB", "node-1").discover()
SECRETS = {"GPUPOOL_AGENT_TOKEN": "agent-secret", "JUPYTERHUB_API_TOKEN": "hub-secret",
           "AWS_SECRET_ACCESS_KEY": "aws-secret", "MY_API_KEY": "k"}



def manager(tmp_path, **kwargs) -> WorkerManager:
    return WorkerManager(WorkerLaunch(tmp_path / "state", node="node-1", environ={**os.environ, **SECRETS},
                                        stop_timeout=5, start_timeout=30, **kwargs))


def half_slice(lease_id: str = "L-000000000001") -> WorkerSpec:
    return WorkerSpec(lease_id, "ann", (GPUS[1],), 0.5, 40 * GiB)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_worker_started_after_the_mode_changed_gets_the_new_modes_slice(tmp_path):
    """The agent's mode can change when the GPUs are read again (``auto`` finding MIG); a worker started
    after that is sliced by the new mode, not the one the manager began with."""
    async def scenario():
        workers = manager(tmp_path)  # timeslice: no MPS share in the environment
        try:
            workers.use_enforcement(MPS())
            worker = await workers.start(half_slice())
            code = "import json, os\nprint(json.dumps(dict(os.environ)))"
            env = json.loads(await run_worker_cell(worker.connection(), code))
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        finally:
            await workers.stop_all()

    asyncio.run(scenario())


def test_worker_runs_confined_to_its_slice_and_stops(tmp_path):
    async def scenario():
        workers = manager(tmp_path, enforcement=MPS())
        try:
            started = time.time()
            worker = await workers.start(half_slice())
            conn = worker.connection()
            assert set(conn) == {"ip", "transport", "shell_port", "iopub_port", "stdin_port", "control_port",
                                 "hb_port", "transfer_port", "signature_scheme", "key"}
            assert len({conn[k] for k in conn if k.endswith("_port")}) == 6, "the data plane has a port of its own"
            assert conn["ip"] == "127.0.0.1" and isinstance(conn["key"], str) and conn["key"]
            # the command line names the state dir: tests and admins find workers by it
            assert processes_mentioning(str(tmp_path / "state")) == [worker.pid]
            [report] = workers.reports()
            assert report.execution_state == "idle" and report.pid == worker.pid
            ready_at = datetime.fromisoformat(report.idle_since.replace("Z", "+00:00")).timestamp()
            assert started <= ready_at <= time.time()

            code = ("import json, os\n"
                    "print(json.dumps({'env': dict(os.environ), "
                    f"'loaded': {WORKER_EXTENSION!r} in get_ipython().extension_manager.loaded, "
                    "'history': str(get_ipython().history_manager.hist_file)}))")
            seen = json.loads(await run_worker_cell(conn, code))
            # its IPython history is its own (a notebook kernel of the same user on this host keeps ~/.ipython's)
            assert Path(seen["history"]).parent == tmp_path / "state" / "workers"
            env = seen["env"]
            assert seen["loaded"]
            assert env["GPUPOOL_LEASE_ID"] == "L-000000000001"
            assert env["CUDA_VISIBLE_DEVICES"] == GPUS[1].uuid
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
            assert env["GPUPOOL_MEMORY_LIMIT"] == str(40 * GiB)
            assert env["GPUPOOL_OWNER"] == "ann" and env["GPUPOOL_NODE"] == "node-1"
            assert not set(SECRETS) & set(env), "agent secrets leaked into the worker"
            assert "PATH" in env

            # idempotent start: same worker
            assert (await workers.start(half_slice())).pid == worker.pid

            # busy while a cell runs, idle_since = when it ended
            cell = asyncio.create_task(run_worker_cell(conn, "import time; time.sleep(1)"))
            states = set()
            while not cell.done():
                [report] = workers.reports()
                states.add((report.execution_state, report.idle_since))
                await asyncio.sleep(0.05)
            await cell
            assert ("busy", None) in states
            await asyncio.sleep(0.2)  # the final status message is on its way
            [report] = workers.reports()
            assert report.execution_state == "idle"
            assert datetime.fromisoformat(report.idle_since.replace("Z", "+00:00")).timestamp() >= ready_at + 1

            code = await workers.stop("L-000000000001")
            assert code == 0
            assert gone(worker.pid)
            assert workers.reports() == []
            assert not processes_mentioning(str(tmp_path / "state"))
            assert not list((tmp_path / "state" / "workers").glob("*.json"))
            assert not Path(seen["history"]).exists()
        finally:
            await workers.stop_all()
            workers.close()

    asyncio.run(scenario())


def test_killed_worker_is_reported_dead_and_its_children_go_too(tmp_path):
    async def scenario():
        workers = manager(tmp_path)
        try:
            worker = await workers.start(half_slice("L-killed"))
            # a process of the user's own, in a session of its own (killpg misses it)
            child = int(await run_worker_cell(worker.connection(),
                                                "import subprocess\n"
                                                "p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
                                                "print(p.pid)"))
            second = await workers.start(half_slice("L-stopped"))
            grandchild = int(await run_worker_cell(second.connection(),
                                                     "import subprocess\n"
                                                     "p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
                                                     "print(p.pid)"))
            os.kill(worker.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                reports = {r.lease_id: r for r in workers.reports()}
                if reports["L-killed"].execution_state == "dead":
                    break
                await asyncio.sleep(0.05)
            assert reports["L-killed"].exit_code == -9
            assert reports["L-killed"].idle_since is None
            assert reports["L-stopped"].execution_state == "idle"
            assert await workers.stop("L-killed") == -9
            assert await workers.stop("L-stopped") == 0
            assert gone(grandchild), "a process started by a stopped worker outlived its lease"
            with pytest.raises(KeyError):
                await workers.stop("L-killed")
        finally:
            await workers.stop_all()
            workers.close()
        return child, workers.cgroups.mode

    child, mode = asyncio.run(scenario())
    # The killed worker's own child left its session: only its cgroup holds it
    # (tests/node/test_containment.py); without one (not root) it is left.
    contained = gone(child)
    if not contained:
        os.kill(child, signal.SIGKILL)
    assert contained or mode == "none", f"a process in a session of its own outlived its {mode} cgroup"


def test_stop_unknown_lease_raises_keyerror(tmp_path):
    async def scenario():
        workers = manager(tmp_path)
        try:
            with pytest.raises(KeyError):
                await workers.stop("L-unknown")
        finally:
            workers.close()

    asyncio.run(scenario())


def test_worker_whose_extension_fails_does_not_start(tmp_path):
    async def scenario():
        workers = manager(tmp_path, extensions=["gpupool_no_such_extension"])
        try:
            with pytest.raises(WorkerStartError) as info:
                await workers.start(half_slice("L-broken"))
            assert "did not start: it exited with code 1" in str(info.value)
            assert "gpupool_no_such_extension" in str(info.value)
            assert workers.reports() == []
            assert not processes_mentioning(str(tmp_path / "state"))
        finally:
            workers.close()

    asyncio.run(scenario())


def test_a_worker_whose_port_was_taken_before_it_bound_starts_again_on_new_ports(tmp_path):
    """The race jupyter_client leaves open (ports picked free, bound by the
    kernel a moment later), made certain: the first try's shell port is one a
    socket here holds."""
    async def scenario():
        workers = manager(tmp_path)
        kernels, made = workers._launcher.kernels, []
        taken = socket.create_server(("127.0.0.1", 0))

        class FirstPortTaken:  # the node's KernelManagers, but its first kernel's shell port is taken
            context = kernels.context

            def __call__(self, connection_file, *kind):
                kernel = kernels(connection_file, *kind)
                if not made:
                    kernel.cache_ports = False  # else the provisioner picks every port anew
                    kernel.shell_port = taken.getsockname()[1]
                made.append(kernel)
                return kernel

        workers._launcher.kernels = FirstPortTaken()
        try:
            worker = await workers.start(half_slice("L-port"))
            assert len(made) == 2, "the worker was started again once"
            assert worker.connection()["shell_port"] != taken.getsockname()[1]
            assert (await run_worker_cell(worker.connection(), "print(6 * 7)")).strip() == "42"
            assert [r.lease_id for r in workers.reports()] == ["L-port"]
            assert processes_mentioning(str(tmp_path / "state")) == [worker.pid], "the first try left nothing"
        finally:
            taken.close()
            await workers.stop_all()
            workers.close()

    asyncio.run(scenario())


def test_bad_lease_ids_are_refused():
    with pytest.raises(ValueError, match="lease id"):
        half_slice("../etc/passwd")


def test_worker_environment_drops_secrets():
    agent_env = {"PATH": "/bin", "HOME": "/home/a", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps", "GPUPOOL_URL": "u",
                 "CUDA_VISIBLE_DEVICES": "0,1", **SECRETS, "GITHUB_TOKEN": "t", "DB_PASSWORD": "p"}
    env = worker_environment(agent_env, {"CUDA_VISIBLE_DEVICES": "GPU-a", "GPUPOOL_LEASE_ID": "L-1"})
    assert env == {"PATH": "/bin", "HOME": "/home/a", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps",
                   "CUDA_VISIBLE_DEVICES": "GPU-a", "GPUPOOL_LEASE_ID": "L-1"}


def test_kernel_arguments_load_extensions_strictly_and_write_history_seldom():
    assert kernel_arguments(["a.b", "c"]) == ["--IPKernelApp.extra_extensions=a.b", "--IPKernelApp.extra_extensions=c",
                                              "--HistoryManager.db_cache_size=1000",
                                              "--IPKernelApp.reraise_ipython_extension_failures=True",
                                              "--IPythonKernel._execute_sleep=0"]


@pytest.mark.parametrize("kind", ["local", "adopted"])
def test_both_worker_process_kinds_are_killed_alike(kind):
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    proc = psutil.Process(child.pid)
    process = LocalProcess(child) if kind == "local" else AdoptedProcess(proc, proc.create_time())
    try:
        assert not process.exited() and process.create_time() == pytest.approx(proc.create_time())
        assert process.kill([], 5.0) == []
    finally:
        child.kill()
        child.wait(5)  # an adopted process is reaped by its real parent: here, this test
    assert process.exited()
    if kind == "local":
        assert (process.returncode, process.exit_note) == (-signal.SIGKILL, None)
    else:
        assert process.returncode is None and "unknown" in process.exit_note


def _status(state: str, msg_id: str, msg_type: str = "execute_request") -> dict:
    return {"msg_type": "status", "content": {"execution_state": state},
            "parent_header": {"msg_id": msg_id, "msg_type": msg_type}}


def test_each_client_of_a_worker_numbers_its_requests_apart(tmp_path):
    # jupyter_client's clients share a clone of the manager's Session, whose counter starts at 0: the
    # re-adoption's control kernel_info and its tracking kernel_info had one msg_id, and the first one's
    # late idle made a worker mid-cell look idle (test_kill9, about once in five runs under load).
    kernels = KernelManagers(WorkerLaunch(tmp_path / "state", node="node-1"), logging.getLogger("test"))
    try:
        worker_manager = kernels(tmp_path / "kernel.json")
        first, second = worker_manager.client(), worker_manager.client()
        ids = {client.session.msg("kernel_info_request")["header"]["msg_id"] for client in (first, second)}
        assert len(ids) == 2, ids
        assert first.session.key == second.session.key == worker_manager.session.key, "still signed alike"
    finally:
        kernels.close()


def test_activity_counts_cells_not_other_requests():
    now = [100.0]
    activity = WorkerActivity(clock=lambda: now[0])
    activity.on_message(_status("busy", "k1", "kernel_info_request"))
    activity.on_message(_status("idle", "k1", "kernel_info_request"))
    assert activity.execution_state == "starting" and activity.idle_since is None
    activity.mark_ready()
    assert (activity.execution_state, activity.idle_since) == ("idle", 100.0)
    now[0] = 110.0
    activity.on_message(_status("busy", "comm", "comm_open"))  # the agent's own request before a park
    assert (activity.execution_state, activity.cell_running) == ("busy", False)
    activity.on_message(_status("busy", "cell"))
    assert (activity.execution_state, activity.idle_since, activity.cell_running) == ("busy", None, True)
    activity.on_message(_status("idle", "comm", "comm_open"))
    # a control request (interrupt, debug) answered while the cell runs
    activity.on_message(_status("busy", "ctl", "debug_request"))
    activity.on_message(_status("idle", "ctl", "debug_request"))
    assert activity.execution_state == "busy"
    now[0] = 150.0
    activity.on_message(_status("idle", "cell"))
    assert (activity.execution_state, activity.idle_since) == ("idle", 150.0)
    now[0] = 160.0
    activity.on_message(_status("busy", "c2", "complete_request"))
    activity.on_message(_status("idle", "c2", "complete_request"))
    assert activity.idle_since == 150.0  # completion is not use of the GPU
    assert activity.idle_since_iso() == "1970-01-01T00:02:30Z"
