"""Process-tree attribution and PID-namespace mapping, on literal procfs trees
and on the real /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpupool.node.attribution import (GPUProcess, PidMapper, add_unattributed, attribute, read_parents,
                                             read_proc)

GiB = 1024**3
G0, G1 = "GPU-0", "GPU-1"


def write_proc(root: Path, pid: int, ppid: int, nspid: list[int], start: int, comm: str = "python") -> None:
    """One /proc/PID entry: the status lines and stat fields read_proc uses."""
    base = root / str(pid)
    base.mkdir(parents=True)
    (base / "status").write_text(f"Name:\t{comm}\nPid:\t{pid}\nPPid:\t{ppid}\nNSpid:\t" +
                                 "\t".join(map(str, nspid)) + "\n")
    rest = ["S", str(ppid)] + ["0"] * 17 + [str(start)] + ["0"] * 10
    (base / "stat").write_text(f"{pid} ({comm}) " + " ".join(rest) + "\n")


@pytest.fixture
def namespaces(tmp_path):
    """A host and the agent's container (one level down).

    host pid 5000 = agent (container pid 1), 5001 = worker (container 42),
    5002 = the worker's dataloader (container 43), 6001 = a process of a
    sibling container whose own pid is also 42, 7000 = a host process.
    """
    host, local = tmp_path / "host", tmp_path / "container"
    write_proc(host, 5000, 4000, [5000, 1], 100)
    write_proc(host, 5001, 5000, [5001, 42], 200)
    write_proc(host, 5002, 5001, [5002, 43], 300)
    write_proc(host, 6001, 6000, [6001, 42], 250)
    write_proc(host, 7000, 1, [7000], 50)
    write_proc(local, 1, 0, [1], 100)
    write_proc(local, 42, 1, [42], 200)
    write_proc(local, 43, 42, [43], 300)
    (local / "self").symlink_to(local / "1")
    return host, local


def test_read_proc_parses_status_and_stat(tmp_path):
    write_proc(tmp_path, 9, 1, [9, 3], 777, comm="odd ) name")
    assert read_proc(tmp_path, 9).__dict__ == {"pid": 9, "ppid": 1, "nspid": (9, 3), "start_time": 777}
    assert read_proc(tmp_path, 10) is None


def test_host_pids_map_into_the_agents_namespace(namespaces):
    host, local = namespaces
    mapper = PidMapper(host_proc=host, local_proc=local, host_namespace=False)
    assert mapper.to_local([5001, 5002, 6001, 7000, 99999]) == {5001: 42, 5002: 43}
    assert mapper.problem is None


def test_a_reused_pid_is_not_taken_for_the_old_process(namespaces):
    host, local = namespaces
    (local / "42").rename(local / "old")
    write_proc(local, 42, 1, [42], 999)  # pid 42 reused: another start time
    assert PidMapper(host_proc=host, local_proc=local, host_namespace=False).to_local([5001]) == {}


def test_in_a_container_without_the_hosts_proc_nothing_maps_and_the_fix_is_named(namespaces):
    _host, local = namespaces
    mapper = PidMapper(local_proc=local, host_namespace=False)
    assert mapper.to_local([5001, 42]) == {}
    assert "hostPID" in mapper.problem and "c.AgentInventory.host_proc" in mapper.problem


def test_wrong_host_proc_is_reported(namespaces, tmp_path):
    _host, local = namespaces
    other = tmp_path / "other"
    write_proc(other, 1, 0, [1], 5)
    mapper = PidMapper(host_proc=other, local_proc=local, host_namespace=False)
    assert mapper.to_local([5001]) == {}
    assert "is it the host's /proc" in mapper.problem


def test_worker_usage_is_the_sum_over_its_process_tree():
    parents = {42: 1, 43: 42, 44: 43, 50: 1, 60: 1}
    procs = [GPUProcess(G0, 5001, 42, GiB), GPUProcess(G0, 5004, 44, 2 * GiB), GPUProcess(G1, 5004, 44, GiB),
             GPUProcess(G0, 5050, 50, 3 * GiB), GPUProcess(G0, 6001, None, 4 * GiB),
             GPUProcess(G1, 5060, 60, None)]
    result = attribute(procs, {"L-a": 42, "L-b": 50}, parents)
    assert result.memory == {"L-a": {G0: 3 * GiB, G1: GiB}, "L-b": {G0: 3 * GiB}}
    assert result.pids == {"L-a": [42, 44], "L-b": [50]}
    assert result.worker_memory("L-a") == 4 * GiB and result.worker_memory("L-c") is None
    assert [p.pid for p in result.unattributed] == [6001, 5060]
    assert result.unattributed_memory() == {G0: 4 * GiB}
    metrics = [{"uuid": G0}, {"uuid": G1}, {"uuid": "GPU-2"}]
    assert add_unattributed(metrics, result, known={G0, G1}) == [
        {"uuid": G0, "memory_unattributed": 4 * GiB}, {"uuid": G1, "memory_unattributed": 0},
        {"uuid": "GPU-2", "memory_unattributed": None}]


def test_parent_loops_do_not_hang():
    assert attribute([GPUProcess(G0, 1, 7, GiB)], {"L": 99}, {7: 8, 8: 7}).unattributed


def test_real_process_tree_of_a_worker_like_child():
    """A child that starts a grandchild: both are attributed to the child's lease."""
    child = subprocess.Popen([sys.executable, "-c",
                              "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                              "'import time; time.sleep(30)']); print(p.pid, flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    grandchild = None
    try:
        grandchild = int(child.stdout.readline())
        parents = read_parents()
        assert parents[grandchild] == child.pid
        procs = [GPUProcess(G0, grandchild, grandchild, GiB), GPUProcess(G0, os.getpid(), os.getpid(), GiB)]
        result = attribute(procs, {"L-x": child.pid}, parents)
        assert result.memory == {"L-x": {G0: GiB}}
        assert [p.pid for p in result.unattributed] == [os.getpid()]
        mapper = PidMapper()
        if mapper.problem is None:  # this test runs in the host's PID namespace
            assert mapper.to_local([grandchild, child.pid]) == {grandchild: grandchild, child.pid: child.pid}
        else:
            assert mapper.to_local([grandchild]) == {}
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        deadline = time.monotonic() + 5
        while grandchild and time.monotonic() < deadline:  # the orphaned grandchild
            try:
                os.kill(grandchild, 9)
            except ProcessLookupError:
                break
            time.sleep(0.05)
