"""kill -9 of each process kind in the middle of a cell: the pool service, the
node agent, the worker, the notebook kernel.

Each scenario runs a real service (SQLite), a real agent (one warm worker)
and a real notebook kernel on the gpupool kernelspec that holds a lease and
runs a cell on its worker. The process is killed with SIGKILL while the
cell runs; daemons are started again on the same port. Then:

- what the user sees: the cell and the next one behave as each kind
  promises (the service and the agent come back without the user noticing,
  on the same worker with the same variables; a dead worker fails its lease
  with the signal in words; a dead kernel's lease is reclaimed after its
  heartbeat TTL);
- no leak: every live worker process under the agent's state dir is the
  worker of a lease that holds capacity, or a warm worker of the agent now
  running; every lease that holds capacity has a live worker; at the end no
  lease holds capacity and the pool is empty;
- the ledger adds up: one ledger row per ended lease, each equal to
  fraction x GPUs x (ended - started) and to the lease's
  ``usage_gpu_seconds``, and the admin usage report sums to the same total
  (nothing lost across the outage, nothing counted twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import urllib.request
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from frontend import install_kernelspec, run, start_gpupool_kernel
from gpupool.demo_pool import GPUPOOL
from gpupool.node.workers import WorkerManager, WorkerLaunch, WorkerSpec
from gpupool.node.workers.kernel import history_path
from gpupool.wire.leases import LeaseRequest
from gpupool.wire.nodes import GPUInfo
from procs import start_agent, start_service, wait_for

# The four process kinds, and the agent once more with the lease released while it was down.
KINDS = ["service", "agent", "worker", "kernel", "agent-lease-ended-meanwhile"]
HEARTBEAT_TTL = 3.0
CONFIG = {"heartbeat_ttl": HEARTBEAT_TTL, "node_ttl": 5.0, "admin_users": {"tester"}}
# A cell that runs until the test creates its gate file.
GATED_CELL = ("import os, pathlib, time\npathlib.Path({started!r}).touch()\n"
              "while not os.path.exists({gate!r}):\n    time.sleep(0.05)\nx += 1\nprint('done', x)")


class Pool:
    """A service, an agent and a notebook kernel under ``root``, each of
    which a scenario may kill and (for the daemons) start again."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.service = start_service(root, config=CONFIG)
        self.service_port = int(self.service.url.rsplit(":", 1)[1])
        self.agent = start_agent(root, self.service)
        self.agent_port = int(self.agent.url.rsplit(":", 1)[1])
        kernels = install_kernelspec(root / "prefix", self.service.url, self.service.user_token)
        self.km, self.kc = start_gpupool_kernel(kernels, root)
        self.gate = root / "gate"

    def open_gate(self) -> None:
        """Let the running cell end."""
        self.gate.touch()

    def agent_reports(self) -> dict[str, str]:
        """Lease id -> execution state of its worker, as the agent sees it now."""
        request = urllib.request.Request(f"{self.agent.url}/workers",
                                         headers={"Authorization": f"token {self.service.agent_token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return {w["lease_id"]: w["execution_state"] for w in json.load(response)["workers"]}

    def restart_service(self) -> None:
        self.service = start_service(self.root, config=CONFIG, port=self.service_port,
                                     tokens={"tester": self.service.user_token})

    def restart_agent(self) -> None:
        self.agent = start_agent(self.root, self.service, port=self.agent_port)
        # The service still lists the node as up: wait for this agent's own registration.
        info = self.agent.state_dir / "agent.json"
        wait_for(lambda: info.exists() and json.loads(info.read_text())["pid"] == self.agent.proc.pid, 30,
                 "the restarted agent's registration", self.agent.proc, self.agent.log)

    def close(self) -> None:
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=False)
        else:
            self.km.cleanup_resources()
        try:
            self.agent.stop()  # raises if any process under its state dir is left
        finally:
            # Workers outlive a killed agent: a failed scenario must not leave them running.
            for proc in worker_processes(self.agent).values():
                with contextlib.suppress(psutil.Error):
                    for victim in [*proc.children(recursive=True), proc]:
                        victim.kill()
            self.service.stop()


@pytest.fixture
def notebook_pool(tmp_path):
    pool = Pool(tmp_path)
    yield pool
    pool.close()


def cell_value(kc, code: str):
    cell = run(kc, code)
    assert cell.ok, cell.text()
    return eval(cell.outputs[-1][1]["data"]["text/plain"])  # noqa: S307 - a repr the test itself asked for


def start_gated_cell(pool: Pool, lease_id: str) -> str:
    """Start GATED_CELL and return its msg id once it runs on the worker."""
    kc = pool.kc
    started_file = pool.root / "gated-cell-started"
    msg_id = kc.execute(GATED_CELL.format(gate=str(pool.gate), started=str(started_file)))

    def started() -> bool:
        try:
            msg = kc.get_iopub_msg(timeout=0.1)
        except Exception:  # queue.Empty
            return False
        return msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_input"

    wait_for(started, 30, "the gated cell started")
    # The cell itself runs on the worker (not only the notebook's name check before it), and the agent saw it.
    wait_for(started_file.exists, 30, "the gated cell running on the worker")
    wait_for(lambda: pool.agent_reports().get(lease_id) == "busy", 30, "the worker running the gated cell")
    return msg_id


def finish_cell(kc, msg_id: str) -> tuple[dict, str]:
    """The reply of cell ``msg_id`` and its stdout."""
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    reply = kc.get_shell_msg(timeout=60)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=60)
    return reply["content"], "".join(out)


