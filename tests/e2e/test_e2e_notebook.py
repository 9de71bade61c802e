"""End to end: a real notebook kernel (gpupool kernelspec and provisioner)
attaches to a real worker through a real service and agent."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from frontend import run
from frontend import busy_seen, remote_value
from service_api import active_leases, ended_lease
from gpupool.errors import GPUPoolError
from gpupool.wire.leases import LeaseRequest
from procs import wait_for

ROOT = Path(__file__).resolve().parents[2]


def test_cells_run_on_the_worker_and_outputs_arrive_in_order(e2e_pool, kernel):
    service, _, _ = e2e_pool
    _, kc = kernel
    local_pid, local_lease = remote_value(kc, "import os; (os.getpid(), os.environ.get('GPUPOOL_LEASE_ID'))")
    attach = run(kc, "%gpu acquire 0.5")
    assert attach.ok, attach.text()
    assert "attached L-" in attach.stdout and "NVIDIA A100-SXM4-80GB" in attach.stdout

    cell = run(kc, "import os, sys\nprint('one')\nfrom IPython.display import HTML, display\n"
                   "display(HTML('<b>two</b>'))\nprint('three', file=sys.stderr)\n"
                   "(os.getpid(), os.environ['GPUPOOL_LEASE_ID'])")
    assert cell.ok, cell.text()
    assert cell.kinds == ["stream", "display_data", "stream", "execute_result"]
    assert cell.outputs[0][1] == {"name": "stdout", "text": "one\n"}
    assert cell.outputs[1][1]["data"]["text/html"] == "<b>two</b>"
    assert cell.outputs[2][1] == {"name": "stderr", "text": "three\n"}
    result = cell.outputs[3][1]
    assert result["execution_count"] == cell.reply["execution_count"]
    worker_pid, lease_id = eval(result["data"]["text/plain"])  # noqa: S307
    assert worker_pid != local_pid and lease_id.startswith("L-") and local_lease is None
    assert [lease.id for lease in active_leases(service)] == [lease_id]

    failing = run(kc, "def train():\n    raise ValueError('boom from the worker')\ntrain()")
    assert not failing.ok and failing.reply["ename"] == "ValueError"
    (kind, error), = failing.outputs
    assert kind == "error" and error["ename"] == "ValueError"
    traceback = "\n".join(error["traceback"])
    assert "boom from the worker" in traceback and "train()" in traceback
    assert remote_value(kc, "os.getpid()") == worker_pid, "the worker survives a failed cell"

    released = run(kc, "%gpu release")
    assert released.ok, released.text()
    assert f"released {lease_id}" in released.stdout and "worker_pid" not in released.stdout
    wait_for(lambda: not psutil.pid_exists(worker_pid), 10, "worker stopped after release")
    assert remote_value(kc, "os.getpid()") == local_pid, "after release cells run locally again"
    assert active_leases(service) == []


def test_release_brings_variables_back_and_push_pull_move_them(kernel):
    _, kc = kernel
    assert run(kc, "local_list = [1, 2, 3]\n%gpu acquire 0.25").ok
    pushed = run(kc, "%gpu push local_list")
    assert pushed.ok and "pushed 1 variable: local_list (list" in pushed.stdout
    assert remote_value(kc, "local_list + [4]") == [1, 2, 3, 4]
    assert run(kc, "import threading\nsquares = {i: i * i for i in range(5)}\nlock = threading.Lock()").ok
    pulled = run(kc, "%gpu pull squares")
    assert pulled.ok and "pulled 1 variable" in pulled.stdout
    released = run(kc, "%gpu release")
    assert released.ok
    assert "lost with the worker: 1 that cannot be pickled (lock)" in released.stdout, released.stdout
    assert remote_value(kc, "squares[4], local_list, 'lock' in dir()") == (16, [1, 2, 3], False)


def test_kernel_shutdown_releases_its_lease(e2e_pool, kernel):
    service, _, _ = e2e_pool
    km, kc = kernel
    assert run(kc, "%gpu acquire 0.5").ok
    worker_pid = remote_value(kc, "__import__('os').getpid()")
    lease, = active_leases(service)
    kc.stop_channels()
    km.shutdown_kernel(now=False)
    ended = service.client().get_lease(lease.id)
    assert ended.state.value == "released"
    assert not psutil.pid_exists(worker_pid)


def test_a_killed_kernels_lease_is_reclaimed_after_the_heartbeat_ttl(e2e_pool, kernel):
    service, _, _ = e2e_pool
    km, kc = kernel
    assert run(kc, "%gpu acquire 0.5").ok
    lease, = active_leases(service)
    os.kill(km.provisioner.pid, signal.SIGKILL)
    ended = ended_lease(service, lease.id, 15, "heartbeat reclaim")
    assert ended.state.value == "reclaimed" and "heartbeat" in ended.reason


def test_idle_lease_is_released_and_the_notebook_says_so(e2e_pool, kernel):
    service, _, _ = e2e_pool
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.5 --idle-timeout 2s --on-idle release").ok
    lease, = active_leases(service)
    ended = ended_lease(service, lease.id, 15, "idle reclaim")
    assert ended.state.value == "reclaimed" and "idle" in ended.reason
    time.sleep(1.5)  # one client heartbeat sees it
    cell = run(kc, "1 + 1")
    assert not cell.ok
    assert f"lease {lease.id} was reclaimed: idle" in cell.text() and "did not run" in cell.text()
    assert cell.text().count(f"lease {lease.id} was reclaimed") == 1, "said once: the cell's error"
    assert remote_value(kc, "1 + 1") == 2, "the next cell runs locally"


def test_a_long_quiet_cell_is_not_reclaimed(e2e_pool, kernel):
    service, _, _ = e2e_pool
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.5 --idle-timeout 2s --on-idle release").ok
    cell = run(kc, "import time\ntime.sleep(5)\n'still attached'")
    assert cell.ok and cell.outputs[-1][1]["data"]["text/plain"] == "'still attached'"
    lease, = active_leases(service)
    assert lease.state.value == "active"


def test_two_halves_share_a_gpu_the_third_goes_to_the_other_and_the_fifth_is_refused(pool):
    # Its own pool: leases made through the API send no heartbeats, and the
    # module's pool reclaims those after 3 s, which could free a GPU mid-test.
    service, _ = pool
    client = service.client()
    leases = []
    try:
        for _ in range(4):
            lease = client.create_lease(LeaseRequest(fraction=0.5))
            leases.append(client.get_lease(lease.id, wait=30, state="starting"))
        assert all(lease.state.value == "active" for lease in leases)
        gpus = [lease.gpus[0]["uuid"] for lease in leases]
        assert gpus[0] == gpus[1] and gpus[2] == gpus[3] and gpus[0] != gpus[2]
        with pytest.raises(GPUPoolError) as refused:
            client.create_lease(LeaseRequest(fraction=0.5))
        assert refused.value.code == "pool_full" and refused.value.status == 409
        assert "0.50" in refused.value.message
        assert len(active_leases(service)) == 4, "the refusal changed nothing"
    finally:
        pids = [lease.worker["pid"] for lease in leases if lease.worker]
        for lease in leases:
            client.release(lease.id)
    assert active_leases(service) == []
    assert not any(psutil.pid_exists(pid) for pid in pids)


@pytest.mark.timeout(300)  # trains a model: on a busy 2-core machine it can pass two minutes
def test_quickstart_notebook_runs_headless(e2e_pool, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("JUPYTER_PATH", str(e2e_pool[2].parent))
    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="gpupool", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the matplotlib figure reached the notebook"
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs), \
        "the worker's tqdm bar reached the notebook as a widget"
    result = nb.cells[-1].outputs[-1]["data"]["application/json"]
    assert result["accuracy"] > 0.9 and result["local_accuracy"] == pytest.approx(result["accuracy"])
    assert active_leases(e2e_pool[0]) == []


def test_input_and_interrupt_reach_the_worker(e2e_pool, kernel):
    km, kc = kernel
    assert run(kc, "%gpu acquire 0.25").ok
    worker_pid = remote_value(kc, "import os; os.getpid()")
    asked = run(kc, "name = input('your name? ')\nprint('hello', name, os.getpid())", stdin=["ann"])
    assert asked.ok, asked.text()
    assert asked.outputs[0] == ("input_request", {"prompt": "your name? ", "password": False})
    assert asked.stdout == f"hello ann {worker_pid}\n"

    msg_id = kc.execute("while True:\n    pass")
    wait_for(lambda: busy_seen(kc, msg_id), 10, "the tight loop started")
    time.sleep(0.5)
    interrupted_at = time.monotonic()
    km.interrupt_kernel()
    reply = kc.get_shell_msg(timeout=10)["content"]
    assert time.monotonic() - interrupted_at < 5.0  # a bound on "stops", not a speed measurement
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    assert remote_value(kc, "os.getpid()") == worker_pid, "the slice stays attached after an interrupt"


def test_a_worker_killed_mid_cell_ends_the_cell_with_words(e2e_pool, kernel):
    service, _, _ = e2e_pool
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25").ok
    worker_pid = remote_value(kc, "import os; os.getpid()")
    lease, = active_leases(service)
    msg_id = kc.execute("import time\ntime.sleep(120)")
    wait_for(lambda: busy_seen(kc, msg_id), 10, "the long cell started")
    os.kill(worker_pid, signal.SIGKILL)
    reply = kc.get_shell_msg(timeout=30)["content"]
    assert reply["status"] == "error"
    assert f"lease {lease.id} failed: the worker process was killed by signal 9" in reply["evalue"]
    assert "The worker's variables were lost with it" in reply["evalue"] and "this cell was stopped with it. " \
        "Run %gpu acquire 0.25 to attach again" in reply["evalue"], reply["evalue"]
    assert active_leases(service) == []
    assert remote_value(kc, "__import__('os').getpid()") != worker_pid, "detached: cells run locally again"


def test_a_worker_past_its_host_memory_tells_the_notebook_the_limit_and_the_way_out(e2e_pool, kernel):
    service, _, _ = e2e_pool
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25 --host-memory 512MiB").ok
    lease, = active_leases(service)
    cell = run(kc, "b = bytearray(1024 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1", timeout=60)
    if cell.ok:
        pytest.skip("the cell's 1 GiB fit: this host enforces no host memory limit (no memory controller, not root)")
    assert (f"lease {lease.id} failed: the worker was killed: it ran out of its 512.0 MiB of host memory "
            "(--host-memory); acquire again with a larger --host-memory") in cell.reply["evalue"], cell.text()
    assert active_leases(service) == []


def test_release_after_the_worker_died_frees_the_slice_without_hanging(e2e_pool, kernel):
    service, _, _ = e2e_pool
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25 --on-idle release").ok
    worker_pid = remote_value(kc, "import os; os.getpid()")
    os.kill(worker_pid, signal.SIGKILL)
    released = run(kc, "%gpu release", timeout=40)
    # Either the heartbeat already saw the lease fail (one UsageError line) or the
    # pull found the worker gone; both leave the kernel detached and the slice free.
    assert "failed: the worker process was killed by signal 9" in released.text() or \
        "could not come back" in released.stdout, released.text()
    wait_for(lambda: active_leases(service) == [], 15, "the slice freed")
    assert remote_value(kc, "__import__('os').getpid()") != worker_pid


def test_an_error_in_a_local_cell_fails_the_cell_once(kernel):
    _, kc = kernel
    cell = run(kc, "%%local\n1 / 0")
    assert not cell.ok and cell.reply["ename"] == "ZeroDivisionError"
    errors = [content for kind, content in cell.outputs if kind == "error"]
    assert sum("ZeroDivisionError" in "\n".join(e["traceback"]) for e in errors) == 1, "the traceback shows once"


def test_a_cell_on_a_worker_that_stopped_answering_ends_with_words(e2e_pool, kernel):
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25 --on-idle release").ok
    worker_pid = remote_value(kc, "import os; os.getpid()")
    os.kill(worker_pid, signal.SIGSTOP)  # as if its node or network vanished: no message, no heartbeat echo
    try:
        cell = run(kc, "1 + 1", timeout=60)
    finally:
        os.kill(worker_pid, signal.SIGCONT)
    assert not cell.ok and "stopped answering for 10s" in cell.text(), cell.text()
    assert run(kc, "%gpu release --discard").ok
