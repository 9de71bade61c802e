"""Park in place, the node's side (docs/parking.md, "The agent's part"): a real
agent with simulated GPUs, the ``simulated`` checkpointer and this host's real
cgroup freezer, driven over its HTTP API; cells run through a jupyter_client
on the worker.

What is checked: a parked worker keeps everything (3 GiB of GPU memory, a
held lock, an open file, a half-consumed generator, its pid) and its GPU
memory shows freed in the inventory's readings; a frozen worker runs nothing
until its resume, and a loop frozen mid-way finishes every iteration; an agent
killed with -9 while a worker is parked re-adopts it frozen; the spill tier
(asked for, forced by the budget or by the host's memory) saves what it can
and says what it could not; bad input to both endpoints changes nothing.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from frontend import run
from gpupool.demo_pool import wait_for
from parkagent import GiB, MiB, ParkAgent

pytestmark = pytest.mark.timeout(300)

STATE = """
import threading, os
from gpupool.node import simgpu
import numpy as np
gpu = simgpu.zeros({nbytes}, 'uint8')
gpu[::4096] = np.arange(len(gpu[::4096])) % 251
lock = threading.Lock(); lock.acquire()
notes = open({path!r}, 'w+'); notes.write('written before the park'); notes.flush()
squares = (i * i for i in range(10)); first = [next(squares) for _ in range(3)]
numbers = list(range(1000))
print(os.getpid())
"""
CHECK = """
same = int(gpu[::4096].sum()) == int((np.arange(len(gpu[::4096])) % 251).sum())
print(os.getpid(), lock.locked(), notes.tell(), next(squares), same, simgpu.device_of(gpu), sum(numbers))
"""


@pytest.fixture
def agent(tmp_path):
    made = ParkAgent(tmp_path)
    yield made
    made.stop()


def cell(kc, code: str, timeout: float = 120) -> str:
    done = run(kc, code, timeout=timeout)
    assert done.ok, done.text()
    return done.stdout


def held(agent: ParkAgent, pid: int) -> int:
    return agent.inventory().process_memory().get(pid, 0)


def test_a_parked_worker_frees_its_gpu_memory_runs_nothing_and_resumes_as_it_was(agent, tmp_path):
    started = agent.start_worker("L-park-3g")
    kc = agent.client(started["connection"])
    pid = int(cell(kc, STATE.format(nbytes=3 * GiB, path=str(tmp_path / "notes.txt"))))
    assert pid == started["pid"] and held(agent, pid) == 3 * GiB

    status, parked = agent.park("L-park-3g", reason="idle for 30m")
    assert status == 200, parked
    assert (parked["tier"], parked["checkpointer"], parked["interrupted"], parked["lost"]) == (
        "memory", "simulated", False, [])
    assert parked["gpu_bytes_moved"] == 3 * GiB and parked["gpu_bytes_kept"] == 0
    assert 3 * GiB < parked["host_bytes"] < 3 * GiB + 1 * GiB and parked["disk_bytes"] == 0
    inventory = agent.inventory()
    assert held(agent, pid) == 0 and inventory.metrics()[0]["memory_used"] == 0, "the GPU memory is freed"
    report = agent.reports()["L-park-3g"]
    assert (report["parked"], report["parked_host_bytes"], report["pid"]) == ("memory", parked["host_bytes"], pid)
    assert agent.park("L-park-3g")[1] == {**parked, "seconds": 0.0}, "a second park answers where it is"

    marker = tmp_path / "ran"
    msg_id = kc.execute(f"open({str(marker)!r}, 'w').close()")
    time.sleep(1.0)
    assert not marker.exists(), "a frozen worker ran a cell"

    status, resumed = agent.resume("L-park-3g")
    assert status == 200, resumed
    assert (resumed["pid"], resumed["connection"], resumed["tier"], resumed["lost"]) == (
        pid, started["connection"], "memory", [])
    wait_for(marker.exists, 30, "the cell sent while parked, run after the resume")
    reply = kc.get_shell_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["status"] == "ok"
    assert cell(kc, CHECK).split() == [str(pid), "True", "23", "9", "True", "0", "499500"]
    assert held(agent, pid) == 3 * GiB and agent.reports()["L-park-3g"]["parked"] is None
    assert not (agent.simgpu / ".parked" / "L-park-3g").exists(), "the host copy is gone"
    # Stopped here, not by the agent's stop, which would save its 3 GiB to disk first (park_on_stop).
    assert agent.call("DELETE", "/workers/L-park-3g")[0] == 200


LOOP = """
import time, pathlib, os
done = []
for i in range({n}):
    done.append(i)
    pathlib.Path({progress!r} + '.tmp').write_text(str(i)); os.replace({progress!r} + '.tmp', {progress!r})
    time.sleep(0.02)