def worker_processes(agent) -> dict[int, psutil.Process]:
    """Live worker processes of ``agent`` (their connection file is under its state dir)."""
    mark = f"{agent.state_dir}{os.sep}workers{os.sep}kernel-"
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(mark in arg for arg in proc.info["cmdline"] or ()):
            found[proc.pid] = proc
    return found


def assert_no_leak(pool: Pool) -> None:
    """Every lease holding capacity has a live worker, and every live worker
    is a lease's or one of the running agent's own (warm) children."""
    holding = [lease for lease in pool.service.client().list_leases(active=True) if lease.state.holds_capacity]
    workers = worker_processes(pool.agent)
    assert all(lease.worker and lease.worker["pid"] in workers for lease in holding), (holding, workers)
    agents_own = {child.pid for child in psutil.Process(pool.agent.proc.pid).children(recursive=True)}  # warm: forked by its template
    strays = set(workers) - {lease.worker["pid"] for lease in holding} - agents_own
    assert strays == set(), f"worker processes no lease holds: {strays}"
    allocated = sum(gpu["allocated_fraction"] for node in pool.service.client().pool()["nodes"] for gpu in node["gpus"])
    assert allocated == pytest.approx(sum(lease.fraction * lease.gpu_count for lease in holding))


def assert_ledger_adds_up(pool: Pool) -> int:
    """Every lease has ended; returns how many there were."""
    leases = pool.service.client().list_leases(active=False)
    assert leases and all(lease.state.ended for lease in leases), [(l.id, l.state) for l in leases]
    with sqlite3.connect(f"file:{pool.service.state_dir / 'gpupool.sqlite'}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT lease_id, gpu_seconds FROM usage_ledger").fetchall()
    assert sorted(lease_id for lease_id, _ in rows) == sorted(lease.id for lease in leases), "one row per lease"
    ledger = dict(rows)
    for lease in leases:
        held = (datetime.fromisoformat(lease.ended_at) - datetime.fromisoformat(lease.started_at)).total_seconds()
        assert ledger[lease.id] == pytest.approx(lease.fraction * lease.gpu_count * held, abs=1e-6)
        assert lease.usage_gpu_seconds == pytest.approx(ledger[lease.id], abs=1e-6)
    reported = pool.service.client().admin_usage(days=7)["daily_gpu_hours"].get("tester", {})
    assert 3600 * sum(reported.values()) == pytest.approx(sum(ledger.values()), abs=1e-6)
    return len(leases)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def lease_of(pool: Pool):
    lease, = pool.service.client().list_leases(active=True)
    return lease


