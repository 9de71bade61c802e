"""The trace-driven simulator on tiny hand-made traces whose answers are worked out below.

Times in seconds; GPU-seconds = fraction x GPUs x seconds held.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from gpupool.cli import main as cli_main
from gpupool.hub_plugin.scheduler import Placement
from gpupool.hub_plugin.simulator_notebooks import policies, simulate_notebooks
from gpupool.hub_plugin.simulator_openb import fill
from gpupool.hub_plugin.simulator_pool import GPUSpec, Pool, uniform_pool
from gpupool.hub_plugin.simulator_workload import Cell, NotebookWorkload, Session, build_sessions

FAR = 10**6  # sessions close long after the test's cells


def tiny_workload() -> NotebookWorkload:
    """A: half-GPU notebook, cells at 0 (600 s) and 1200 (300 s); B: half-GPU, cell at 60 (120 s);
    C: two whole GPUs, cell at 120 (600 s)."""
    cells = (Cell(0, 0, 0.0, 600.0), Cell(1, 1, 60.0, 120.0), Cell(2, 2, 120.0, 600.0), Cell(3, 0, 1200.0, 300.0))
    sessions = (Session(0, 0, 0, 1, 500, 0.0, FAR, (0, 3)), Session(1, 1, 1, 1, 500, 60.0, FAR, (1,)),
                Session(2, 2, 0, 2, 1000, 120.0, FAR, (2,)))
    return NotebookWorkload(cells, sessions, "hand-made")


def run(name: str):
    return simulate_notebooks(tiny_workload(), policies(gpupool_idle_timeout=300.0)[name], 2, per_node=2)


def test_gpupool_by_hand():
    """Slices, 5-minute idle reclaim at 5-second sweep ticks, on 2 GPUs of one node.

    0     A takes 0.5 of GPU 0 (best fit, lowest index)
    60    B takes 0.5 of GPU 0 too (best fit: leaves 0 free); ends at 180, idle
    120   C wants 2 whole GPUs: GPU 0 is not idle -> waits
    480   B reclaimed (idle 300 s): held 0.5 x 420 = 210; C still waits (A holds GPU 0)
    600   A's cell ends; 900 A reclaimed: held 0.5 x 900 = 450; C starts (waited 780)
    1200  A's next cell: both GPUs held by C -> waits
    1500  C ends; 1800 C reclaimed: held 2 x 900 = 1800; A resumes (waited 600) until 2100
    2400  A reclaimed: held 0.5 x 600 = 300
    held 2760 GPU-s; busy 0.5x600 + 0.5x120 + 2x600 + 0.5x300 = 1710 GPU-s.
    """
    result = run("gpupool")
    assert result.waits.tolist() == [0, 0, 780, 600]
    assert result.held_gpu_hours * 3600 == pytest.approx(2760)
    assert result.busy_gpu_hours * 3600 == pytest.approx(1710)
    assert result.acquisitions == 4
    assert result.wait_percentile(50) == 300 and result.waited_share == 0.5
    assert result.held_by_group == pytest.approx({0: (450 + 1800 + 300) / 3600, 1: 210 / 3600})


def test_reservation_by_hand():
    """Whole GPUs, 30-minute idle reclaim.

    0     A takes GPU 0; 60 B takes GPU 1 (ends 180, reclaimed 1980: held 1920)
    120   C waits for two idle GPUs
    1200  A's next cell runs on its held GPU at once (ends 1500)
    3300  A reclaimed: held 3300; C starts (waited 3180), ends 3900, reclaimed 5700: held 4800
    """
    result = run("reservation")
    assert result.waits.tolist() == [0, 0, 3180, 0]
    assert result.held_gpu_hours * 3600 == pytest.approx(1920 + 3300 + 4800)
    assert result.busy_gpu_hours * 3600 == pytest.approx(1710)
    assert result.acquisitions == 3


def test_batch_by_hand():
    """Whole GPUs held only while a cell runs, strict FIFO.

    A runs 0-600 on GPU 0, B 60-180 on GPU 1; C waits until A ends (480 s), runs 600-1200;
    A's next cell arrives at 1200 as C ends and starts then. Held 600 + 120 + 1200 + 300.
    """
    result = run("batch")
    assert result.waits.tolist() == [0, 0, 480, 0]
    assert result.held_gpu_hours * 3600 == pytest.approx(2220)


def test_fifo_blocks_smaller_requests_but_gpupool_does_not():
    """2 GPUs. X (0.75) runs 0-600, Y (2 whole GPUs) arrives at 60, Z (0.25) at 120.

    gpupool: X takes 0.75 of GPU 0; Y waits for two idle GPUs; Z takes the rest of GPU 0 at
    once; X is reclaimed at 900, then Y starts (waited 840).
    batch: X takes GPU 0 whole; Y waits; Z would fit on GPU 1 but queues behind Y (strict FIFO);
    Y runs 600-660, then Z (both waited 540)."""
    cells = (Cell(0, 0, 0.0, 600.0), Cell(1, 1, 60.0, 60.0), Cell(2, 2, 120.0, 60.0))
    sessions = (Session(0, 0, 0, 1, 750, 0.0, FAR, (0,)), Session(1, 1, 0, 2, 1000, 60.0, FAR, (1,)),
                Session(2, 2, 0, 1, 250, 120.0, FAR, (2,)))
    workload = NotebookWorkload(cells, sessions, "hand-made")
    slices = simulate_notebooks(workload, policies(300.0)["gpupool"], 2, per_node=2)
    assert slices.waits.tolist() == [0, 840, 0]
    batch = simulate_notebooks(workload, policies()["batch"], 2, per_node=2)
    assert batch.waits.tolist() == [0, 540, 540]


def test_session_rule():
    """One user: a cell joins the earliest open session of its size that is not running a cell."""
    rows = [(0, 1, 0.0, 600.0), (1, 1, 60.0, 60.0), (2, 4, 120.0, 60.0), (3, 1, 700.0, 60.0),
            (4, 1, 30000.0, 60.0)]
    workload = build_sessions(rows, np.array([500]), users=1, groups=1, workday_s=28800.0)
    assert [c.session for c in workload.cells] == [0, 1, 2, 0, 3]
    assert [(s.gpus, s.milli) for s in workload.sessions] == [(1, 500), (1, 500), (4, 1000), (1, 500)]
    assert workload.sessions[0].closes == 28800.0 and workload.sessions[0].cells == (0, 3)


def irregular_specs() -> list[GPUSpec]:
    sizes = {"n-a": 2, "n-b": 8, "n-c": 1, "n-d": 4, "n-e": 8, "n-f": 2}
    return [GPUSpec(node, i, "T4", 16 * 10**9) for node, count in sizes.items() for i in range(count)]


def test_indexed_pool_places_like_the_full_list():
    """The pool decides through the placement index; every decision equals place() on all GPUs."""
    rng = random.Random(7)
    fast, full = Pool(irregular_specs()), Pool(irregular_specs(), full_scan=True)
    held = []
    for step in range(3000):
        if held and rng.random() < 0.45:
            placement = held.pop(rng.randrange(len(held)))
            fast.give(placement)
            full.give(placement)
            continue
        gpus = rng.choice([1, 1, 1, 1, 2, 4, 8])
        milli = rng.choice([100, 250, 320, 470, 500, 650, 810, 1000]) if gpus == 1 else 1000
        a, b = fast.place(milli, gpus), full.place(milli, gpus)
        assert isinstance(a, Placement) == isinstance(b, Placement), step
        if isinstance(a, Placement):
            assert a == b, step
            fast.take(a)
            full.take(a)
            held.append(a)
    assert fast.milli == full.milli


def test_pool_never_overallocates():
    pool = uniform_pool(2, per_node=2)
    for _ in range(4):
        pool.take(pool.place(500, 1))
    assert not isinstance(pool.place(1, 1), Placement)
    with pytest.raises(AssertionError):
        pool.take(Placement("node-000", ("GPU-node-000-0",), 0.5, 0))


def test_openb_fill_by_hand():
    """Node a has 2 GPUs, node b 1. Tasks 0.6, 0.4, 0.6, then 2 whole GPUs.

    gpupool: 0.6 -> a/0; 0.4 -> a/0 (leaves 0); 0.6 -> a/1; 2 whole: no node has 2 idle -> fails.
    bestfit: 0.6 -> b (node left with least); 0.4 -> b; 0.6 -> a/0; 2 whole fails.
    Either way 1.6 of 3 GPUs allocated: 46.7 % unallocated once arrived demand passes 50 % and 100 %.
    """
    specs = [GPUSpec("a", 0, "T4", 16 * 10**9), GPUSpec("a", 1, "T4", 16 * 10**9), GPUSpec("b", 0, "T4", 16 * 10**9)]
    num, milli = np.array([1, 1, 1, 2]), np.array([600, 400, 600, 1000])
    for policy in ("gpupool", "bestfit", "firstfit"):
        result = fill(specs, num, milli, policy, step=0.5)
        assert result.arrived.tolist() == [0.5, 1.0], policy
        assert result.unallocated == pytest.approx([1 - 1.6 / 3] * 2), policy
        assert result.failed[-1] == 0.25


def test_cli_on_tiny_traces(tmp_path, capsys):
    (tmp_path / "sensei_june_60sec.csv").write_text(
        "job_id,num_gpu,submit_time,iterations,model_name,duration,interval\n"
        "1,1,3,0,vgg11,2,0\n0,1,0,0,resnet50,5,0\n2,8,1,0,bert,10,0\n")
    (tmp_path / "openb_pod_list_default.csv").write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
        "scheduled_time\np0,1000,1024,1,500,,LS,Running,0,10,0\np1,1000,1024,2,1000,,LS,Running,0,10,0\n")
    (tmp_path / "openb_node_list_gpu_node.csv").write_text(
        "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,8,V100M32\nn1,64000,262144,2,T4\n")
    assert cli_main(["simulate", "--data", str(tmp_path), "--pool-size", "8,16", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 cells" in out and out.count("gpupool") >= 2 and (tmp_path / "simulate-sensei.json").exists()
    assert cli_main(["simulate", "--workload", "openb", "--data", str(tmp_path), "--max-load", "1.0"]) == 0
    assert "bestfit" in capsys.readouterr().out
