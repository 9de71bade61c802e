"""The trace-driven simulator on tiny hand-made traces whose answers are worked out below.

Times in seconds; GPU-seconds = fraction x GPUs x seconds held.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from gpupool.cli import main as cli_main
from gpupool.hub_plugin.rules.scheduler import Placement
from gpupool.hub_plugin.simulate.notebooks import simulate_notebooks
from gpupool.hub_plugin.simulate.openb import fill
from gpupool.hub_plugin.simulate.policies import policies
from gpupool.hub_plugin.simulate.pool import GPUSpec, SimulatedPool, uniform_pool
from gpupool.hub_plugin.simulate.workload import Cell, NotebookWorkload, Session, build_sessions

FAR = 10**6  # sessions close long after the test's cells


def tiny_workload() -> NotebookWorkload:
    """A: half-GPU notebook, cells at 0 (600 s) and 1200 (300 s); B: half-GPU, cell at 60 (120 s);
    C: two whole GPUs, cell at 120 (600 s)."""
    cells = (Cell(0, 0, 0.0, 600.0), Cell(1, 1, 60.0, 120.0), Cell(2, 2, 120.0, 600.0), Cell(3, 0, 1200.0, 300.0))
    sessions = (Session(0, 0, 0, 1, 500, 0.0, FAR, (0, 3)), Session(1, 1, 1, 1, 500, 60.0, FAR, (1,)),
                Session(2, 2, 0, 2, 1000, 120.0, FAR, (2,)))
    return NotebookWorkload(cells, sessions, "hand-made")


def free_parks(policy):
    """``policy`` with parks that release the lease and cost nothing, and preempted jobs that restart:
    the rules alone, whose arithmetic the hand-worked tests below follow (park costs: test_simulate_parking.py)."""
    return replace(policy, park_in_place=False, resume_preempted=False)


def run(name: str, pressure_grace=None):
    chosen = policies(gpupool_idle_timeout=300.0, pressure_grace=pressure_grace)
    return simulate_notebooks(tiny_workload(), free_parks(chosen[name]), 2, per_node=2)


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
    slices = simulate_notebooks(workload, free_parks(policies(300.0, pressure_grace=None)["gpupool"]), 2, per_node=2)
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
    fast, full = SimulatedPool(irregular_specs()), SimulatedPool(irregular_specs(), full_scan=True)
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


# -- the simulator's own pure rules (ETA, dedicated), as tables -------------------------------------------
# Class order, pressure parks and preemption are the service's (hub_plugin/rules/priority.py, tests/rules/test_priority.py);
# the replays below check that the simulator decides with them.

from datetime import datetime, timedelta, timezone  # noqa: E402

from gpupool.hub_plugin.rules.priority import BATCH  # noqa: E402
from gpupool.hub_plugin.simulate.estimates import peak_concurrent  # noqa: E402


def test_peak_concurrent_and_the_dedicated_baseline():
    assert peak_concurrent([(0, 10, 1), (5, 15, 4), (10, 20, 8)]) == 12  # 10 ends before 10 starts
    workload = tiny_workload()
    from gpupool.hub_plugin.simulate.policies import dedicated_gpus
    # users 0 (A: 1 card), 1 (B: 1 card), 2 (C: 2 cards); none runs two cells at once.
    assert dedicated_gpus(workload) == {0: 1, 1: 1, 2: 2}


def test_gpupool_with_pressure_parks_by_hand():
    """As test_gpupool_by_hand, but idle leases are parked 120 s after their cell while C or A waits.

    120   C waits; A's cell runs on GPU 0, so the node cannot be cleared for C's two whole GPUs and
          C presses on nothing: B (idle since 180) is not parked early but at its own timeout, 480
    600   A's cell ends: the node can be cleared; A is parked at 720 (120 s after its cell)
    720   C starts (waited 600); 1200 A waits; C ends 1320, parked 1440 -> A starts (waited 240).
    """
    result = run("gpupool", pressure_grace=120.0)
    assert result.waits.tolist() == [0, 0, 600, 240]
    assert result.early_parks == 2 and result.parks == 4


def test_an_early_park_gives_its_user_the_grace_from_the_ask():
    """As the service's plan: an idle lease is parked ``grace`` after the
    request that presses on it was asked, however long it was idle before.

    1 GPU; A (half a GPU, 30 min idle timeout) runs 0-100, then idles. At
    1000 B asks for the whole GPU: A is parked at 1000 + 120, B starts then."""
    cells = (Cell(0, 0, 0.0, 100.0), Cell(1, 1, 1000.0, 60.0))
    sessions = (Session(0, 0, 0, 1, 500, 0.0, FAR, (0,)), Session(1, 1, 1, 1, 1000, 1000.0, FAR, (1,)))
    chosen = free_parks(policies(gpupool_idle_timeout=1800.0, pressure_grace=120.0)["gpupool"])
    result = simulate_notebooks(NotebookWorkload(cells, sessions, "hand-made"), chosen, 1, per_node=1)
    assert result.waits.tolist() == [0.0, 120.0]
    assert result.early_parks == 1


def backlog_run(policy, *, load=1.0, seconds=1000.0):
    """The one-cell notebook of :func:`test_batch_backlog_is_preempted_for_an_interactive_request`
    on 2 GPUs of one node, with a backlog of 1-GPU batch jobs of ``seconds``."""
    from gpupool.hub_plugin.simulate.backlog import BatchSource

    cells = (Cell(0, 0, 60.0, 100.0),)
    sessions = (Session(0, 0, 0, 1, 1000, 60.0, 200.0, (0,)),)
    backlog = BatchSource(np.array([1000]), np.array([1]), np.array([seconds]), load=load, users=1)
    return simulate_notebooks(NotebookWorkload(cells, sessions, "hand-made"), policy, 2, per_node=2, backlog=backlog)


def test_batch_backlog_is_preempted_for_an_interactive_request():
    """2 GPUs, one node; two batch jobs (1000 s, preemptible) start at 0.

    At 60 an interactive notebook asks for a whole GPU: nothing is free and
    nothing idle, so the plan names a batch job (the newest; a tie, the lower
    id) to be interrupted at 60 + grace 120 + notice 30 = 210. The cell
    starts then (waited 150) and the job is queued again; it starts at 310,
    when the notebook's kernel is gone. Batch work lost: 1 GPU x 210 s."""
    gpupool = free_parks(policies(300.0)["gpupool"])
    result = backlog_run(gpupool)
    assert result.waits.tolist() == [150.0]
    assert result.preemptions == 1
    assert result.lost_gpu_hours * 3600 == pytest.approx(210.0)
    assert result.batch_waits[:3].tolist() == [0.0, 0.0, 100.0] and result.wait_percentile(50, BATCH) == 0.0
    # Without preemption the notebook waits for a batch job to end (1000 s).
    assert backlog_run(replace(gpupool, preemption_notice=None)).waits.tolist() == [940.0]
    # Jobs that resume keep their 210 s: nothing is lost.
    assert backlog_run(replace(gpupool, resume_preempted=True)).lost_gpu_hours == 0.0