@pytest.mark.parametrize("kind", KINDS)
def test_kill9_mid_cell_leaks_nothing_and_the_ledger_adds_up(notebook_pool, kind):
    pool, kc = notebook_pool, notebook_pool.kc
    attach = run(kc, "%gpu acquire 0.25")
    assert attach.ok, attach.text()
    # The cell leaves a process of its own running: it must not outlive the lease either.
    worker_pid, child_pid = cell_value(kc, "import os, subprocess\nx = 41\n"
                                           "child = subprocess.Popen(['sleep', '600'])\n(os.getpid(), child.pid)")
    lease = lease_of(pool)
    assert lease.worker["pid"] == worker_pid
    msg_id = start_gated_cell(pool, lease.id)

    if kind == "service":
        os.kill(pool.service.proc.pid, signal.SIGKILL)
        pool.service.proc.wait()
        pool.open_gate()
        reply, out = finish_cell(kc, msg_id)
        assert reply["status"] == "ok" and "done 42" in out, "the worker does not need the service to run a cell"
        pool.restart_service()
        assert pool.service.client().get_lease(lease.id).state.value == "active"
        assert cell_value(kc, "os.getpid(), x") == (worker_pid, 42), "re-adopted: same worker, same variables"
        assert_no_leak(pool)

    elif kind == "agent":
        # Its warm worker (refilled after the lease took one) is left behind too.
        warm_before = wait_for(lambda: set(worker_processes(pool.agent)) - {worker_pid}, 30, "a warm worker")
        os.kill(pool.agent.proc.pid, signal.SIGKILL)
        pool.agent.proc.wait()
        pool.restart_agent()  # while the cell still runs
        assert "re-adopted 1 worker(s)" in pool.agent.log.read_text()
        assert pool.agent_reports() == {lease.id: "busy"}, "a re-adopted worker mid-cell is busy, not idle"
        pool.open_gate()
        reply, out = finish_cell(kc, msg_id)
        assert reply["status"] == "ok" and "done 42" in out, "the worker outlives its agent"
        wait_for(lambda: pool.agent_reports() == {lease.id: "idle"}, 30, "the re-adopted worker idle after its cell")
        assert pool.service.client().get_lease(lease.id).state.value == "active"
        assert cell_value(kc, "os.getpid(), x") == (worker_pid, 42), "re-adopted: same worker, same variables"
        assert not warm_before & set(worker_processes(pool.agent)), "the old agent's warm worker was stopped"
        assert_no_leak(pool)

    elif kind == "agent-lease-ended-meanwhile":
        os.kill(pool.agent.proc.pid, signal.SIGKILL)
        pool.agent.proc.wait()
        pool.open_gate()
        reply, out = finish_cell(kc, msg_id)
        assert reply["status"] == "ok" and "done 42" in out
        # Once the service says the node is lost, %gpu status says so too, and what it means.
        wait_for(lambda: pool.service.client().get_lease(lease.id).node_state == "lost", 30, "the node lost")
        status = run(kc, "%gpu status")
        assert status.ok, status.text()
        shown = status.outputs[-1][1]["data"]["text/plain"]
        assert re.search(rf"node {lease.node} is lost: no heartbeat from its agent for \S+ \(last heard from \S+ "
                         rf"ago, at \d\d:\d\d:\d\d UTC\)\. Lease {lease.id}'s worker cannot be reached: the next cell "
                         "will fail", shown), shown
        assert re.search(rf"{lease.id} .* unknown \(node lost\) ", shown), "not the agent's last report, stale now"
        released = run(kc, "%gpu release --discard")
        assert released.ok, released.text()
        ended = pool.service.client().get_lease(lease.id)
        assert ended.state.value == "released"
        assert "its worker was not confirmed stopped" in ended.reason
        assert "; the pool says: its worker was not confirmed stopped" in released.stdout, released.text()
        assert alive(worker_pid), "no agent was there to stop it"
        pool.restart_agent()
        # Re-adopted, reported, and stopped because no lease holds it.
        wait_for(lambda: not alive(worker_pid), 30, "the worker no lease holds stopped")

    elif kind == "worker":
        os.kill(worker_pid, signal.SIGKILL)
        reply, _ = finish_cell(kc, msg_id)
        assert reply["status"] == "error"
        assert f"lease {lease.id} failed: the worker process was killed by signal 9" in reply["evalue"]
        assert pool.service.client().get_lease(lease.id).state.value == "failed"
        assert_no_leak(pool)
        # Traffic goes on: a new lease on a new worker.
        assert run(kc, "%gpu acquire 0.25").ok
        assert cell_value(kc, "import os\nos.getpid()") not in (worker_pid, None)

    else:  # the notebook kernel
        os.kill(pool.km.provisioner.pid, signal.SIGKILL)
        pool.open_gate()  # a running cell is never reclaimed: let it end
        ended = wait_for(lambda: (got := pool.service.client().get_lease(lease.id)).state.ended and got,
                         HEARTBEAT_TTL + 30, "the dead kernel's lease reclaimed")
        assert ended.state.value == "reclaimed" and "heartbeat" in ended.reason
        assert not alive(worker_pid)

    if kind in ("service", "agent", "worker"):
        released = run(kc, "%gpu release --discard")
        assert released.ok, released.text()
    wait_for(lambda: pool.service.client().list_leases(active=True) == [], 30, "every lease ended")
    assert_no_leak(pool)
    assert worker_pid not in worker_processes(pool.agent)
    assert not alive(child_pid), "what the cell started went with its worker"
    assert assert_ledger_adds_up(pool) == (2 if kind == "worker" else 1)


