"""The checkpointer contract (:mod:`gpupool.node.checkpoint`): picking
one (``auto`` and by name), ``cuda-checkpoint``'s command line driven against
a stand-in that keeps the real one's (tests/support/fake_cuda_checkpoint.py: only a
GPU host runs the real utility), the ``framework`` checkpointer's in-place
move (on the CPU here: the GPU part runs in ``make gpu-check``), the
``simulated`` one's moves of allocation files, and the pure park decisions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpupool.node import checkpoint
from gpupool.node.checkpoint import CheckpointError, Moved, NodeFacts, ParkTarget
from gpupool.node.checkpoint.cuda import CudaCheckpointer
from gpupool.node import simgpu_store
from gpupool.node.checkpoint.simulated import SimulatedCheckpointer
from gpupool.node.workers.parking import mem_available, no_room

GiB = 2**30
FAKE = Path(__file__).parents[1] / "support" / "fake_cuda_checkpoint.py"
G0, G1 = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"


@pytest.fixture
def fake_cuda(tmp_path, monkeypatch):
    """``cuda-checkpoint`` on PATH: the stand-in; returns its state folder."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "cuda-checkpoint"
    script.write_text(f"#!{sys.executable}\n" + FAKE.read_text())
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_DIR", str(tmp_path / "cuda-state"))
    return tmp_path / "cuda-state"


@pytest.fixture
def no_cuda(tmp_path, monkeypatch):
    """A PATH without any ``cuda-checkpoint``."""
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                               if not (Path(p) / "cuda-checkpoint").exists()))


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


def calls(state: Path) -> list[list[str]]:
    return [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines() if line != '["--help"]']


def test_auto_picks_simulated_on_simulated_gpus_cuda_checkpoint_where_it_works_else_framework(fake_cuda, caplog):
    caplog.set_level(logging.INFO)
    assert checkpoint.available()[:3] == ("cuda-checkpoint", "framework", "simulated")
    assert checkpoint.resolve("auto", NodeFacts("simulated")).name == "simulated"
    chosen = checkpoint.resolve("auto", NodeFacts("nvml", "580.65.06"))
    assert chosen.name == "cuda-checkpoint" and chosen.info().to_json() == {
        "name": "cuda-checkpoint", "mid_cell": True, "remap": True}
    old = checkpoint.resolve("auto", NodeFacts("nvml", "535.104.05"))
    assert old.name == "framework" and old.info().to_json() == {"name": "framework", "mid_cell": False, "remap": False}
    assert "not cuda-checkpoint: the GPU driver 535.104.05 is older than r550" in caplog.text


def test_a_checkpointer_asked_by_name_that_cannot_work_here_says_why(no_cuda):
    assert checkpoint.resolve("auto", NodeFacts("nvml", "580.1")).name == "framework"
    with pytest.raises(ValueError, match="'cuda-checkpoint' cannot work on this node: cuda-checkpoint is not on PATH"):
        checkpoint.resolve("cuda-checkpoint", NodeFacts("nvml", "580.1"))
    with pytest.raises(ValueError, match="'simulated' cannot work on this node: it moves simulated GPU memory"):
        checkpoint.resolve("simulated", NodeFacts("nvml"))
    with pytest.raises(ValueError, match="unknown checkpointer 'criu'; choose one of auto, cuda-checkpoint"):
        checkpoint.resolve("criu", NodeFacts("nvml"))


def target(pid: int, gpus=(G0,)) -> ParkTarget:
    return ParkTarget("L-cuda", pid, (pid,), tuple(gpus), GiB, {pid: 3 * GiB})


def test_cuda_checkpoint_locks_checkpoints_restores_and_unlocks_as_its_cli_says(fake_cuda, sleeper):
    cuda = CudaCheckpointer()
    assert (cuda.actions, cuda.remap) == (True, True)
    moved = asyncio.run(cuda.park(target(sleeper)))
    assert moved.gpu_bytes_moved == 3 * GiB and moved.state == {"pids": [sleeper]}
    assert (fake_cuda / str(sleeper)).read_text() == "checkpointed"
    asyncio.run(cuda.resume(target(sleeper), moved, (G0,), GiB))
    p = str(sleeper)
    assert calls(fake_cuda) == [["--get-state", "--pid", p], ["--action", "lock", "--pid", p, "--timeout", "30000"],
                                ["--action", "checkpoint", "--pid", p], ["--action", "restore", "--pid", p],
                                ["--action", "unlock", "--pid", p]]
    assert (fake_cuda / p).read_text() == "running"
    asyncio.run(cuda.park(target(sleeper)))
    asyncio.run(cuda.resume(target(sleeper), Moved(state={"pids": [sleeper]}), (G1,), GiB))
    assert ["--action", "restore", "--pid", p, "--device-map", f"{G0}={G1}"] in calls(fake_cuda)


