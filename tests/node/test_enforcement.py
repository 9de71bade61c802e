"""The enforcement modes: the environment that confines a worker to its slice
(literal in, literal out), what each refuses, and how a node picks its mode."""

from __future__ import annotations

import logging

import pytest

from gpupool.node.enforcement import (MIG, MPS, EnforcementMode, Exclusive, MemoryWatchdog, MPSControl,
                                             NoEnforcement, Timeslice, after_rediscovery, available, mode_class,
                                             register, resolve, slice_environment, unregister)
from gpupool.wire.nodes import GPUInfo

GiB = 1024**3
MiB = 1024**2
A100 = GPUInfo("GPU-11111111-2222-3333-4444-555555555555", "NVIDIA A100-SXM4-80GB", 0, 81920 * MiB, 609 * MiB, "8.0")
A100_B = GPUInfo("GPU-66666666-7777-8888-9999-000000000000", "NVIDIA A100-SXM4-80GB", 1, 81920 * MiB, 609 * MiB, "8.0")
HALF_A100 = {
    "CUDA_VISIBLE_DEVICES": "GPU-11111111-2222-3333-4444-555555555555",
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


def test_half_a100_slice():
    assert slice_environment([A100], 0.5, 40 * GiB, "L-0123456789ab", "ann", "node-1") == HALF_A100
    assert MPS().environment([A100], 0.5, 40 * GiB, "L-0123456789ab", "ann", "node-1") == {
        **HALF_A100, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=40960M"}


@pytest.mark.parametrize("mode", [Timeslice, Exclusive, MIG, NoEnforcement])
def test_mps_variables_come_from_the_mps_mode_only(mode):
    assert mode().environment([A100], 0.5, 40 * GiB, "L-0123456789ab", "ann", "node-1") == HALF_A100


def test_two_whole_gpus():
    env = MPS().environment([A100, A100_B], 1.0, 81311 * MiB, "L-aaaaaaaaaaaa", "bob", "node-2")
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
    env = MPS().environment([A100], 0.004, 10 * MiB + 123, "L-1", "ann", "n")
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
@pytest.mark.parametrize("mode", [Timeslice, MPS])
def test_bad_slices_are_refused(mode, gpus, fraction, memory, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        mode().environment(gpus, fraction, memory, "L-1", "ann", "n")


@pytest.mark.parametrize("kind, mps, requested, mig, mode", [
    ("simulated", False, "auto", False, "none"), ("simulated", True, "mps", False, "none"),
    ("nvml", True, "auto", False, "mps"), ("nvml", False, "auto", False, "timeslice"),
    ("nvml", True, "auto", True, "mig"), ("nvml", False, "mps", False, "mps"),
    ("nvml", True, "exclusive", False, "exclusive"), ("nvml", True, "timeslice", True, "timeslice")])
def test_resolve(kind, mps, requested, mig, mode):
    uuids = ["MIG-1234"] if mig else ["GPU-1234"]
    assert resolve(requested, kind, uuids, mps_running=lambda: mps).name == mode


def test_auto_becomes_mig_once_nvml_lists_mig_instances():
    mode = resolve("auto", "nvml", [], mps_running=lambda: False)
    assert mode.name == "timeslice"
    assert after_rediscovery(mode, "auto", ["GPU-1"]) is mode
    assert after_rediscovery(mode, "auto", ["MIG-1"]).name == "mig"
    assert after_rediscovery(mode, "timeslice", ["MIG-1"]) is mode


def test_unknown_mode_is_refused():
    assert available()[:4] == ("mps", "mig", "timeslice", "exclusive")
    with pytest.raises(ValueError, match="unknown enforcement mode 'vgpu'; choose one of auto, mps, mig"):
        resolve("vgpu", "nvml", [])
    with pytest.raises(ValueError, match="unknown enforcement mode 'none'"):
        mode_class("none")  # what simulated nodes report, not a choice


@pytest.mark.parametrize("mode, fraction, ok", [
    (MPS, 0.25, True), (Timeslice, 0.5, True), (MIG, 1.0, True), (Exclusive, 1.0, True),
    (MIG, 0.5, False), (Exclusive, 0.99, False)])
def test_whole_devices_only_in_mig_and_exclusive(mode, fraction, ok):
    if ok:
        mode().check(fraction)
    else:
        with pytest.raises(ValueError, match=f"enforces slices with '{mode.name}': it hands out whole"):
            mode().check(fraction)


@pytest.mark.parametrize("mode, whole, watched", [
    (MPS, False, True), (Timeslice, False, True), (MIG, True, False), (Exclusive, True, False),
    (NoEnforcement, False, False)])
def test_capacity_rule_and_watchdog(mode, whole, watched):
    assert mode().registration() == {"enforcement": mode.name, "whole_gpus": whole}
    over = {"L-a": {"GPU-0": 30 * GiB}}
    instance = mode()
    verdicts = [instance.over_limit(over, {"L-a": GiB}) for _ in range(2)]
    assert bool(verdicts[1]) is watched


def test_a_mode_registered_in_process_is_chosen_by_name_until_unregistered():
    class Partitioned(EnforcementMode):
        name = "partitioned"
        whole_gpus = True

    assert register(Partitioned) is Partitioned  # a class decorator too
    try:
        assert "partitioned" in available()
        assert isinstance(resolve("partitioned", "nvml", []), Partitioned)
        assert resolve("partitioned", "simulated", []).name == "none"  # it confines real GPUs
    finally:
        unregister(Partitioned)
    assert "partitioned" not in available()  # nothing leaks into the next test
    with pytest.raises(ValueError, match="unknown enforcement mode 'partitioned'"):
        mode_class("partitioned")
    unregister(Partitioned)  # twice: no error
    with pytest.raises(ValueError, match="taken by gpupool"):
        register(type("Fake", (EnforcementMode,), {"name": "mps"}))
    with pytest.raises(TypeError, match="needs a name"):
        type("Nameless", (EnforcementMode,), {})


def test_mps_mode_sets_up_its_daemon_and_gives_workers_its_directories(tmp_path, monkeypatch):
    program = tmp_path / "mps-control"
    program.write_text('#!/bin/sh\nif [ "$1" = "-d" ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi\n'
                       'read line; echo "$line"\n')
    program.chmod(0o755)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "pipe"))
    monkeypatch.setattr(MPS, "executable", str(program))
    mode = MPS()
    mode.setup(str(tmp_path / "state"), logging.getLogger("test"))
    env = mode.environment([A100], 0.5, 40 * GiB, "L-1", "ann", "n")
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "pipe")
    assert env["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "state" / "mps-log")
    assert mode.control.started
    mode.close(logging.getLogger("test"))
    assert not mode.control.started
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "other"))
    monkeypatch.setattr(MPS, "executable", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="--enforcement=timeslice runs without MPS"):
        MPS().setup(str(tmp_path / "state"), logging.getLogger("test"))


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