def test_a_second_agent_on_the_same_state_dir_is_refused_and_stops_nothing(pool):
    """A starting agent takes over every worker under its state dir, so it
    must refuse a state dir that a live agent uses."""
    service, agent = pool
    lease = service.client().create_lease(LeaseRequest(fraction=0.5))
    lease = wait_for(lambda: (got := service.client().get_lease(lease.id)).state.value != "starting" and got, 60,
                     "the lease's worker")
    assert lease.state.value == "active", lease.reason
    second = subprocess.run([*GPUPOOL, "agent", f"--service-url={service.url}",
                             f"--token-file={service.process.agent_token_file}", "--name=node-2", "--port=0",
                             f"--state-dir={agent.state_dir}", "--simulate=1xA100-80GB"],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode != 0
    assert f"another agent is running with the state directory {agent.state_dir}" in second.stderr, second.stderr
    assert alive(lease.worker["pid"]) and service.client().get_lease(lease.id).state.value == "active"
    assert [node["name"] for node in service.client().pool()["nodes"]] == ["node-1"]


async def run_code(worker, code: str) -> str:
    """Run ``code`` on ``worker`` through its manager's client (as the agent
    reaches it); returns its stdout."""
    client = worker.manager.client()
    client.start_channels()
    out: list[str] = []
    try:
        reply = await client.execute_interactive(
            code, timeout=30, output_hook=lambda msg: out.append(msg["content"]["text"])
            if msg["msg_type"] == "stream" else None)
    finally:
        client.stop_channels()
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(out)


def test_a_restarted_agent_kills_what_a_dead_workers_cells_left_and_skips_bad_records(tmp_path):
    """``WorkerManager.recover`` on the state dir of a manager that was never
    stopped (an agent killed with -9): the live worker is re-adopted and can
    be stopped; a worker that died meanwhile has its cell's process killed;
    unreadable or invalid records are skipped and removed."""
    gpu = GPUInfo("GPU-0", "NVIDIA A100-SXM4-80GB", 0, 80 * 2**30)

    async def scenario() -> None:
        first = WorkerManager(WorkerLaunch(tmp_path, node="n1"))
        kept = await first.start(WorkerSpec("L-kept", "ann", (gpu,), 0.25, 2**30))
        dies = await first.start(WorkerSpec("L-dies", "bob", (gpu,), 0.25, 2**30))
        left = int(await run_code(dies, "import subprocess\nprint(subprocess.Popen(['sleep', '600']).pid)"))
        for worker in (kept, dies):  # the first agent is gone: nothing of it acts any more
            worker.watcher.cancel()
        await asyncio.gather(kept.watcher, dies.watcher, return_exceptions=True)
        os.kill(dies.pid, signal.SIGKILL)
        dies.process.wait()
        assert alive(left), "killing a worker leaves what its cell started"
        workers = tmp_path / "workers"
        (workers / "L-torn.lease.json").write_text('{"lease_id": "L-torn", ')
        bad = json.loads((workers / "L-kept.lease.json").read_text()) | {"lease_id": "../escape"}
        (workers / "L-bad.lease.json").write_text(json.dumps(bad))

        second = WorkerManager(WorkerLaunch(tmp_path, node="n1"))
        adopted = await second.recover()
        assert [worker.spec.lease_id for worker in adopted] == ["L-kept"] and adopted[0].pid == kept.pid
        assert not alive(left), "the dead worker's cell left a process: killed"
        assert sorted(p.name for p in workers.iterdir()) == sorted(
            Path(p).name for p in (kept.manager.connection_file, kept.log_path, history_path(kept.log_path),
                                   workers / "L-kept.lease.json"))
        for _ in range(200):  # busy until its shell answers, at once when no cell runs
            if [(r.lease_id, r.execution_state) for r in second.reports()] == [("L-kept", "idle")]:
                break
            await asyncio.sleep(0.05)
        assert [(r.lease_id, r.execution_state) for r in second.reports()] == [("L-kept", "idle")]
        assert await run_code(adopted[0], "print(6 * 7)") == "42\n", "the new agent's own client reaches it"
        assert await second.stop("L-kept") is None, "not our child: its exit code is unknown"
        assert not alive(kept.pid) and list(workers.iterdir()) == []
        second.close()
        first.close()
        kept.process.wait()  # reap the test's own child

    asyncio.run(scenario())