def test_cuda_checkpoint_failures_undo_what_they_did_and_say_the_utilitys_words(fake_cuda, sleeper, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_FAIL", "checkpoint")
    cuda = CudaCheckpointer()
    with pytest.raises(CheckpointError, match=r"--action checkpoint --pid \d+ failed \(exit 1\): Failed to checkpoint "
                                              r"process \d+: CUDA_ERROR_NOT_SUPPORTED"):
        asyncio.run(cuda.park(target(sleeper)))
    assert (fake_cuda / str(sleeper)).read_text() == "running", "unlocked again"
    monkeypatch.delenv("FAKE_CUDA_CHECKPOINT_FAIL")
    moved = asyncio.run(cuda.park(target(sleeper)))
    with pytest.raises(CheckpointError, match="is 'checkpointed' for cuda-checkpoint, not 'running'"):
        asyncio.run(cuda.park(target(sleeper)))
    asyncio.run(cuda.resume(target(sleeper), moved, (G0,), GiB))


def test_older_drivers_toggle_and_cannot_remap(fake_cuda, sleeper, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_VERSION", "555")
    assert CudaCheckpointer().remap is False
    with pytest.raises(CheckpointError, match="cannot restore onto other GPUs .* no --device-map"):
        asyncio.run(CudaCheckpointer().resume(target(sleeper), Moved(state={"pids": [sleeper]}), (G1,), GiB))
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_VERSION", "550")
    cuda = CudaCheckpointer()
    assert (cuda.actions, cuda.remap) == (False, False)
    moved = asyncio.run(cuda.park(target(sleeper)))
    asyncio.run(cuda.resume(target(sleeper), moved, (G0,), GiB))
    p = str(sleeper)
    assert calls(fake_cuda)[-3:] == [["--get-state", "--pid", p], ["--toggle", "--pid", p], ["--toggle", "--pid", p]]


def test_only_the_processes_with_cuda_state_are_checkpointed(fake_cuda, sleeper, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_PIDS", str(sleeper))
    other = subprocess.Popen(["sleep", "60"])
    try:
        pids = tuple(sorted((sleeper, other.pid)))
        moved = asyncio.run(CudaCheckpointer().park(ParkTarget("L-two", sleeper, pids, (G0,), GiB, {sleeper: GiB})))
        assert moved.state == {"pids": [sleeper]} and moved.gpu_bytes_moved == GiB
        assert ["--action", "checkpoint", "--pid", str(other.pid)] not in calls(fake_cuda)
        # A process the inventory saw on a GPU that the utility cannot say anything of is an error, not skipped.
        monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_PIDS", "1")
        with pytest.raises(CheckpointError, match="has no CUDA state: CUDA_ERROR_NOT_INITIALIZED"):
            asyncio.run(CudaCheckpointer().park(ParkTarget("L-x", other.pid, (other.pid,), (G0,), GiB, {other.pid: 1})))
    finally:
        other.kill()
        other.wait()


def test_the_framework_move_keeps_every_object_view_and_parameter_in_place():
    torch = pytest.importorskip("torch")
    from gpupool.node.worker_extension import offload
    from gpupool.node.worker_extension.devices import device_of

    base = torch.arange(16.0).reshape(4, 4)
    view = base[1:3]
    weight = torch.nn.Parameter(torch.randn(3))
    weight.grad = torch.ones(3)
    model = torch.nn.Linear(2, 2)
    ids, storage = [id(t) for t in (base, view, weight)], base.untyped_storage().data_ptr()
    moved = offload.move_tensors(torch, [base, view, weight, weight.grad, *model.parameters()], "cpu")
    assert moved == 64 + 12 + 12 + (4 + 2) * 4, "one copy per storage, the view's shares its base's"
    assert [id(t) for t in (base, view, weight)] == ids and base.untyped_storage().data_ptr() != storage
    base[1, 0] = 100.0
    assert view[0, 0].item() == 100.0, "the view still views its base"
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad and weight.grad.tolist() == [1, 1, 1]
    # While parked, a tensor moved off a GPU says where it belongs (a spill brings it back there).
    offload.remember(model.weight, "cuda:0")
    try:
        assert offload.parked_device(model.weight) == "cuda:0" and device_of(model) == "cuda:0"
    finally:
        offload._parked.clear()
    assert offload.park() == {"ok": True, "moved": 0, "kept": 0, "lost": []}, "no CUDA here: nothing to move"


def test_the_simulated_park_moves_the_pages_out_of_the_gpu_folder_and_back_onto_another_gpu(monkeypatch):
    """The allocation's pages leave its GPU's folder (the readings count them no more) for the agent's
    host copy, the same inode, so the process's mapping keeps its bytes; a resume onto G1 puts them in
    G1's folder and binds the process to G1."""
    root = Path("/dev/shm") / f"gpupool-test-park-{os.getpid()}"
    monkeypatch.setenv(simgpu_store.ROOT_ENV, str(root))
    simgpu_store.prepare([G0, G1], root)
    try:
        data = os.urandom(3 << 20)
        allocation = simgpu_store.gpu_dir(G0) / f"{os.getpid()}-1"
        allocation.write_bytes(data)
        inode = allocation.stat().st_ino
        with allocation.open("r+b") as file, mmap.mmap(file.fileno(), len(data)) as mapping:
            target = ParkTarget("L-1", os.getpid(), (os.getpid(),), (G0,), GiB)
            simulated = SimulatedCheckpointer()
            moved = asyncio.run(simulated.park(target))
            assert moved.gpu_bytes_moved == moved.host_bytes == len(data)
            assert simgpu_store.process_files(os.getpid()) == [], "no GPU memory held while parked"
            (copy,) = (root / simgpu_store.PARKED / "L-1").rglob("*-1")
            assert copy.stat().st_ino == inode and mapping[:] == data
            asyncio.run(simulated.resume(target, moved, (G1,), GiB // 2))
            (back,) = simgpu_store.process_files(os.getpid())
            assert (back.gpu, back.path.stat().st_ino, back.size) == (G1, inode, len(data))
            assert mapping[:] == data and not (root / simgpu_store.PARKED / "L-1").exists()
            binding = json.loads(simgpu_store.binding_path(os.getpid()).read_text())
            assert binding == {"gpus": [G1], "limit": GiB // 2}
    finally:
        shutil.rmtree(root)


def test_the_park_decisions():
    assert mem_available("MemTotal: 100 kB\nMemAvailable:  2048 kB\n") == 2 << 20
    assert mem_available("MemTotal: 100 kB\n") is None
    assert no_room(GiB, GiB // 2, 2 * GiB, 10 * GiB, GiB) is None
    assert no_room(GiB, GiB // 2, 2 * GiB, 10 * GiB, GiB, quota_room=2 * GiB) is None
    assert ("it would hold 1.5 GiB of host memory, more than the 1.0 GiB its owner's max_parked_memory leaves"
            == no_room(GiB, GiB // 2, 2 * GiB, 10 * GiB, GiB, quota_room=GiB))
    assert "more than this node's parked-memory budget of 1.0 GiB" in no_room(GiB, 1, GiB, 10 * GiB, GiB)
    words = no_room(4 * GiB, 0, 10 * GiB, 5 * GiB, 2 * GiB)
    assert words == ("the host has 5.0 GiB of memory available, and moving 4.0 GiB of GPU memory there would leave "
                     "less than 2.0 GiB (c.AgentParking.park_headroom)")
    assert no_room(4 * GiB, 0, 10 * GiB, None, 2 * GiB) is None, "unknown: the budget alone decides"


def test_moved_travels_through_a_record():
    moved = Moved(5, 6, 7, ("a", "b"), {"files": [["GPU-x/1-0", 5]]})
    assert Moved.from_json(json.loads(json.dumps(moved.to_json()))) == moved
    with pytest.raises(ValueError):
        Moved.from_json({"gpu_bytes_moved": "lots"})
