"""A node pressure clears for a person's request is that request's while it waits: no other request,
nor a resume moving, is placed there (``priority.Plan.cleared_for_others``, ``queue.drain(cleared=)``,
``resume.place_elsewhere(avoid=)``, and the replay's ``_Replay.acquire``/``resume``).

Before, only batch was kept off it: in 48 replayed hours of the backlog (bench/backlog_churn.py) 42
people's requests and resumes were placed on a node cleared for someone else, whose request then had a
second or third node cleared (33 requests), and 304 of 1,413 preemptions were of jobs on a node cleared
for a request that was placed elsewhere.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from gpupool.hub_plugin.rules import eta, priority, queue, resume
from gpupool.hub_plugin.rules.placement_index import PlacementIndex
from gpupool.hub_plugin.rules.scheduler import Demand, GPUState, Placement

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
GiB = 1024**3


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def gpu(uuid: str, node: str, index: int = 0, taken: float = 0.0) -> GPUState:
    return GPUState(uuid, node, "A100", index, 80 * GiB, 80 * GiB, allocated_fraction=taken,
                    allocated_memory=int(taken * 80 * GiB))


def node(name: str, count: int = 2, taken: float = 0.0) -> list[GPUState]:
    return [gpu(f"{name}-{i}", name, i, taken) for i in range(count)]


def resume_ask(home: str = "n1", count: int = 2) -> resume.Resume:
    return resume.Resume(home, tuple(f"{home}-{i}" for i in range(count)), "A100", 1.0, count, 80 * GiB)


@pytest.mark.parametrize("cleared, lease_id, waiting, others", [
    ({"n2": "L-x"}, "L-y", {"L-x", "L-y"}, {"n2"}),
    ({"n2": "L-x"}, "L-x", {"L-x"}, set()),
    ({"n2": "L-x"}, "L-y", {"L-y"}, set()),  # L-x no longer waits: n2 is free for anyone
    ({"n2": "L-x", "n3": "L-z"}, None, {"L-x", "L-z"}, {"n2", "n3"}),
])
def test_cleared_for_others(cleared, lease_id, waiting, others):
    assert priority.Plan({}, {}, cleared).cleared_for_others(lease_id, waiting) == others


@pytest.mark.parametrize("gpus, avoid, where", [
    pytest.param(node("n1", taken=1.0) + node("n2"), {"n2"}, None, id="only the cleared node has room: it waits"),
    pytest.param(node("n1", taken=1.0) + node("n2") + node("n3"), {"n2"}, "n3", id="another node with room"),
    pytest.param(node("n1", taken=1.0) + node("n2"), set(), "n2", id="nothing cleared: it moves there"),
])
def test_a_resume_does_not_move_onto_a_node_cleared_for_another(gpus, avoid, where):
    decision = resume.place_elsewhere(resume_ask(), PlacementIndex(gpus), avoid)
    assert (decision.node if isinstance(decision, Placement) else None) == where


def placed(waiting, gpus, cleared, **more):
    return [(item.lease_id, decision.node) for item, decision in
            queue.drain(waiting, gpus, {}, T0, cleared=cleared, **more)]


def test_drain_keeps_a_cleared_node_for_its_request():
    """n2 was cleared for ann's 2-GPU request: bob's older 2-GPU request and carl's resume (which
    would move) are not placed there; ann's is, though it is behind bob's of the same shape."""
    gpus = node("n1", taken=1.0) + node("n2")
    waiting = [queue.Waiting("L-carl", "carl", Demand(1.0, 2), at(0), "interactive", resume_ask()),
               queue.Waiting("L-bob", "bob", Demand(1.0, 2), at(1), "interactive"),
               queue.Waiting("L-ann", "ann", Demand(1.0, 2), at(2), "interactive")]
    assert placed(waiting, gpus, {"n2": "L-ann"}, resume_moves=True) == [("L-ann", "n2")]
    # before: the resume moved onto it (it goes first), and ann's request had to have another node cleared
    assert placed(waiting, gpus, {}, resume_moves=True) == [("L-carl", "n2")]


def test_drain_places_others_elsewhere_and_anyone_once_its_request_is_placed():
    gpus = node("n1", taken=1.0) + node("n2") + node("n3")
    waiting = [queue.Waiting("L-bob", "bob", Demand(1.0, 2), at(1), "interactive"),
               queue.Waiting("L-ann", "ann", Demand(1.0, 2), at(2), "interactive")]
    assert sorted(placed(waiting, gpus, {"n2": "L-ann"})) == [("L-ann", "n2"), ("L-bob", "n3")]
    assert placed(waiting[:1], node("n1", taken=1.0) + node("n2"), {}) == [("L-bob", "n2")]


def test_batch_still_kept_off_a_cleared_node():
    gpus = node("n2")
    waiting = [queue.Waiting("L-job", "job", Demand(0.5), at(0), "batch"),
               queue.Waiting("L-ann", "ann", Demand(1.0, 2), at(2), "interactive")]
    assert placed(waiting, gpus, {"n2": "L-ann"}, held_nodes={"n2"}) == [("L-ann", "n2")]


# -- the replay (hub_plugin/simulate) keeps to the same rule ------------------------------------------

FAR = 10**6


def replay_of(sessions: int, nodes: int):
    """A replay of ``sessions`` notebooks asking two whole GPUs each, on ``nodes`` nodes of 2 GPUs."""
    from gpupool.hub_plugin.simulate import notebooks
    from gpupool.hub_plugin.simulate.policies import policies
    from gpupool.hub_plugin.simulate.pool import uniform_pool
    from gpupool.hub_plugin.simulate.workload import Cell, NotebookWorkload, Session

    cells = tuple(Cell(i, i, 0.0, 100.0) for i in range(sessions))
    people = tuple(Session(i, i, i, 2, 1000, 0.0, FAR, (i,)) for i in range(sessions))
    return notebooks._Replay(NotebookWorkload(cells, people, "hand-made"), policies()["gpupool"],
                             uniform_pool(2 * nodes, per_node=2), None, False)


def cleared_for_one(replay, node: str) -> None:
    """Session 1 waits, and the last plan cleared ``node`` for it."""
    replay.sessions[1].pending.append(1)
    replay.enqueue(1, 0.0, replay.queue_of(1))
    replay.sweep.plan = priority.Plan({}, {}, {node: "1"})


def test_the_replay_places_no_other_request_on_a_node_cleared_for_one():
    replay = replay_of(2, 2)
    assert replay.pool.place(1000, 2).node == "node-000"  # its first choice
    cleared_for_one(replay, "node-000")
    replay.sessions[0].pending.append(0)
    assert replay.acquire(0, 0.0) and replay.sessions[0].lease.placement.node == "node-001"
    assert replay.acquire(1, 0.0) and replay.sessions[1].lease.placement.node == "node-000"


def test_the_replay_moves_no_resume_onto_a_node_cleared_for_another():
    from gpupool.hub_plugin.simulate.parked import ParkedLease

    replay = replay_of(2, 3)
    home = replay.pool.place(1000, 2)
    assert home.node == "node-000" and replay.pool.place_off(1000, 2, {"node-000"}).node == "node-001"
    replay.pool.take(home)  # session 0's home is full: its resume moves (a spilled state)
    replay.parked.park(0, ParkedLease(home, 10**9, 0.0, tier="disk"))
    cleared_for_one(replay, "node-001")
    replay.sessions[0].pending.append(0)
    assert replay.acquire(0, 0.0) and replay.sessions[0].lease.placement.node == "node-002"  # not to node-001
    replay.release(0, 1.0, retry=False)
    replay.parked.park(0, ParkedLease(home, 10**9, 0.0, tier="disk"))
    replay.pool.take(replay.pool.place_off(1000, 2, {"node-000", "node-001"}))  # node-002 full now
    replay.sessions[0].pending.append(0)
    assert not replay.acquire(0, 1.0)  # the cleared node is the only room: it waits


# -- the ETA knows of it --------------------------------------------------------------------------------------------

#: Four GPUs on two nodes: n0's two free, n1's two held, G2 by an idle lease parked at 300 s.
ETA_ROOM = eta.Room((1.0, 1.0, 0.0, 0.0), ("n0", "n0", "n1", "n1"), ("G0", "G1", "G2", "G3"))
ETA_HELD = [priority.Held("L-h", "bob", 1.0, "interactive", False, False, T0, T0, at(300), gpu_ids=("G2",))]
ONE, TWO = (1.0, 1, "interactive"), (1.0, 2, "interactive")


@pytest.mark.parametrize("asks, ids, cleared, expected", [
    pytest.param([ONE], ["L-b"], {}, [0.0], id="nothing cleared: the free node now"),
    pytest.param([ONE], ["L-b"], {"n0": "L-a"}, [300.0], id="n0 is L-a's: L-b waits for n1"),
    pytest.param([ONE], [], {"n0": "L-a"}, [300.0], id="an ask not named is another's too"),
    pytest.param([TWO, ONE], ["L-a", "L-b"], {"n0": "L-a"}, [0.0, 300.0], id="L-a takes its node"),
    pytest.param([ONE, TWO], ["L-a", "L-b"], {"n0": "L-b"}, [300.0, 300.0], id="held for the one behind"),
    pytest.param([ONE, ONE], ["L-a", "L-b"], {"n0": "L-a"}, [0.0, 0.0], id="once placed, its node is open"),
    pytest.param([(*ONE, (0,))], ["L-r"], {"n0": "L-a"}, [0.0], id="a resume takes back its own room"),
    pytest.param([(*ONE, (2, 0))], ["L-r"], {"n0": "L-a"}, [300.0], id="a resume does not move there"),
])
def test_the_eta_places_no_other_request_on_a_node_cleared_for_one(asks, ids, cleared, expected):
    plan = priority.Plan({}, {}, cleared)
    assert eta.eta_seconds(asks, ETA_ROOM, ETA_HELD, {}, T0, plan=plan, ids=ids) == expected


def test_a_placement_off_every_node_says_where_the_gpus_are_not_that_the_pool_has_none():
    """A worker start failed on the only node (it was left out): not "the pool has no GPUs
    (no agent has registered a node)", which a person read after a slow Slurm start."""
    refusal = PlacementIndex(node("n1")).place_off(Demand(1.0, 1), {"n1"})
    assert refusal.message == "no GPU can take 1.00 now: no node but n1 has GPUs", refusal.message
    assert PlacementIndex([]).place_off(Demand(1.0, 1), {"n1"}).message.endswith("the pool has no GPUs (no agent "
                                                                                  "has registered a node)")
