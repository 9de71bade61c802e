"""The simulator's park-in-place model (hub_plugin/simulate/costs.py, parked.py and the replay's use of them),
on hand-made traces whose answers are worked out below. Seconds and bytes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gpupool.hub_plugin.config import PoolLeases, PoolPressure
from gpupool.hub_plugin.rules.scheduler import Placement
from gpupool.hub_plugin.simulate import costs, defaults
from gpupool.hub_plugin.simulate.backlog import BatchSource
from gpupool.hub_plugin.simulate.notebooks import simulate_notebooks
from gpupool.hub_plugin.simulate.parked import ParkedLease, ParkedNodes
from gpupool.hub_plugin.simulate.policies import policies
from gpupool.hub_plugin.simulate.pool import GPUSpec, SimulatedPool
from gpupool.hub_plugin.simulate.workload import Cell, NotebookWorkload, Session

FAR = 10**6
GB = 10**9


def test_the_replays_defaults_are_the_services():
    traits = {**PoolLeases.class_traits(), **PoolPressure.class_traits()}
    assert {name: traits[name].default_value for name in defaults.SETTINGS} == defaults.SETTINGS
    gpupool = policies()["gpupool"]
    assert (gpupool.idle_timeout, gpupool.pressure_grace, gpupool.preemption_notice) == (
        traits["idle_timeout"].default_value, traits["pressure_grace"].default_value,
        traits["preemption_notice"].default_value)
    assert gpupool.park_in_place and gpupool.resume_preempted  # preempted jobs are parked and keep their progress
    assert gpupool.resume_moves == traits["resume_moves"].default_value


def test_the_node_budget_is_the_agents_default():
    from traitlets.config import Config

    from gpupool.node.agent import NodeAgent

    agent = NodeAgent(config=Config({"AgentInventory": {"host_memory": costs.NODE_HOST_BYTES}}))
    agent.read_settings()
    assert costs.parked_budget() == agent.parked_budget()


def test_costs_scale_with_the_state():
    fixed = costs.warm_resume_seconds(0)
    assert fixed == costs.WARM_RESUME_S
    assert costs.warm_resume_seconds(2 * GB) - fixed == pytest.approx(2 * (costs.warm_resume_seconds(GB) - fixed))
    assert costs.warm_resume_seconds(8 * GB, gpus=8) == pytest.approx(costs.warm_resume_seconds(GB))  # a link each
    assert costs.warm_park_seconds(10 * GB) == pytest.approx(costs.WARM_PARK_S + 1.0)  # 10 GB/s
    # From memory < from disk < moved from disk to another node, for any size; disk and network grow with it too.
    for size in (0, GB, 40 * GB):
        assert costs.resume_seconds("memory", size) < costs.resume_seconds("disk", size) <= costs.resume_seconds(
            "moved", size, spilled=True)
    assert costs.spilled_resume_seconds(40 * GB) - costs.spilled_resume_seconds(0) == pytest.approx(40.0)
    # A move from memory goes worker to worker at the network's rate, skipping the disk's.
    assert costs.move_seconds(0, spilled=False) == costs.move_seconds(0, spilled=True)
    assert costs.move_seconds(25 * GB, spilled=False) - costs.move_seconds(0, spilled=False) == pytest.approx(8.0)
    assert costs.resume_seconds("moved", 40 * GB) < costs.resume_seconds("moved", 40 * GB, spilled=True)
    assert costs.state_bytes(500, 1, 80 * GB, 0.5) == 20 * GB
    assert costs.state_bytes(1000, 8, 80 * GB, 1.0) == 640 * GB


def held(node="n", gpus=("GPU-n-0",)) -> Placement:
    return Placement(node, gpus, 1.0, 80 * GB)


def test_over_the_budget_the_longest_parked_spill():
    parked = ParkedNodes(budget=100)
    assert parked.park(1, ParkedLease(held(), 60, since=0.0)) == []
    assert parked.park(2, ParkedLease(held(), 30, since=10.0)) == []
    assert parked.park(3, ParkedLease(held(), 30, since=20.0)) == [1]  # 120 > 100: the oldest goes to disk
    assert [parked.get(s).tier for s in (1, 2, 3)] == ["disk", "memory", "memory"]
    assert parked.held == {"n": 60}
    assert parked.pop(1).tier == "disk" and parked.held == {"n": 60}  # a spilled one held no RAM
    assert parked.park(4, ParkedLease(held("m", ("GPU-m-0",)), 100, since=30.0)) == []  # another node's budget
    assert parked.park(5, ParkedLease(held(), 200, since=40.0)) == [2, 3, 5]  # alone too big: spills too
    assert parked.held == {"n": 0, "m": 100} and parked.spills == 4


def one_notebook(*cells, gpus=1, milli=500, closes=FAR) -> NotebookWorkload:
    """One session of ``milli`` on ``gpus`` GPUs running ``(submit, duration)`` cells."""
    return NotebookWorkload(tuple(Cell(i, 0, s, d) for i, (s, d) in enumerate(cells)),
                            (Session(0, 0, 0, gpus, milli, 0.0, closes, tuple(range(len(cells)))),), "hand-made")


def parking(idle_timeout=300.0, pressure_grace=None, **changes):
    return replace(policies(idle_timeout, pressure_grace)["gpupool"], state_fill=1.0, **changes)


def test_a_resume_from_memory_costs_the_next_cell_its_state_over_the_link():
    """Half an 80 GB GPU, its state the whole slice: 40 GB. Cell 0-100; idle 300 s -> parked at the 400
    tick; the share is back at 400 + 0.01 + 40/10 = 404.01. Cell at 1000 resumes: 0.004 + 4 s, then runs
    until 1104.004; parked at the 1405 tick, free at 1409.01. Held 0.5 x (404.01 + 409.01)."""
    result = simulate_notebooks(one_notebook((0.0, 100.0), (1000.0, 100.0)), parking(), 1, per_node=1)
    assert result.waits.tolist() == [0.0, pytest.approx(4.004)]
    assert result.resume_waits.tolist() == [pytest.approx(4.004)] and result.resumes == {"memory": 1}
    assert result.held_gpu_hours * 3600 == pytest.approx(0.5 * (404.01 + 409.01))
    assert result.parks == 2 and result.spills == 0
    # Without parking in place the same cell takes a new lease at no cost.
    free = simulate_notebooks(one_notebook((0.0, 100.0), (1000.0, 100.0)), parking(park_in_place=False), 1,
                              per_node=1)
    assert free.waits.tolist() == [0.0, 0.0] and free.resumes == {}


def test_a_worker_bigger_than_its_nodes_budget_spills_and_resumes_from_disk():
    """8 whole 80 GB GPUs, all full: 640 GB, more than the node's 512 GiB budget: spilled at once.
    The next cell starts a new worker and loads it from disk: 3 s + 640 GB at 1 GB/s (its kernel shuts
    down before that cell ends, so the lease goes with it)."""
    workload = one_notebook((0.0, 100.0), (1000.0, 100.0), gpus=8, milli=1000, closes=1200.0)
    result = simulate_notebooks(workload, parking(), 8)
    assert result.spills == 1 and result.resumes == {"disk": 1}
    assert result.waits.tolist() == [0.0, pytest.approx(643.0)]


def test_a_second_park_spills_the_longest_parked_on_its_node():
    """One node of two 300 GB GPUs (budget 512 GiB = 549.8 GB); A and B take a whole GPU each, full.
    A parks first (idle from 100), then B (idle from 200): 600 GB > the budget, so A is spilled.
    At 2000 both come back: A from disk (3 + 300 s), B from memory (0.004 + 30 s); their kernels shut
    down at 2010, so their leases go when those cells end."""
    specs = [GPUSpec("n", i, "X", 300 * GB) for i in range(2)]
    cells = (Cell(0, 0, 0.0, 100.0), Cell(1, 1, 0.0, 200.0), Cell(2, 0, 2000.0, 10.0), Cell(3, 1, 2000.0, 10.0))
    sessions = (Session(0, 0, 0, 1, 1000, 0.0, 2010.0, (0, 2)), Session(1, 1, 0, 1, 1000, 0.0, 2010.0, (1, 3)))
    result = simulate_notebooks(NotebookWorkload(cells, sessions, "hand-made"), parking(), 2, pool=SimulatedPool(specs))
    assert result.spills == 1 and result.resumes == {"disk": 1, "memory": 1}
    assert result.waits.tolist() == [0.0, 0.0, pytest.approx(303.0), pytest.approx(30.004)]


def test_a_parked_lease_keeps_its_room_while_other_room_fits():
    """Two nodes of one 80 GB GPU. A (whole GPU, full) runs 0-100 on node-000, is parked at the 400 tick
    (free at 400 + 8.01). B asks at 500: node-000 is claimed by A's park, node-001 idle, so B goes to
    node-001 (the service's rule) and A's cell at 600 resumes at once from memory (8.004 s). Without the
    claim, B takes node-000 (best fit, by name) and A goes to node-001 at once, at a move's cost
    (``resume_moves``, the default): 3 s + 80 GB worker to worker at 25 Gbit/s. With ``resume_moves`` off, A's resume waits
    for its node: B is parked at the 2300 tick, free at 2308.01; A resumes there from memory: waited
    1716.014."""
    cells = (Cell(0, 0, 0.0, 100.0), Cell(1, 1, 500.0, 1500.0), Cell(2, 0, 600.0, 10.0))
    sessions = (Session(0, 0, 0, 1, 1000, 0.0, FAR, (0, 2)), Session(1, 1, 0, 1, 1000, 500.0, FAR, (1,)))
    workload = NotebookWorkload(cells, sessions, "hand-made")
    kept = simulate_notebooks(workload, parking(), 2, per_node=1)
    assert kept.waits.tolist() == [0.0, 0.0, pytest.approx(8.004)] and kept.resumes == {"memory": 1}
    waited = simulate_notebooks(workload, parking(parked_claims=False, resume_moves=False), 2, per_node=1)
    assert waited.waits.tolist() == [0.0, 0.0, pytest.approx(1716.014)] and waited.resumes == {"memory": 1}
    moved = simulate_notebooks(workload, parking(parked_claims=False), 2, per_node=1)
    assert moved.waits.tolist() == [0.0, 0.0, pytest.approx(28.6)] and moved.resumes == {"moved": 1}


def test_a_preempted_job_is_parked_in_place_and_keeps_its_progress():
    """2 GPUs on one node; 1-GPU batch jobs of 1000 s fill them from 0. A notebook asks for a whole GPU at
    60: a job is preempted at 60 + 120 + 30 = 210, parked in place (its 80 GB slice full, so its GPU is
    free at 210 + 8.01) and the cell starts then. The tick at 215 still finds the request waiting, but,
    as the service's plan, counts the parking job's share as freeing: the other job runs on. The
    preempted one resumes on its node when the notebook's lease ends, its 210 s kept."""
    cells = (Cell(0, 0, 60.0, 100.0),)
    sessions = (Session(0, 0, 0, 1, 1000, 60.0, 200.0, (0,)),)
    backlog = BatchSource(np.array([1000]), np.array([1]), np.array([1000.0]), load=1.0, users=1)
    result = simulate_notebooks(NotebookWorkload(cells, sessions, "hand-made"), parking(pressure_grace=120.0), 2,
                                per_node=2, backlog=backlog)
    assert result.preemptions == 1 and result.lost_gpu_hours == 0.0, "one job frees the one GPU asked"
    assert result.waits.tolist() == [pytest.approx(158.01)]
    assert result.resumes == {"memory": 1} and len(result.resume_waits) == 0  # a batch resume, not a person's



def test_a_cell_frozen_mid_way_waits_for_its_own_node():
    """Two nodes of one 80 GB GPU; 1-GPU batch jobs of 1000 s fill them from 0. A notebook asks for a
    whole GPU at 60: a job is preempted at 210 and parked in memory with its cell frozen, and the
    notebook's 1000 s cell runs on its GPU. The other job ends at 1000 and frees the other node, but
    a cell frozen mid-way may not move (the move's spill would interrupt it: the service's
    ``parked.resume_ask``), so the new backlog job takes that room and the preempted job resumes
    from memory on its own node when the notebook's lease ends."""
    cells = (Cell(0, 0, 60.0, 1000.0),)
    sessions = (Session(0, 0, 0, 1, 1000, 60.0, 200.0, (0,)),)
    backlog = BatchSource(np.array([1000]), np.array([1]), np.array([1000.0]), load=1.0, users=1)
    result = simulate_notebooks(NotebookWorkload(cells, sessions, "hand-made"), parking(pressure_grace=120.0), 2,
                                per_node=1, backlog=backlog)
    assert result.preemptions == 1 and result.lost_gpu_hours == 0.0
    assert result.resumes == {"memory": 1}, "never moved"
