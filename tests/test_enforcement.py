"""The environment that confines a worker to its slice: literal in, literal out."""

from __future__ import annotations

import pytest

from gpupool.provisioner.enforcement import (MODES, MemoryWatchdog, MPSControl, check_slice, enforcement_mode,
                                             slice_environment)
from gpupool.schema import GPUInfo

GiB = 1024**3
MiB = 1024**2
A100 = GPUInfo("GPU-11111111-2222-3333-4444-555555555555", "NVIDIA A100-SXM4-80GB", 0, 81920 * MiB, 609 * MiB, "8.0")
A100_B = GPUInfo("GPU-66666666-7777-8888-9999-000000000000", "NVIDIA A100-SXM4-80GB", 1, 81920 * MiB, 609 * MiB, "8.0")


def test_half_a100_slice():
    assert slice_environment([A100], 0.5, 40 * GiB, "L-0123456789ab", "ann", "node-1") == {
        "CUDA_VISIBLE_DEVICES": "GPU-11111111-2222-3333-4444-555555555555",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=40960M",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.500",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "GPUPOOL_LEASE_ID": "L-0123456789ab",
        "GPUPOOL_OWNER": "ann",
        "GPUPOOL_NODE": "node-1",
        "GPUPOOL_GPU_UUIDS": "GPU-11111111-2222-3333-4444-555555555555",
        "GPUPOOL_FRACTION": "0.5",
        "GPUPOOL_MEMORY_LIMIT": str(40 * GiB),
    }


def test_two_whole_gpus():
    env = slice_environment([A100, A100_B], 1.0, 81311 * MiB, "L-aaaaaaaaaaaa", "bob", "node-2")
    both = "GPU-11111111-2222-3333-4444-555555555555,GPU-66666666-7777-8888-9999-000000000000"
    assert env["CUDA_VISIBLE_DEVICES"] == both
    assert env["GPUPOOL_GPU_UUIDS"] == both
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    # ordinals as the worker sees its devices: positions in CUDA_VISIBLE_DEVICES
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=81311M,1=81311M"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.992"  # 81311/81920, rounded down
    assert env["GPUPOOL_FRACTION"] == "1"
    assert env["GPUPOOL_MEMORY_LIMIT"] == str(81311 * MiB)


def test_limits_round_down_never_up():
    env = slice_environment([A100], 0.004, 10 * MiB + 123, "L-1", "ann", "n")
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"  # MPS needs at least 1 %
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10M"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.001"


def test_bare_uuids_use_the_fraction_for_xla():
    env = slice_environment(["GPU-x"], 0.25, 20 * GiB, "L-1", "ann", "n")
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-x"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.250"


@pytest.mark.parametrize("gpus, fraction, memory, words", [
    ([], 0.5, GiB, "at least one GPU"),
    ([A100], 0, GiB, "fraction must be in (0, 1]"),
    ([A100], 1.5, GiB, "fraction must be in (0, 1]"),
    ([A100], 0.5, 1000, "at least 1 MiB"),
    ([A100], 0.5, 1.5 * GiB + 0.5, "whole number of bytes"),
])
def test_bad_slices_are_refused(gpus, fraction, memory, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        slice_environment(gpus, fraction, memory, "L-1", "ann", "n")


@pytest.mark.parametrize("kind, mps, requested, mig, mode", [
    ("simulated", False, "auto", False, "none"), ("simulated", True, "mps", False, "none"),
    ("nvml", True, "auto", False, "mps"), ("nvml", False, "auto", False, "timeslice"),
    ("nvml", True, "auto", True, "mig"), ("nvml", False, "mps", False, "mps"),
    ("nvml", True, "exclusive", False, "exclusive"), ("nvml", True, "timeslice", True, "timeslice")])
def test_enforcement_mode(kind, mps, requested, mig, mode):
    assert enforcement_mode(kind, mps, requested, mig) == mode


def test_unknown_mode_is_refused():
    assert MODES == ("mps", "mig", "timeslice", "exclusive")
    with pytest.raises(ValueError, match="unknown enforcement mode 'vgpu'; choose one of auto, mps, mig"):
        enforcement_mode("nvml", False, "vgpu")


@pytest.mark.parametrize("mode, fraction, ok", [
    ("mps", 0.25, True), ("timeslice", 0.5, True), ("mig", 1.0, True), ("exclusive", 1.0, True),
    ("mig", 0.5, False), ("exclusive", 0.99, False)])
def test_whole_devices_only_in_mig_and_exclusive(mode, fraction, ok):
    if ok:
        check_slice(mode, fraction)
    else:
        with pytest.raises(ValueError, match=f"enforces slices with '{mode}': it hands out whole"):
            check_slice(mode, fraction)




def test_mps_control_starts_or_joins_and_sends_commands(tmp_path):
    # A stand-in for nvidia-cuda-mps-control: "-d" creates the control socket
    # path, a command on stdin is echoed back with the pipe directory it saw.
    program = tmp_path / "mps-control"
    program.write_text('#!/bin/sh\nif [ "$1" = "-d" ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi\n'
                       'read line; echo "$line @ $CUDA_MPS_PIPE_DIRECTORY"\n')
    program.chmod(0o755)
    control = MPSControl(str(tmp_path / "pipe"), str(tmp_path / "log"), str(program))
    assert not control.listening()
    assert control.start() == "started" and control.listening()
    assert control.command("get_server_list") == f"get_server_list @ {tmp_path / 'pipe'}"
    assert MPSControl(str(tmp_path / "pipe"), str(tmp_path / "log"), str(program)).start() == "joined"
    assert control.environment() == {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe"),
                                     "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "log")}
    with pytest.raises(RuntimeError, match="cannot start the MPS control daemon"):
        MPSControl(str(tmp_path / "p2"), str(tmp_path / "l2"), str(tmp_path / "missing")).start()


def test_watchdog_stops_a_worker_over_its_slice_twice_in_a_row():
    dog = MemoryWatchdog(allowance=512 * MiB, strikes=2)
    limits = {"L-a": 20 * GiB, "L-b": 20 * GiB}
    over = {"L-a": {"GPU-0": 21 * GiB}, "L-b": {"GPU-0": 20 * GiB + 500 * MiB}}
    assert dog.check(over, limits) == []  # first strike
    assert dog.check({"L-a": {"GPU-0": 10 * GiB}}, limits) == []  # back under: forgiven
    assert dog.check(over, limits) == []
    (verdict,) = dog.check(over, limits)
    assert verdict[0] == "L-a" and "21504 MiB on GPU GPU-0, more than its slice's 20480 MiB" in verdict[1]
    assert dog.check({}, {}) == [] and dog._over == {}