def test_a_workloads_own_batch_sessions_yield_only_when_preemptible():
    """A store's batch leases are sessions of the workload itself (not a backlog). 1 GPU, one node:
    a batch job asks for it at 0 (1000 s); at 60 a notebook asks for the whole GPU. Preemptible, the
    job is interrupted at 60 + grace 120 + notice 30 = 210 and the cell starts then (waited 150); not
    preemptible, the cell waits for the job's end (940 s). The job's waits count as batch waits, the
    notebook's alone as interactive ones; a batch session gives its lease back when its cell ends."""
    def replay(preemptible: bool):
        cells = (Cell(0, 0, 0.0, 1000.0), Cell(1, 1, 60.0, 100.0))
        sessions = (Session(0, 0, 0, 1, 1000, 0.0, FAR, (0,), BATCH, preemptible),
                    Session(1, 1, 1, 1, 1000, 60.0, 200.0, (1,)))
        policy = free_parks(policies(300.0)["gpupool"])
        return simulate_notebooks(NotebookWorkload(cells, sessions, "hand-made"), policy, 1,
                                  per_node=1)

    yielded, kept = replay(True), replay(False)
    assert (yielded.waits.tolist(), yielded.preemptions) == ([150.0], 1)
    assert yielded.batch_waits.tolist() == [310.0]  # queued again at 210, started when the cell ended at 310
    assert yielded.lost_gpu_hours * 3600 == pytest.approx(210.0)
    assert (kept.waits.tolist(), kept.preemptions, kept.batch_waits.tolist()) == ([940.0], 0, [0.0])
    assert kept.held_gpu_hours * 3600 == pytest.approx(1000.0 + 100.0)  # the job's lease ends with it


