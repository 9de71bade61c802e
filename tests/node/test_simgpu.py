"""Simulated GPU memory (:mod:`gpupool.node.simgpu`) in real processes,
read by the simulated inventory as NVML would report it, and swept when its
process is gone.

Each test works under a root folder of its own on /dev/shm
(``GPUPOOL_SIMGPU_ROOT``) and removes it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpupool.node import simgpu_store
from gpupool.node.inventory.simulated import SimulatedInventory, simulated_uuid
from gpupool.node.worker_extension.devices import device_of, place_on_devices, to_cpu_with_device

MiB = 2**20
NODE = f"simgpu-{secrets.token_hex(3)}"
GPU0, GPU1 = simulated_uuid(NODE, 0), simulated_uuid(NODE, 1)

# Runs each line of its stdin, answers one JSON line: {"ok": value of `_`} or {"error": "Type: words"}.
REPL = """
import json, sys, traceback
from gpupool.node import simgpu
import numpy as np
ns = {"simgpu": simgpu, "np": np}
for line in sys.stdin:
    try:
        exec(line, ns)
        print(json.dumps({"ok": ns.get("_")}), flush=True)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
    ns.pop("_", None)
"""


@pytest.fixture
def root(monkeypatch):
    base = Path("/dev/shm") / f"gpupool-test-simgpu-{secrets.token_hex(4)}"
    monkeypatch.setenv(simgpu_store.ROOT_ENV, str(base))
    yield base
    shutil.rmtree(base, ignore_errors=True)


class Process:
    """A Python process holding simulated GPU memory, driven line by line."""

    def __init__(self, root: Path, visible: str = f"{GPU0},{GPU1}", limit: int | None = 64 * MiB) -> None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible, simgpu_store.ROOT_ENV: str(root)}
        env.pop("GPUPOOL_MEMORY_LIMIT", None)
        if limit is not None:
            env["GPUPOOL_MEMORY_LIMIT"] = str(limit)
        self.proc = subprocess.Popen([sys.executable, "-c", REPL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.pid = self.proc.pid

    def run(self, line: str):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer["ok"]

    def end(self) -> int:
        self.proc.stdin.close()
        code = self.proc.wait(10)
        self.proc.stdout.close()
        return code


def test_allocations_are_read_per_process_and_per_gpu_as_nvml_would(root):
    inventory = SimulatedInventory("2xA100-80GB", NODE)
    proc = Process(root)
    try:
        proc.run("a = simgpu.zeros((6, MiB := 2**20), 'uint8'); b = simgpu.empty(2 * MiB, 'uint8', device=1); "
                 "a[:] = 7; _ = int(a.sum())")
        usage = {(p.gpu, p.pid): p.memory for p in inventory.process_usage()}
        assert usage == {(GPU0, proc.pid): 6 * MiB, (GPU1, proc.pid): 2 * MiB}
        assert inventory.process_memory() == {proc.pid: 8 * MiB}
        assert [m["memory_used"] for m in inventory.metrics()] == [6 * MiB, 2 * MiB]
        assert inventory.process_known() == {GPU0, GPU1}
        assert proc.run("_ = [simgpu.device_of(a), simgpu.device_of(a[2:]), simgpu.device_of(a + 1), "
                        "simgpu.memory_allocated(0), simgpu.device_count()]") == [0, 0, None, 6 * MiB, 2]
        # A view keeps its allocation; the last array gone, the file (and the reading) go.
        assert proc.run("v = a[1:]; del a; import gc; gc.collect(); _ = int(v[0, 0])") == 7
        assert inventory.process_memory() == {proc.pid: 8 * MiB}
        proc.run("del v; gc.collect()")
        assert inventory.process_memory() == {proc.pid: 2 * MiB}
    finally:
        proc.end()
    assert inventory.process_usage() == [] and not list(root.glob("GPU-*/*")), "files go at exit"


def test_an_allocation_beyond_the_slice_fails_in_cudas_words_and_changes_nothing(root):
    inventory = SimulatedInventory("2xA100-80GB", NODE)
    proc = Process(root, limit=16 * MiB)
    try:
        proc.run("a = simgpu.empty(12 * 2**20, 'uint8')")
        with pytest.raises(RuntimeError) as caught:
            proc.run("b = simgpu.empty(8 * 2**20, 'uint8')")
        words = str(caught.value)
        assert words.startswith("OutOfMemoryError: CUDA error: out of memory (cudaErrorMemoryAllocation)"), words
        assert "8.0 MiB" in words and "allows 16.0 MiB" in words and "holds 12.0 MiB" in words, words
        assert inventory.process_memory() == {proc.pid: 12 * MiB}
        assert proc.run("b = simgpu.empty(8 * 2**20, 'uint8', device=1); _ = simgpu.memory_allocated(1)") == 8 * MiB
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            proc.run("simgpu.empty(1, device=2)")
    finally:
        proc.end()


def test_no_visible_gpu_is_cudas_no_device_error(root):
    proc = Process(root, visible="")
    try:
        with pytest.raises(RuntimeError, match="no CUDA-capable device is detected"):
            proc.run("simgpu.empty(10)")
    finally:
        proc.end()


def test_a_killed_process_leaves_its_files_until_the_next_reading_sweeps_them(root):
    inventory = SimulatedInventory("2xA100-80GB", NODE)
    proc = Process(root)
    proc.run("a = simgpu.empty(4 * 2**20, 'uint8')")
    files = list(root.glob(f"GPU-*/{proc.pid}-*"))
    assert len(files) == 1
    proc.proc.send_signal(signal.SIGKILL)
    assert proc.end() == -signal.SIGKILL
    assert files[0].exists(), "no exit handler ran"
    assert inventory.process_usage() == [] and not files[0].exists()


def test_a_binding_file_moves_new_allocations_to_other_gpus_and_limits(root):
    proc = Process(root, visible=GPU0, limit=8 * MiB)
    try:
        proc.run("a = simgpu.empty(6 * 2**20, 'uint8')")
        simgpu_store.write_binding(proc.pid, [GPU1], 64 * MiB)
        proc.run("b = simgpu.empty(20 * 2**20, 'uint8')")  # over the old limit, within the new one
        assert sorted(a.gpu for a in simgpu_store.process_files(proc.pid)) == sorted([GPU0, GPU1])
        assert proc.run("_ = simgpu.binding()") == [[GPU1], 64 * MiB]
    finally:
        proc.end()
    assert simgpu_store.process_files(proc.pid) == []


def test_device_arrays_travel_as_host_copies_and_come_back_on_their_device(root, monkeypatch):
    from gpupool.node import simgpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{GPU0},{GPU1}")
    monkeypatch.delenv("GPUPOOL_MEMORY_LIMIT", raising=False)
    x = simgpu.asarray([[1.5, 2.5], [3.5, 4.5]], device=1)
    assert device_of(x) == "simgpu:1" and device_of(x[1]) == "simgpu:1" and device_of(x * 2) is None
    host, device = to_cpu_with_device(x)
    assert device == "simgpu:1" and simgpu.device_of(host) is None and host.tolist() == x.tolist()
    values = {"x": host}
    assert place_on_devices(values, {"x": device}) == {}
    assert simgpu.device_of(values["x"]) == 1 and values["x"].tolist() == [[1.5, 2.5], [3.5, 4.5]]
    assert "stays on the CPU" in place_on_devices({"y": host}, {"y": "simgpu:5"})["y"]