print(len(done), done == list(range({n})))
"""


def test_a_busy_worker_frozen_mid_loop_finishes_every_iteration_after_the_resume(agent, tmp_path):
    started = agent.start_worker("L-busy")
    kc = agent.client(started["connection"])
    progress = tmp_path / "progress"
    msg_id = kc.execute(LOOP.format(n=150, progress=str(progress)))
    wait_for(lambda: progress.exists() and int(progress.read_text() or 0) > 10, 30, "the loop running")

    status, refused = agent.park("L-busy", running_cell="refuse")
    assert (status, refused["error"]) == (409, "worker_busy") and "a cell is running" in refused["message"]
    assert agent.reports()["L-busy"]["parked"] is None, "a refused park changes nothing"

    status, parked = agent.park("L-busy", running_cell="freeze")
    assert status == 200 and parked["interrupted"] is False and parked["lost"] == [], parked
    assert agent.reports()["L-busy"]["execution_state"] == "busy", "frozen mid-cell: still busy"
    frozen_at = progress.read_text()
    time.sleep(0.8)
    assert progress.read_text() == frozen_at, "the loop ran while frozen"
    assert 10 < int(frozen_at) < 149
    assert agent.resume("L-busy")[0] == 200
    output = []
    while True:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            output.append(msg["content"]["text"])
        if msg["msg_type"] == "error":
            pytest.fail(f"the loop failed: {msg['content']['ename']}")
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    assert "".join(output).split() == ["150", "True"], "every iteration counted, no KeyboardInterrupt"


def test_a_park_that_interrupts_says_so(agent, tmp_path):
    started = agent.start_worker("L-interrupt")
    kc = agent.client(started["connection"])
    progress = tmp_path / "progress"
    kc.execute(LOOP.format(n=100000, progress=str(progress)))
    wait_for(progress.exists, 30, "the loop running")
    status, parked = agent.park("L-interrupt", running_cell="interrupt")
    assert status == 200 and parked["interrupted"] is True and parked["lost"] == ["the running cell was interrupted"]
    assert agent.reports()["L-interrupt"]["execution_state"] == "idle"
    assert agent.resume("L-interrupt")[0] == 200
    assert cell(kc, "print(len(done) < 100000)").strip() == "True"


def test_an_agent_killed_while_a_worker_is_parked_readopts_it_frozen_and_resumes_it(agent, tmp_path):
    started = agent.start_worker("L-kill9")
    kc = agent.client(started["connection"])
    pid = int(cell(kc, STATE.format(nbytes=64 * MiB, path=str(tmp_path / "notes.txt"))))
    assert agent.park("L-kill9")[0] == 200
    agent.kill9()
    assert psutil.pid_exists(pid), "workers outlive their agent"
    agent.start()
    report = agent.reports()["L-kill9"]
    assert (report["pid"], report["parked"]) == (pid, "memory")
    assert "re-adopted the parked worker" in agent.log.read_text()
    marker = tmp_path / "ran"
    kc.execute(f"open({str(marker)!r}, 'w').close()")
    time.sleep(0.8)
    assert not marker.exists(), "still frozen after the agent's restart"
    assert held(agent, pid) == 0
    status, resumed = agent.resume("L-kill9")
    assert status == 200 and resumed["pid"] == pid, resumed
    wait_for(marker.exists, 30, "the cell run after the resume")
    assert cell(kc, CHECK).split()[:5] == [str(pid), "True", "23", "9", "True"]
    assert held(agent, pid) == 64 * MiB


def test_a_cell_that_reaches_a_worker_after_its_spill_was_saved_is_refused_not_lost(agent, tmp_path):
    """Between the save of a spill and the end of the worker, a cell on its way would run and be lost
    with the process, silently. Once saved, the worker refuses cells in words. (The worker is asked to
    save directly here, so that it lives on for the cell; the agent ends it right after a save.)"""
    from gpupool.kernelapp import REFUSED_ENAME
    from gpupool.node.checkpoint.framework import ask
    from gpupool.node.worker_extension.spill import CELL_AFTER_SAVE
    from gpupool.wire.transfer import Spill

    started = agent.start_worker("L-saved")
    kc = agent.client(started["connection"])
    cell(kc, "x = 41")
    answer = ask(started["connection"], Spill(path=str(tmp_path / "namespace.bin")))
    assert "x" in answer["items"]
    refused = run(kc, "x += 1\nprint(x)")
    assert not refused.ok and refused.reply["ename"] == REFUSED_ENAME, refused.text()
    assert refused.reply["evalue"] == CELL_AFTER_SAVE and refused.stdout == "", refused.text()
    # A spill given up (failed, or left unfinished by an agent killed meanwhile, whose successor re-adopts
    # this worker) has its file removed: the worker runs cells again.
    (tmp_path / "namespace.bin").unlink()
    assert cell(kc, "x += 1\nprint(x)").strip() == "42"


def test_a_stopped_agent_saves_its_workers_and_no_agent_of_another_name_takes_its_state_directory(agent):
    """SIGTERM saves the lease's worker to the spill folder (``park_on_stop``); an agent started on that
    state directory under another name refuses in one line, removing nothing (it would have ended the
    lease it does not know); under the node's own name it serves the saved lease again."""
    started = agent.start_worker("L-owned")
    cell(agent.client(started["connection"]), "x = 41")
    agent.stop()
    assert [p.name for p in (agent.state_dir / "spill").iterdir()] == ["L-owned"]
    refused = subprocess.run([sys.executable, "-m", "gpupool.cli", "agent", "--service-url=http://127.0.0.1:1",
                              "--simulate=2xA100-80GB", "--name=another", f"--state-dir={agent.state_dir}",
                              "--port=0"], env=agent.env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1, refused.stderr
    assert f"holds the workers or saved leases of node {agent.name!r}: start this agent as --name={agent.name}" \
        in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert [p.name for p in (agent.state_dir / "spill").iterdir()] == ["L-owned"], "nothing removed"
    agent.start()
    assert agent.reports()["L-owned"]["parked"] == "disk"
    resumed = agent.resume("L-owned")[1]
    assert cell(agent.client(resumed["connection"]), "print(x + 1)").strip() == "42"


def test_an_agent_restarted_with_a_smaller_budget_spills_the_parked_workers_over_it(agent, tmp_path):
    started = agent.start_worker("L-budget")
    kc = agent.client(started["connection"])
    cell(kc, "from gpupool.node import simgpu; x = simgpu.zeros(200 * 2**20, 'uint8'); x[7] = 7")
    assert agent.park("L-budget")[1]["tier"] == "memory"
    agent.kill9()
    agent.args = (*agent.args, "--parked-memory=100MiB")
    agent.start()
    wait_for(lambda: agent.reports()["L-budget"]["parked"] == "disk", 60, "the re-adopted worker spilled")
    assert "more than its budget of 100.0 MiB" in agent.log.read_text()
    resumed = agent.resume("L-budget")[1]
    assert cell(agent.client(resumed["connection"]), "print(x[7])").strip() == "7"


def test_a_spill_saves_what_pickles_says_what_not_and_resumes_into_a_new_worker(agent, tmp_path):
    started = agent.start_worker("L-spill")
    kc = agent.client(started["connection"])
    old = int(cell(kc, STATE.format(nbytes=32 * MiB, path=str(tmp_path / "notes.txt"))))
    status, parked = agent.park("L-spill", tier="disk", reason="the owner's parked-memory quota is full")
    assert status == 200 and parked["tier"] == "disk", parked
    assert parked["host_bytes"] == 0 and parked["disk_bytes"] > 32 * MiB and parked["gpu_bytes_moved"] == 32 * MiB
    lost = "\n".join(parked["lost"])
    assert "lock: _thread.lock cannot be saved to disk" in lost and "squares: generator cannot be saved to disk" in lost
    assert "notes: an open file (_io.TextIOWrapper) comes back as an in-memory copy" in lost, lost
    wait_for(lambda: not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE, 10,
             "the spilled worker's end")
    assert held(agent, old) == 0 and not list(agent.simgpu.glob(f"GPU-*/{old}-*"))
    report = agent.reports()["L-spill"]
    assert (report["parked"], report["pid"], report["parked_host_bytes"]) == ("disk", None, 0)
    assert report["parked_lost"] == parked["lost"]
    assert agent.park("L-spill")[1]["tier"] == "disk", "idempotent"

    status, resumed = agent.resume("L-spill")
    assert status == 200 and resumed["tier"] == "disk" and resumed["pid"] != old, resumed
    assert resumed["lost"] == parked["lost"]
    kc = agent.client(resumed["connection"])
    out = cell(kc, "print(simgpu.device_of(gpu), int(gpu[::4096].sum()) == int((np.arange(len(gpu[::4096])) % 251)"
                   ".sum()), sum(numbers), first, 'lock' in dir())")
    assert out.split() == ["0", "True", "499500", "[0,", "1,", "4]", "False"]
    assert held(agent, resumed["pid"]) == 32 * MiB
    assert agent.reports()["L-spill"]["parked"] is None and not (agent.state_dir / "spill" / "L-spill").exists()


def test_the_budget_spills_the_longest_parked_and_one_too_big_spills_at_once(tmp_path):
    agent = ParkAgent(tmp_path, args=("--parked-memory=450MiB",))
    try:
        kcs = {}
        for lease in ("L-first", "L-second", "L-big"):
            kcs[lease] = agent.client(agent.start_worker(lease)["connection"])
        for lease in ("L-first", "L-second"):
            cell(kcs[lease], "from gpupool.node import simgpu; x = simgpu.zeros(200 * 2**20, 'uint8'); x[7] = 7")
        cell(kcs["L-big"], "from gpupool.node import simgpu; x = simgpu.zeros(800 * 2**20, 'uint8')")
        first = agent.park("L-first")[1]
        assert first["tier"] == "memory"
        second = agent.park("L-second")[1]
        assert second["tier"] == "memory" and first["host_bytes"] + second["host_bytes"] > 450 * MiB
        wait_for(lambda: agent.reports()["L-first"]["parked"] == "disk", 60, "the longest-parked spilled")
        assert agent.reports()["L-second"]["parked"] == "memory"
        assert "it was the longest parked" in agent.log.read_text()
        big = agent.park("L-big")[1]
        assert big["tier"] == "disk" and big["gpu_bytes_moved"] == 800 * MiB, big
        assert "more than this node's parked-memory budget of 450.0 MiB" in agent.log.read_text()
        resumed = agent.resume("L-first")[1]
        assert cell(agent.client(resumed["connection"]), "print(x[7], simgpu.device_of(x))").split() == ["7", "0"]
    finally:
        agent.stop()


def test_a_host_short_of_memory_spills_instead_of_parking_in_memory(tmp_path):
    agent = ParkAgent(tmp_path, args=("--AgentParking.park_headroom=1TiB",))
    try:
        kc = agent.client(agent.start_worker("L-short")["connection"])
        cell(kc, "from gpupool.node import simgpu; x = simgpu.zeros(16 * 2**20, 'uint8'); x[1] = 1")
        status, parked = agent.park("L-short")
        assert status == 200 and parked["tier"] == "disk", parked
        assert "would leave less than 1.0 TiB (c.AgentParking.park_headroom)" in agent.log.read_text()
        kc = agent.client(agent.resume("L-short")[1]["connection"])
        assert cell(kc, "print(x[1])").strip() == "1"
        # A cell frozen where it runs cannot be saved: it is interrupted first, and that is said.
        progress = tmp_path / "progress"
        kc.execute("x[2] = 2\n" + LOOP.format(n=100000, progress=str(progress)))
        wait_for(progress.exists, 30, "the loop running")
        status, parked = agent.park("L-short", running_cell="freeze")
        assert status == 200 and parked["tier"] == "disk" and parked["interrupted"] is True, parked
        assert parked["lost"][0] == "the running cell was interrupted"
        assert cell(agent.client(agent.resume("L-short")[1]["connection"]), "print(x[2], len(done) < 100000)").split() \
            == ["2", "True"]
    finally:
        agent.stop()


def test_a_resume_onto_another_gpu_of_the_same_model_moves_the_memory_there(agent, tmp_path):
    kc = agent.client(agent.start_worker("L-remap", gpu=0)["connection"])
    pid = int(cell(kc, STATE.format(nbytes=16 * MiB, path=str(tmp_path / "notes.txt"))))
    assert agent.park("L-remap")[0] == 200
    status, resumed = agent.resume("L-remap", gpu=1, memory=4 * GiB)
    assert status == 200 and resumed["pid"] == pid, resumed
    usage = {(p.gpu, p.pid): p.memory for p in agent.inventory().process_usage()}
    assert usage == {(agent.gpus[1], pid): 16 * MiB}
    cell(kc, "more = simgpu.zeros(2**20, 'uint8')")
    assert sorted({p.gpu for p in agent.inventory().process_usage()}) == [agent.gpus[1]], "new memory follows"
    assert cell(kc, CHECK).split()[:5] == [str(pid), "True", "23", "9", "True"]
    assert agent.reports()["L-remap"]["parked"] is None


def test_bad_input_to_park_and_resume_changes_nothing(agent, tmp_path):
    kc = agent.client(agent.start_worker("L-bad")["connection"])
    cell(kc, "x = 41")
    for method, path in (("POST", "/workers/L-bad/park"), ("POST", "/workers/L-bad/resume")):
        status, body = agent.call(method, path, {}, token="wrong")
        assert status == 401 and body["error"] == "unauthorized"
    for body, words in (([], "JSON object"), ({"tier": "tape"}, "tier"), ({"running_cell": "later"}, "running_cell"),
                        (b"{not json", "JSON")):
        status, reply = agent.call("POST", "/workers/L-bad/park", body)
        assert (status, reply["error"]) == (400, "bad_request") and words in reply["message"], (body, reply)
    assert agent.park("L-none")[0] == 404 and agent.resume("L-none")[0] == 404
    assert agent.reports()["L-bad"]["parked"] is None
    status, reply = agent.resume("L-bad", gpu=1)
    assert status == 400 and "is not parked" in reply["message"], reply
    assert agent.resume("L-bad")[0] == 200, "resuming a worker that runs, where it runs: idempotent"

    assert agent.park("L-bad")[0] == 200
    status, reply = agent.call("POST", "/workers", agent.request("L-bad"))
    assert status == 400 and "is parked: POST /workers/L-bad/resume brings it back" in reply["message"], reply
    for change, words in (({"lease_id": "L-other"}, "lease of the path"), ({"gpus": ["GPU-nope"]}, "unknown: GPU-nope"),
                          ({"gpus": agent.gpus}, "resumes onto as many"), ({"fraction": 2}, "'fraction'")):
        status, reply = agent.call("POST", "/workers/L-bad/resume", {**agent.request("L-bad"), **change})
        assert (status, reply["error"]) == (400, "bad_request") and words in reply["message"], (change, reply)
        assert agent.reports()["L-bad"]["parked"] == "memory", "a refused resume leaves it parked"
    assert agent.resume("L-bad")[0] == 200
    assert cell(kc, "print(x + 1)").strip() == "42"


def test_a_parked_worker_is_stopped_at_once_and_leaves_nothing(agent, tmp_path):
    kc = agent.client(agent.start_worker("L-stop")["connection"])
    pid = int(cell(kc, STATE.format(nbytes=8 * MiB, path=str(tmp_path / "notes.txt"))))
    assert agent.park("L-stop")[0] == 200
    began = time.monotonic()
    status, stopped = agent.call("DELETE", "/workers/L-stop")
    assert status == 200 and time.monotonic() - began < 5, "no graceful wait on a frozen kernel"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not (agent.simgpu / ".parked" / "L-stop").exists() and not list(agent.simgpu.glob(f"GPU-*/{pid}-*"))
    assert "L-stop" not in agent.reports()
    # A spilled one: its files go.
    agent.client(agent.start_worker("L-stop2")["connection"])
    assert agent.park("L-stop2", tier="disk")[0] == 200
    assert agent.call("DELETE", "/workers/L-stop2") == (200, {"lease_id": "L-stop2", "exit_code": None})
    assert not (agent.state_dir / "spill" / "L-stop2").exists() and "L-stop2" not in agent.reports()
    assert agent.call("DELETE", "/workers/L-stop2")[0] == 404


@pytest.mark.parametrize("mode", ["v1", "none"])
def test_other_freezers_park_and_resume_too(tmp_path, mode):
    agent = ParkAgent(tmp_path, args=(f"--cgroup-mode={mode}",))
    try:
        kc = agent.client(agent.start_worker("L-freezer")["connection"])
        pid = int(cell(kc, STATE.format(nbytes=8 * MiB, path=str(tmp_path / "notes.txt"))))
        assert agent.park("L-freezer")[1]["tier"] == "memory"
        marker = tmp_path / "ran"
        kc.execute(f"open({str(marker)!r}, 'w').close()")
        time.sleep(0.8)
        assert not marker.exists() and held(agent, pid) == 0
        assert agent.resume("L-freezer")[0] == 200
        wait_for(marker.exists, 30, "the cell run after the resume")
        assert cell(kc, CHECK).split()[:5] == [str(pid), "True", "23", "9", "True"]
        assert ("v1 freezer.state" if mode == "v1" else "SIGSTOP of its process group") in agent.log.read_text()
    finally:
        agent.stop()


def test_the_framework_checkpointer_parks_between_cells_through_the_worker(tmp_path):
    """The agent's side of ``framework`` (the worker asked on its comm, then
    frozen; thawed, then asked back). No CUDA here: the worker has nothing to
    move (its GPU part runs in ``make gpu-check``)."""
    agent = ParkAgent(tmp_path, args=("--checkpointer=framework",))
    try:
        kc = agent.client(agent.start_worker("L-fw")["connection"])
        progress = tmp_path / "progress"
        kc.execute(LOOP.format(n=100000, progress=str(progress)))
        wait_for(progress.exists, 30, "the loop running")
        status, parked = agent.park("L-fw", running_cell="freeze")
        assert status == 200 and parked["checkpointer"] == "framework", parked
        assert parked["interrupted"] is True, "framework cannot freeze mid-cell: the cell is interrupted"
        assert parked["gpu_bytes_moved"] == 0 and parked["gpu_bytes_kept"] == 0
        marker = tmp_path / "ran"
        kc.execute(f"open({str(marker)!r}, 'w').close()")
        time.sleep(0.8)
        assert not marker.exists(), "frozen after the worker moved its memory"
        status, reply = agent.resume("L-fw", gpu=1)
        assert status == 400 and "(framework) restores onto the GPUs a worker was parked from only" in reply["message"]
        assert agent.resume("L-fw")[0] == 200
        wait_for(marker.exists, 30, "the cell run after the resume")
        assert cell(kc, "print(len(done) < 100000)").strip() == "True"
    finally:
        agent.stop()


def test_the_registration_says_the_checkpointer_and_the_budget(tmp_path, monkeypatch):
    import asyncio

    import psutil as ps

    from gpupool.node.agent import NodeAgent
    from gpupool.wire.nodes import NodeRegistration

    monkeypatch.setenv("GPUPOOL_AGENT_TOKEN", "t")
    monkeypatch.setenv("GPUPOOL_SIMGPU_ROOT", str(tmp_path / "simgpu"))

    def registration(*args: str) -> NodeRegistration:
        app = NodeAgent()
        app.initialize(["--service-url=http://127.0.0.1:1", "--simulate=1xA100-80GB", "--name=reg", "--warm-workers=0",
                        f"--state-dir={tmp_path / f'state-{len(args)}'}", "--cgroup-mode=none", *args])
        asyncio.run(app._start_workers())
        app.url = "http://127.0.0.1:1"
        try:
            return NodeRegistration.from_json(app.registration().to_json())
        finally:
            app.workers.close()

    body = registration()
    assert body.checkpointer is not None and body.checkpointer.to_json() == {
        "name": "simulated", "mid_cell": True, "remap": True}
    assert body.parked_memory == ps.virtual_memory().total // 4
    assert registration("--parked-memory=3GiB").parked_memory == 3 * GiB
    assert registration("--parked-memory=3GiB", "--checkpointer=framework").checkpointer.name == "framework"
