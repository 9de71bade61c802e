"""Table tests of the cold move's pure rule (``c.PoolLeases.resume_moves``; docs/parking.md): a
parked lease whose own node has no room resumes on another node with room, on GPUs of the model it
had, chosen as the scheduler chooses (hub_plugin/rules/resume.py ``place_elsewhere``, queue.py
``drain``)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from gpupool.hub_plugin.rules import queue, resume
from gpupool.hub_plugin.rules.hosts import HostState
from gpupool.hub_plugin.rules.placement_index import PlacementIndex
from gpupool.hub_plugin.rules.scheduler import Demand, GPUState, Placement

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
GiB = 1024**3


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def gpu(uuid: str, node: str = "n1", index: int = 0, name: str = "A100", taken: float = 0.0, **more) -> GPUState:
    return GPUState(uuid, node, name, index, 80 * GiB, 80 * GiB, allocated_fraction=taken,
                    allocated_memory=int(taken * 80 * GiB), **more)


def ask(**more) -> resume.Resume:
    return resume.Resume(**{"node": "n1", "gpus": ("G0",), "model": "A100", "fraction": 0.5, "gpu_count": 1,
                            "memory": 40 * GiB, **more})


#: n1's own GPU taken by someone else: nothing fits the resume at home.
FULL_HOME = gpu("G0", taken=1.0)


@pytest.mark.parametrize("ask_, gpus, hosts, where", [
    pytest.param(ask(), [FULL_HOME, gpu("X0", node="n2")], None, ("n2", ("X0",)), id="another node with room"),
    pytest.param(ask(), [FULL_HOME, gpu("X0", node="n2"), gpu("Y0", node="n3", taken=0.5)], None,
                 ("n3", ("Y0",)), id="chosen as the scheduler chooses: the gap, not the idle GPU"),
    pytest.param(ask(), [FULL_HOME, gpu("X0", node="n2", name="H100")], None, None, id="never another model"),
    pytest.param(ask(model="A100"), [FULL_HOME, gpu("X0", node="n2", name="A100-80GB")], None, None,
                 id="the same model: a name that only contains it is another"),
    pytest.param(ask(), [FULL_HOME, gpu("G1", index=1)], None, None,
                 id="never its own node: room there is remap's (resume.place), not a move's"),
    pytest.param(ask(), [FULL_HOME, gpu("X0", node="n2", taken=0.75)], None, None, id="no room anywhere"),
    pytest.param(ask(), [FULL_HOME, gpu("X0", node="n2", node_up=False), gpu("Y0", node="n3")], None,
                 ("n3", ("Y0",)), id="not onto a lost node"),
    pytest.param(ask(env="torch"), [FULL_HOME, gpu("X0", node="n2", environments=("jax",)),
                                    gpu("Y0", node="n3", environments=("torch",))], None, ("n3", ("Y0",)),
                 id="only where its worker environment is"),
    pytest.param(ask(cpus=4.0, host_memory=32 * GiB), [FULL_HOME, gpu("X0", node="n2"), gpu("Y0", node="n3")],
                 {"n2": HostState("n2", 8.0, 64 * GiB, 1, 6.0, 0)}, ("n3", ("Y0",)), id="with host room for it"),
    pytest.param(ask(gpus=("G0", "G1"), gpu_count=2, fraction=1.0, memory=80 * GiB),
                 [FULL_HOME, gpu("G1", index=1), gpu("X0", node="n2"), gpu("X1", node="n2", index=1, taken=0.1),
                  gpu("Y0", node="n3"), gpu("Y1", node="n3", index=1)], None, ("n3", ("Y0", "Y1")),
                 id="whole GPUs: as many free on one node"),
    pytest.param(ask(movable=False), [FULL_HOME, gpu("X0", node="n2")], None, None,
                 id="never a cell frozen mid-way: the move's spill would interrupt it"),
])
def test_where_a_resume_refused_at_home_moves(ask_, gpus, hosts, where):
    index = PlacementIndex(gpus, hosts=hosts)
    states = {g.uuid: g for g in gpus}
    assert not isinstance(resume.place(ask_, states, index.node_gpus("n1"), None), Placement)
    decision = resume.place_elsewhere(ask_, index)
    if where is None:
        assert not isinstance(decision, Placement)
    else:
        assert isinstance(decision, Placement) and (decision.node, decision.gpus) == where
        assert (decision.fraction, decision.memory) == (ask_.fraction, ask_.memory)


def test_drain_moves_a_resume_only_where_moves_are_allowed():
    gpus = [FULL_HOME, gpu("X0", node="n2")]
    waiting = [queue.Waiting("L-resume", "bob", Demand(0.5), at(10), "interactive", ask())]
    assert queue.drain(waiting, gpus, {}, T0) == []  # c.PoolLeases.resume_moves = False: it waits for n1
    placed = queue.drain(waiting, gpus, {}, T0, resume_moves=True)
    assert [(item.lease_id, decision.node, decision.gpus) for item, decision in placed] == [("L-resume", "n2",
                                                                                             ("X0",))]


def test_drain_tries_its_own_node_first():
    gpus = [gpu("G0"), gpu("X0", node="n2", taken=0.5)]
    waiting = [queue.Waiting("L-resume", "bob", Demand(0.5), at(10), "interactive", ask())]
    placed = queue.drain(waiting, gpus, {}, T0, resume_moves=True)
    assert [(decision.node, decision.gpus) for _, decision in placed] == [("n1", ("G0",))]


def test_a_persons_resume_that_moved_does_not_hold_its_home_node_against_batch():
    """bob's resume of a whole GPU does not fit on n1 (half of G1 free, G0 taken): without moves it
    waits there and holds n1, so the batch request takes n2's free GPU; with moves it takes n2's GPU
    and n1 is free for the batch request's half GPU."""
    gpus = [gpu("G0", taken=1.0), gpu("G1", index=1, taken=0.5), gpu("X0", node="n2")]
    waiting = [queue.Waiting("L-person", "bob", Demand(1.0), at(0), "interactive",
                             ask(fraction=1.0, memory=80 * GiB)),
               queue.Waiting("L-job", "ann", Demand(0.5), at(1), "batch")]
    placed = queue.drain(waiting, gpus, {}, T0)
    assert [(item.lease_id, decision.node) for item, decision in placed] == [("L-job", "n2")]
    placed = queue.drain(waiting, gpus, {}, T0, resume_moves=True)
    assert [(item.lease_id, decision.node, decision.gpus) for item, decision in placed] == [
        ("L-person", "n2", ("X0",)), ("L-job", "n1", ("G1",))]


def test_a_persons_resume_that_fits_nowhere_still_holds_its_home_node():
    gpus = [gpu("G0", taken=1.0), gpu("G1", index=1, taken=0.5), gpu("X0", node="n2", taken=0.5)]
    waiting = [queue.Waiting("L-person", "bob", Demand(1.0), at(0), "interactive",
                             ask(fraction=1.0, memory=80 * GiB)),
               queue.Waiting("L-job", "ann", Demand(0.5), at(1), "batch")]
    placed = queue.drain(waiting, gpus, {}, T0, resume_moves=True)
    assert [(item.lease_id, decision.node) for item, decision in placed] == [("L-job", "n2")]