# -- openb with CPU and memory ------------------------------------------------------------------------------

from gpupool.hub_plugin.simulate.multidim import POLICIES, MultiCluster, node_fragmentation, task_types  # noqa: E402
from gpupool.hub_plugin.simulate.workload import OpenbNode  # noqa: E402


def test_fragmentation_counts_every_dimension():
    """One node, 2 GPUs free 600 and 1000; workload: half 500-milli slices needing 4 cores, half 2 whole GPUs.

    With 8 cores free: the slice fits, no GPU is too small for it (0); 2 whole GPUs do not fit (600 + 1000).
    With 2 cores free: the slice does not fit either: all 1600 free milli count for it too.
    (Weights are task counts, one each: the sum is milli x tasks.)"""
    types = task_types([4000, 1000], [1024, 1024], [1, 2], [500, 1000])
    gpu = np.array([[600, 1000]])
    assert node_fragmentation(np.array([8000]), np.array([4096]), gpu, types).tolist() == [1 * 0 + 1 * 1600]
    assert node_fragmentation(np.array([2000]), np.array([4096]), gpu, types).tolist() == [1600 + 1600]


def node(name, gpus, cores, gib):
    return OpenbNode(name, gpus, "T4", 16 * 10**9, cores * 1000, gib * 1024)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_task_goes_only_where_cpu_and_memory_fit(policy):
    """Node a has a GPU but only 2 cores left after a first task; node b has cores.
    A 4-core, 0.5-GPU task can only go to b; a 1-core one also fits on a."""
    types = task_types([4000, 1000], [1024, 1024], [1, 1], [500, 500])
    cluster = MultiCluster([node("a", 1, 4, 64), node("b", 2, 16, 64)], types)
    cluster.take(0, np.array([0]), 2000, 1024, 250)
    assert cluster.choose(policy, 4000, 1024, 1, 500)[0] == 1
    assert cluster.choose("firstfit", 1000, 1024, 1, 500)[0] == 0
    assert cluster.choose(policy, 64000, 1024, 1, 500) is None  # more cores than any node


def test_bestfit_is_the_papers_absolute_free_cpu_and_gpu():
    """Node a (2 GPUs, 16 cores) has 1 GPU and 8 cores free: half of its own, but 8/96 + 1/8 of the largest
    node's. Node b (8 GPUs, 96 cores) has 2 GPUs and 24 cores free: a quarter of its own, 24/96 + 2/8 of the
    largest. The paper's BestFit counts amounts (in the largest node's units), not each node's shares: a."""
    types = task_types([1000], [1024], [1], [500])
    cluster = MultiCluster([node("a", 2, 16, 64), node("b", 8, 96, 64)], types)
    cluster.take(0, np.array([0]), 8000, 1024, 1000)
    cluster.take(1, np.arange(6), 72000, 1024, 1000)
    assert cluster.choose("bestfit", 1000, 1024, 1, 500)[0] == 0


def test_fgd_prefers_the_gpu_a_slice_fills():
    """Two GPUs free 500 and 1000 on one node; a 500 slice goes where it leaves no sliver."""
    types = task_types([1000], [1024], [1], [500])
    cluster = MultiCluster([node("a", 2, 16, 64)], types)
    cluster.take(0, np.array([0]), 1000, 1024, 500)
    assert cluster.choose("fgd", 1000, 1024, 1, 500)[1].tolist() == [0]


# -- a pool's own history ------------------------------------------------------------------------------------

def test_from_store_replays_the_recorded_leases(tmp_path, capsys):
    """Two leases of one kernel (the first reclaimed after 600 s idle, the second released, with two
    recorded cells), one of another user's that never started (left out), a batch run and a lease that
    ran no cell: the first lease and the batch run (from before cells were recorded) are one busy burst
    each, the second lease its two cells, the first of them arriving when the lease was asked for, and
    the last one its ask."""
    from gpupool.hub_plugin.db import Store
    from gpupool.hub_plugin.models import GPU, Lease, LeaseCell, Node, UsageRecord
    from gpupool.hub_plugin.simulate.store import load_store

    url = f"sqlite:///{tmp_path}/pool.sqlite"
    store = Store(url)
    store.migrate()
    t0 = datetime(2026, 3, 1, 9, tzinfo=timezone.utc)
    at = lambda s: t0 + timedelta(seconds=s)  # noqa: E731
    with store.write() as db:
        db.add(Node(name="n", url="http://127.0.0.1:9", inventory="simulated", state="up", registered_at=t0,
                    last_heartbeat_at=t0, gpus=[GPU(uuid=f"G-{i}", name="L4", index=i, memory_total=24 * 10**9,
                                                    memory_reserved=0, healthy=True) for i in range(2)]))
        rows = [("L-000000000001", "ann", "k1", 0.5, "reclaimed", "idle for 10m (idle timeout 10m)", 0, 10, 1810),
                ("L-000000000002", "ann", "k1", 0.5, "released", "released by its owner", 3600, 3600, 4200),
                ("L-000000000003", "bob", "k2", 1.0, "failed", "waited too long", 100, None, None),
                ("L-000000000004", "cy", None, 1.0, "released", "released by its owner", 5000, 5000, 5300),
                ("L-000000000005", "dee", "k3", 0.5, "released", "released by its owner", 6000, 6000, 6100)]
        for lease_id, owner, kernel, fraction, state, reason, created, started, ended in rows:
            batch = lease_id == "L-000000000004"  # a preemptible gpupool run
            db.add(Lease(id=lease_id, owner=owner, state=state, reason=reason, fraction=fraction, gpu_count=1,
                         memory=10**9, kernel_id=kernel, idle_timeout=600, heartbeat_ttl=60, created_at=at(created),
                         started_at=None if started is None else at(started),
                         ended_at=None if ended is None else at(ended), usage_gpu_seconds=0.0, groups=["quants"],
                         lease_class="batch" if batch else "interactive", preemptible=batch,
                         cells_recorded=lease_id in ("L-000000000002", "L-000000000005")))  # the rest: before 0009
            if ended is not None:
                db.add(UsageRecord(lease_id=lease_id, owner=owner, groups=["quants"], gpus=fraction,
                                   started_at=at(started), ended_at=at(ended),
                                   gpu_seconds=fraction * (ended - started)))
        db.add_all([LeaseCell(lease_id="L-000000000002", started_at=at(3700), ended_at=at(3800)),
                    LeaseCell(lease_id="L-000000000002", started_at=at(3900), ended_at=None)])  # ran to the end
    store.close()
    history = load_store(url)
    assert (history.leases, history.skipped, history.pool_gpus, history.without_cells) == (4, 1, 2, 2)
    assert history.recorded_gpu_hours * 3600 == pytest.approx(0.5 * 1800 + 0.5 * 600 + 300 + 0.5 * 100)
    cells = history.workload.cells
    assert [(c.session, c.submit, c.duration) for c in cells] == [(0, 0.0, 1200.0), (0, 3600.0, 100.0),
                                                                 (0, 3900.0, 300.0), (1, 5000.0, 300.0),
                                                                 (2, 6000.0, 1.0)]  # dee ran no cell: her ask
    assert [(s.gpus, s.milli, s.closes, s.klass, s.preemptible) for s in history.workload.sessions] == [
        (1, 500, 4200.0, "interactive", False), (1, 1000, 5300.0, "batch", True),
        (1, 500, 6100.0, "interactive", False)]
    assert cli_main(["simulate", "--from-store", url, "--pool-size", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "4 ended leases (1 never started" in out and "dedicated: 3 GPUs" in out
    assert "the cells of 2 leases from before revision 0009" in out
    assert "request class" not in out, "class and preemptibility are read from the store, not assumed"


def test_from_store_names_the_fix_for_a_bad_url(tmp_path):
    with pytest.raises(SystemExit, match="c.GPUPool.db_url"):
        cli_main(["simulate", "--from-store", f"sqlite:///{tmp_path}/none/x.sqlite"])


def test_cli_runs_on_generated_traces_without_data(capsys):
    """From the wheel there are no public traces: the command generates a cluster and its tasks."""
    assert cli_main(["simulate", "--workload", "openb", "--dimensions", "all", "--max-load", "0.6",
                     "--policy", "firstfit,fgd"]) == 0
    out = capsys.readouterr().out
    assert "tasks (CPU, memory and GPU asks) drawn" in out and "fgd" in out and "firstfit" in out


def test_generated_notebook_month_has_the_trace_form():
    from gpupool.hub_plugin.simulate.synthetic import sensei_rows

    rows = sensei_rows(0, days=2)
    assert rows == sorted(rows, key=lambda r: (r[2], r[0]))
    assert {r[1] for r in rows} == {1, 4, 8} and all(r[3] >= 60 and r[3] % 60 == 0 for r in rows)
    assert 1500 < len(rows) < 2600  # about 43 an hour


def test_the_replay_records_the_eta_next_to_the_old_estimate_and_the_wait():
    """test_gpupool_by_hand's pool (no pressure parks), with the service's ETA rule. At 120 C (2 GPUs)
    waits: A and B run and no cell has ended yet, so nothing is known of how long cells run: no ETA
    (nor an old estimate, with no ended lease). It waited 780. At 1200 A waits for C (started 900):
    cells so far ran 600 and 120 s (median 360), so C is expected free at 900 + 360 + 300 (its idle
    timeout) = 1560: ETA 360 s; old estimate: 1 x median lease (420, 900 -> 660) / 1 lease held.
    It waited 600."""
    chosen = policies(gpupool_idle_timeout=300.0, pressure_grace=None)
    result = simulate_notebooks(tiny_workload(), free_parks(chosen["gpupool"]), 2, per_node=2, with_eta=True)
    assert result.eta_errors == ((None, None, 780.0), (360.0, 660.0, 600.0))


# -- the replay imports nothing that does I/O -------------------------------------------------------------

#: The replay's modules; beside them, traces.py reads CSV files, store.py a store, cli.py is the command.
REPLAY = ("notebooks", "sessions", "policies", "sweep", "waiting", "backlog", "eta_log", "results", "openb",
          "multidim", "pool", "workload", "estimates", "synthetic", "costs", "parked", "defaults")
IO_PACKAGES = ("sqlalchemy", "alembic", "psycopg", "tornado", "zmq", "jupyter_client", "socket", "csv", "asyncio")


def test_the_replay_imports_only_the_rules_and_numpy():
    """Imported in a fresh interpreter, the replay pulls in no SQL, web, ZMQ or file-reading module,
    and of gpupool only the pure rules and the shared schema/units/lease classes."""
    import subprocess
    import sys

    code = ("import sys\n" + "".join(f"import gpupool.hub_plugin.simulate.{name}\n" for name in REPLAY)
            + f"print(sorted(m for m in {IO_PACKAGES!r} if m in sys.modules))\n"
            + "print(sorted(m for m in sys.modules if m.startswith('gpupool.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    io, ours = out.splitlines()
    assert io == "[]"
    allowed = ("gpupool.hub_plugin.rules", "gpupool.hub_plugin.simulate", "gpupool.schema", "gpupool.units",
               "gpupool.errors", "gpupool.strenum", "gpupool.leaseclasses", "gpupool.hub_plugin")
    assert [m for m in eval(ours) if not m.startswith(allowed)] == []
    assert not [m for m in eval(ours) if m.startswith("gpupool.hub_plugin.simulate.")
                and m.rpartition(".")[2] not in REPLAY]
