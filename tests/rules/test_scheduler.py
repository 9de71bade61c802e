"""The pure decisions of the service, table-driven: placement (which GPU)
and reclaim (which lease, when). Literal states in, literal decisions out."""

from __future__ import annotations

import dataclasses

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

from gpu_states import A100, H100, gpu
from gpupool.hub_plugin.nodes import death_reason
from gpupool.hub_plugin.rules.reclaim import decide, lost_nodes
from gpupool.schema import LeaseState

from gpupool.hub_plugin.rules.scheduler import (
    FEW_ON_NODE, MODEL_MISMATCH, NO_ENVIRONMENT, NO_FRACTION, NO_MEMORY, NODE_LOST, UNHEALTHY, WHOLE_ONLY,
    Demand, GPUState, Placement, Refusal, place)
from gpupool.hub_plugin.rules.workload import DEFAULT_WORKLOAD, Shape, slice_delta, whole_delta, workload_of

GiB = 1024**3
PLACED = [
    pytest.param(Demand(0.5), [gpu("n1", 0), gpu("n1", 1)],
                 Placement("n1", ("GPU-n1-0",), 0.5, 40 * GiB), id="empty pool: first GPU by node, index"),
    pytest.param(Demand(0.5), [gpu("n1", 0, fraction=0.5), gpu("n1", 1)],
                 Placement("n1", ("GPU-n1-0",), 0.5, 40 * GiB), id="second 0.5 fills the same GPU"),
    pytest.param(Demand(0.5), [gpu("n1", 0, fraction=1.0), gpu("n1", 1)],
                 Placement("n1", ("GPU-n1-1",), 0.5, 40 * GiB), id="third 0.5 goes to the other GPU"),
    pytest.param(Demand(0.25), [gpu("n1", 0, fraction=0.25), gpu("n1", 1, fraction=0.5)],
                 Placement("n1", ("GPU-n1-0",), 0.25, 20 * GiB), id="fragmentation: keep a 0.5 gap for 0.5s"),
    pytest.param(Demand(0.25), [gpu("n1", 0, fraction=0.5), gpu("n1", 1, fraction=0.75)],
                 Placement("n1", ("GPU-n1-1",), 0.25, 20 * GiB), id="fragmentation: fill a gap exactly"),
    pytest.param(Demand(0.3), [gpu("n2", 0, fraction=0.5), gpu("n1", 1, fraction=0.5)],
                 Placement("n1", ("GPU-n1-1",), 0.3, int(0.3 * 80 * GiB)), id="tie: node name first"),
    pytest.param(Demand(0.7), [gpu("n1", 0, fraction=0.1 + 0.2)],
                 Placement("n1", ("GPU-n1-0",), 0.7, int(0.7 * 80 * GiB)), id="float sums use an epsilon"),
    pytest.param(Demand(0.25, memory=60 * GiB), [gpu("n1", 0, fraction=0.5), gpu("n1", 1)],
                 Placement("n1", ("GPU-n1-1",), 0.25, 60 * GiB), id="explicit memory must fit"),
    pytest.param(Demand(0.5, model="h100"), [gpu("n1", 0), gpu("n2", 0, name=H100)],
                 Placement("n2", ("GPU-n2-0",), 0.5, 40 * GiB), id="model: case-insensitive substring"),
    pytest.param(Demand(0.5), [gpu("n1", 0, up=False), gpu("n2", 0, healthy=False), gpu("n3", 0)],
                 Placement("n3", ("GPU-n3-0",), 0.5, 40 * GiB), id="lost node and unhealthy GPU skipped"),
    pytest.param(Demand(0.5), [gpu("n1", 0, degraded=True), gpu("n2", 0, fraction=0.5)],
                 Placement("n2", ("GPU-n2-0",), 0.5, 40 * GiB), id="a node that cannot read its GPUs is skipped"),
    pytest.param(Demand(1.0), [gpu("n1", 0, fraction=0.25), gpu("n1", 1)],
                 Placement("n1", ("GPU-n1-1",), 1.0, 80 * GiB), id="one whole GPU"),
    pytest.param(Demand(1.0, 2), [gpu("n1", 0), gpu("n1", 1), gpu("n1", 2), gpu("n2", 0), gpu("n2", 1)],
                 Placement("n2", ("GPU-n2-0", "GPU-n2-1"), 1.0, 80 * GiB), id="whole GPUs: fewest free node"),
    pytest.param(Demand(1.0, 2), [gpu("n1", 0, fraction=0.1), gpu("n1", 1), gpu("n1", 2), gpu("n2", 0)],
                 Placement("n1", ("GPU-n1-1", "GPU-n1-2"), 1.0, 80 * GiB), id="whole GPUs: only free ones"),
    pytest.param(Demand(1.0, 2), [gpu("n1", 0, usable=40 * GiB), gpu("n1", 1)],
                 Placement("n1", ("GPU-n1-0", "GPU-n1-1"), 1.0, 40 * GiB), id="whole GPUs: smallest usable"),
    pytest.param(Demand(0.5), [gpu("n1", 0, unattributed=50 * GiB), gpu("n1", 1, fraction=0.25)],
                 Placement("n1", ("GPU-n1-1",), 0.5, 40 * GiB), id="memory of no worker counts as taken"),
    pytest.param(Demand(0.5), [gpu("mig", 0, whole_only=True), gpu("n1", 0, fraction=0.25)],
                 Placement("n1", ("GPU-n1-0",), 0.5, 40 * GiB), id="slices skip whole-GPU-only nodes"),
    pytest.param(Demand(1.0), [gpu("mig", 0, whole_only=True, usable=10 * GiB)],
                 Placement("mig", ("GPU-mig-0",), 1.0, 10 * GiB), id="a whole MIG instance is a GPU"),
    pytest.param(Demand(0.5, env="torch"),
                 [gpu("big", 0), gpu("big", 1), gpu("t", 0, fraction=0.25, envs=("default", "torch"))],
                 Placement("t", ("GPU-t-0",), 0.5, 40 * GiB, "torch"), id="env: only a node offering it"),
    pytest.param(Demand(0.5, env="torch"), [gpu("a", 0, fraction=0.5, envs=("default",)), gpu("b", 0, envs=("torch",))],
                 Placement("b", ("GPU-b-0",), 0.5, 40 * GiB, "torch"), id="env: even on an idle GPU over a gap"),
    pytest.param(Demand(0.5), [gpu("a", 0, envs=("torch", "default"))],
                 Placement("a", ("GPU-a-0",), 0.5, 40 * GiB, "torch"), id="env: none asked, the node's default"),
    pytest.param(Demand(1.0, 2, env="torch"),
                 [gpu("a", 0), gpu("a", 1), gpu("b", 0, envs=("torch",)), gpu("b", 1, envs=("torch",)),
                  gpu("b", 2, envs=("torch",))],
                 Placement("b", ("GPU-b-0", "GPU-b-1"), 1.0, 80 * GiB, "torch"), id="env: whole GPUs too"),
]


@pytest.mark.parametrize("demand, gpus, expected", PLACED)
def test_place(demand, gpus, expected):
    assert place(demand, gpus) == expected


REFUSED = [
    pytest.param(Demand(0.5), [gpu("node-1", 0, fraction=0.75), gpu("node-1", 1, fraction=0.75)],
                 {NO_FRACTION: 2}, id="no free fraction"),
    pytest.param(Demand(0.5, model="H100"), [gpu("n1", 0), gpu("n1", 1, fraction=1.0)],
                 {MODEL_MISMATCH: 2}, id="model mismatch"),
    pytest.param(Demand(0.25, memory=50 * GiB), [gpu("n1", 0, fraction=0.5), gpu("n1", 1, fraction=0.5)],
                 {NO_MEMORY: 2}, id="not enough memory"),
    pytest.param(Demand(0.25), [gpu("n1", 0, fraction=0.25, memory=70 * GiB)],
                 {NO_MEMORY: 1}, id="share does not fit in what memory is left"),
    pytest.param(Demand(0.5), [gpu("n1", 0, up=False), gpu("n2", 0, healthy=False), gpu("n3", 0, fraction=1)],
                 {NODE_LOST: 1, UNHEALTHY: 1, NO_FRACTION: 1}, id="one reason per GPU"),
    pytest.param(Demand(1.0, 2), [gpu("n1", 0), gpu("n2", 0), gpu("n2", 1, fraction=0.5)],
                 {NO_FRACTION: 1, FEW_ON_NODE: 2}, id="whole GPUs spread over nodes"),
    pytest.param(Demand(1.0, 2, memory=100 * GiB), [gpu("n1", 0), gpu("n1", 1)],
                 {NO_MEMORY: 2}, id="whole GPUs too small"),
    pytest.param(Demand(0.25), [gpu("n1", 0, unattributed=70 * GiB)],
                 {NO_MEMORY: 1}, id="unattributed memory leaves too little"),
    pytest.param(Demand(0.5), [gpu("n1", 0, whole_only=True)], {WHOLE_ONLY: 1}, id="whole GPUs only"),
    pytest.param(Demand(0.5, env="torch"),
                 [gpu("a", 0, envs=("default",)), gpu("t", 0, fraction=0.75, envs=("torch",))],
                 {NO_ENVIRONMENT: 1, NO_FRACTION: 1}, id="env offered only where it is full"),
    pytest.param(Demand(1.0, 2, env="torch"), [gpu("a", 0), gpu("a", 1), gpu("t", 0, envs=("torch",))],
                 {NO_ENVIRONMENT: 2, FEW_ON_NODE: 1}, id="env: whole GPUs on a node without it"),
]


@pytest.mark.parametrize("demand, gpus, reasons", REFUSED)
def test_refuse(demand, gpus, reasons):
    refusal = place(demand, gpus)
    assert isinstance(refusal, Refusal)
    assert refusal.reasons == reasons
    for reason, count in reasons.items():
        assert f"{count} {'GPU' if count == 1 else 'GPUs'} ruled out: {reason.words}" in refusal.message


def test_refusal_message_says_what_is_free():
    refusal = place(Demand(0.5), [gpu("node-1", 0, fraction=1.0), gpu("node-1", 1, fraction=0.75)])
    assert refusal.message == ("no GPU can take 0.50 now: 2 GPUs in the pool, the most free is 0.25 "
                               f"(node-1 GPU 1, {A100}); 2 GPUs ruled out: not enough free fraction")


def test_refusal_message_names_memory_when_memory_was_short():
    refusal = place(Demand(0.25, memory=50 * GiB), [gpu("node-1", 0, fraction=0.5)])
    assert refusal.message == ("no GPU can take 0.25 with 50.0 GiB now: 1 GPU in the pool, the most free is "
                               f"0.50 and 40.0 GiB (node-1 GPU 0, {A100}); 1 GPU ruled out: not enough free memory")


def test_refusal_of_whole_gpus_and_empty_pool():
    assert place(Demand(1.0, 3), [gpu("n1", 0)]).message.startswith("no node has 3 whole GPUs free now: 1 GPU in")
    half_busy = place(Demand(1.0, 2), [gpu("n1", 0, fraction=0.5), gpu("n1", 1)])
    assert half_busy.message == ("no node has 2 whole GPUs free now: 2 GPUs in the pool, the most free is 1.00 "
                                 f"(n1 GPU 1, {A100}); 1 GPU ruled out: not enough free fraction; "
                                 "1 GPU ruled out: too few free GPUs on its node")
    empty = place(Demand(0.5), [])
    assert isinstance(empty, Refusal) and "the pool has no GPUs" in empty.message


def test_refusal_for_an_environment_names_it_and_what_is_free_there():
    refusal = place(Demand(0.5, env="torch"), [gpu("a", 0), gpu("t", 0, fraction=0.75, envs=("torch",))])
    assert refusal.message == ("no GPU can take 0.50 in environment torch now: 2 GPUs in the pool, the most free "
                               f"is 0.25 (t GPU 0, {A100}); 1 GPU ruled out: {NO_ENVIRONMENT.words}; "
                               "1 GPU ruled out: not enough free fraction")


ENVIRONMENTS = [  # (env, prefer_env, offered, the lease's environment or the error)
    pytest.param("torch", None, {"default", "torch"}, "torch", id="asked and offered"),
    pytest.param("torch", None, {"default"}, ValueError, id="asked, not offered: refused"),
    pytest.param("torch", "jax", {"jax"}, ValueError, id="what is asked beats what is preferred"),
    pytest.param(None, "torch", {"default", "torch"}, "torch", id="preferred and offered"),
    pytest.param(None, "torch", {"default"}, None, id="preferred, not offered: the node's default"),
    pytest.param(None, None, {"torch"}, None, id="neither: the node's default"),
]


@pytest.mark.parametrize("env, prefer, offered, expected", ENVIRONMENTS)
def test_lease_environment(env, prefer, offered, expected):
    from gpupool.hub_plugin.environments import lease_environment

    if expected is ValueError:
        with pytest.raises(ValueError):
            lease_environment(env, prefer, offered)
    else:
        assert lease_environment(env, prefer, offered) == expected


@pytest.mark.parametrize("kernel, env", [("torch", "torch"), ("gpupool-torch", "torch"), ("gpupool", "gpupool"),
                                         ("python3", "python3"), ("gpupool-", None), ("", None), (None, None),
                                         ("a b", None)])
def test_kernel_environment_is_the_kernel_name_without_gpupool_prefix(kernel, env):
    from gpupool.schema import kernel_environment

    assert kernel_environment(kernel) == env


def test_the_index_knows_which_environments_the_pool_offers():
    from gpupool.hub_plugin.rules.placement_index import PlacementIndex

    index = PlacementIndex([gpu("a", 0, envs=("default",)), gpu("t", 0, envs=("default", "torch"))])
    assert index.environments() == ["default", "torch"] and index.offers("torch") and not index.offers("jax")
    index.update(gpu("t", 0, envs=("default",)))  # its agent came back without torch
    assert index.environments() == ["default"] and not index.offers("torch")


def test_nothing_usable():
    refusal = place(Demand(0.5), [gpu("n1", 0, up=False)])
    assert "none is usable now" in refusal.message and refusal.reasons == {NODE_LOST: 1}


def test_packing_fills_gpus_exactly():
    """Eight 0.25 slices fill two GPUs; the ninth is refused."""
    gpus = [gpu("n1", 0), gpu("n1", 1)]
    for _ in range(8):
        placed = place(Demand(0.25), gpus)
        assert isinstance(placed, Placement)
        gpus = [g if g.uuid not in placed.gpus else GPUState(**{
            **g.__dict__, "allocated_fraction": g.allocated_fraction + 0.25,
            "allocated_memory": g.allocated_memory + placed.memory}) for g in gpus]
    assert [g.allocated_fraction for g in gpus] == [1.0, 1.0]
    assert isinstance(place(Demand(0.25), gpus), Refusal)


# -- fragmentation (Weng et al., ATC '23): worked examples of the measure and what it changes ----------------------

HALVES = (Shape(0.5, 1, 1.0),)
QUARTERS_AND_PAIRS = (Shape(0.25, 1, 0.5), Shape(1.0, 2, 0.5))


@pytest.mark.parametrize("free, whole_free, idle, fraction, workload, expected", [
    # A 0.25 on a GPU with 0.5 free leaves 0.25, which no 0.5 can use: +0.25 of fragment.
    (0.5, False, 0, 0.25, HALVES, 0.25),
    # Filling a 0.5 gap exactly removes nothing usable: no growth.
    (0.5, False, 0, 0.5, HALVES, 0.0),
    # A 0.25 on a 0.25 gap (a fragment for 0.5s already) removes that fragment.
    (0.25, False, 0, 0.25, HALVES, -0.25),
    # Breaking one of a node's two idle GPUs: the node no longer fits a pair, so all its free capacity
    # (0.75 + 1) becomes fragment for pairs: 0.5 x 1.75; the quarter shape loses nothing.
    (1.0, True, 2, 0.25, QUARTERS_AND_PAIRS, 0.5 * 1.75),
    # With three idle GPUs the node still fits a pair: only the new 0.75 partial is a pair fragment.
    (1.0, True, 3, 0.25, QUARTERS_AND_PAIRS, 0.5 * 0.75),
    # On a partly taken GPU the pair fragment only shrinks by the slice.
    (0.5, False, 3, 0.25, QUARTERS_AND_PAIRS, 0.5 * -0.25),
])
def test_slice_delta(free, whole_free, idle, fraction, workload, expected):
    assert slice_delta(free, whole_free, idle, fraction, workload) == pytest.approx(expected)


def test_whole_delta():
    pairs = (Shape(1.0, 2, 1.0),)
    assert whole_delta(idle=4, count=2, workload=pairs) == 0  # still fits a pair
    assert whole_delta(idle=3, count=2, workload=pairs) == 1  # the last idle GPU is a fragment now
    assert whole_delta(idle=1, count=1, workload=(Shape(1.0, 4, 1.0),)) == -1  # never fitted: less free
    assert whole_delta(idle=8, count=2, workload=(Shape(0.5, 1, 1.0),)) == 0  # slices do not care


def test_slices_go_where_they_keep_whole_gpus_for_pairs():
    """Best fit alone would break node n1's second idle GPU (a tie with n2's by free fraction, won by
    name); fragmentation-aware, the slice goes to n2, whose single idle GPU can host no pair anyway."""
    gpus = [gpu("n1", 0), gpu("n1", 1), gpu("n2", 0), gpu("n2", 1, fraction=1.0)]
    assert place(Demand(0.25), gpus, workload=()).gpus == ("GPU-n1-0",)
    assert place(Demand(0.25), gpus, workload=QUARTERS_AND_PAIRS).gpus == ("GPU-n2-0",)


def test_workload_of_counts_shapes():
    shapes = workload_of([Demand(0.25), Demand(0.25), Demand(0.5), Demand(1.0, 2)])
    assert shapes == (Shape(0.25, 1, 0.5), Shape(0.5, 1, 0.25), Shape(1.0, 2, 0.25))
    assert workload_of([]) == ()


# -- reclaim decisions: pure too, so time is moved by passing another ``now`` --------------------------------------

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def lease(worker_state: str = "idle", *, state: str = "active", idle_for: float = 0.0, silent_for: float = 0.0,
          idle_timeout: float = 1800.0, heartbeat_ttl: float = 60.0) -> SimpleNamespace:
    """An active lease as the reclaim rules see it, at T0."""
    return SimpleNamespace(id="L-000000000001", state=state, worker_state=worker_state,
                           idle_since=T0 - timedelta(seconds=idle_for) if worker_state == "idle" else None,
                           idle_timeout=idle_timeout, heartbeat_ttl=heartbeat_ttl, started_at=T0 - timedelta(hours=1),
                           last_heartbeat_at=T0 - timedelta(seconds=silent_for))


RECLAIM = [
    pytest.param(lease(idle_for=1799), [], id="idle just under the timeout"),
    pytest.param(lease(idle_for=1800), [(LeaseState.reclaimed, "idle for 30m (idle timeout 30m)")], id="idle"),
    pytest.param(lease("busy", idle_for=99999, silent_for=99999), [], id="a running cell is never reclaimed"),
    pytest.param(lease(silent_for=59), [], id="heartbeat just in time"),
    pytest.param(lease(silent_for=60), [(LeaseState.reclaimed, "the notebook kernel stopped sending heartbeats "
                                                                "for 1m (heartbeat TTL 1m)")], id="heartbeat lost"),
    pytest.param(lease("starting", silent_for=10), [], id="kernel still starting"),
    pytest.param(lease(state="starting", silent_for=999, idle_for=9999), [], id="only active leases"),
    pytest.param(lease(state="releasing", silent_for=999, idle_for=9999), [], id="already releasing"),
]


@pytest.mark.parametrize("row, expected", RECLAIM)
def test_reclaim_decisions(row, expected):
    assert [(d.state, d.reason) for d in decide([row], T0)] == expected


def test_moving_time_forward_reclaims():
    row = lease(idle_for=0, idle_timeout=600, heartbeat_ttl=3600)
    assert decide([row], T0 + timedelta(minutes=9)) == []
    assert [d.reason for d in decide([row], T0 + timedelta(minutes=10, seconds=30))] == [
        "idle for 10m 30s (idle timeout 10m)"]


def test_lost_nodes():
    nodes = [SimpleNamespace(name="a", state="up", last_heartbeat_at=T0 - timedelta(seconds=29)),
             SimpleNamespace(name="b", state="up", last_heartbeat_at=T0 - timedelta(seconds=30)),
             SimpleNamespace(name="c", state="lost", last_heartbeat_at=T0 - timedelta(hours=1))]
    assert lost_nodes(nodes, T0, node_ttl=30) == ["b"]


@pytest.mark.parametrize("code, reason", [
    (0, "the worker process exited with code 0"), (3, "the worker process exited with code 3"),
    (-9, "the worker process was killed by signal 9 (SIGKILL)"), (None, "the worker process died"),
])
def test_death_reasons(code, reason):
    assert death_reason(code) == reason


# -- the placement index gives place()'s answer ------------------------------------------------------------------

def random_pool(rng) -> list[GPUState]:
    """Nodes of 1-8 GPUs, two models, some lost/unhealthy/whole-only/foreign memory, float-noisy allocations."""
    gpus = []
    for n in range(rng.randint(1, 12)):
        node, up, whole_only, degraded = f"n{n:02d}", rng.random() > 0.1, rng.random() < 0.1, rng.random() < 0.05
        name = rng.choice([A100, H100])
        envs = rng.choice([(), ("default",), ("default",), ("default", "torch"), ("torch",)])
        for i in range(rng.randint(1, 8)):
            fraction = rng.choice([0.0, 0.0, 0.1 + 0.2, 0.25, 0.5, 0.7, 0.75, 1.0])
            gpus.append(gpu(node, i, name=name, fraction=fraction, up=up, healthy=rng.random() > 0.05,
                            unattributed=rng.choice([0, 0, 0, 30 * GiB]), whole_only=whole_only,
                            degraded=degraded, envs=envs))
    return gpus


def random_demand(rng) -> Demand:
    env = rng.choice([None, None, None, "torch", "default"])
    if rng.random() < 0.2:
        return Demand(1.0, rng.randint(2, 4), model=rng.choice([None, None, "h100"]), env=env)
    return Demand(rng.choice([0.1, 0.2, 0.25, 0.3, 0.5, 0.7, 1.0]), 1, model=rng.choice([None, None, None, "a100"]),
                  memory=rng.choice([None, None, None, 20 * GiB, 60 * GiB]), env=env)


def random_workload(rng):
    """A default, an empty (plain best fit) or a random mix of slice and whole-GPU shapes."""
    pick = rng.random()
    if pick < 0.3:
        return DEFAULT_WORKLOAD
    if pick < 0.4:
        return ()
    return workload_of(random_demand(rng) for _ in range(rng.randint(1, 12)))


def claim(state: GPUState, fraction: float) -> GPUState:
    """``state`` with parked leases claiming ``fraction`` of it (and that share of its memory)."""
    return dataclasses.replace(state, parked_fraction=fraction, parked_memory=state.share(fraction))


def test_new_leases_keep_off_the_room_parked_leases_claim_while_other_room_fits():
    """A parked lease's share stays claimed on its GPU: a slice goes where nothing is claimed even
    if best fit would pick the claimed GPU, and takes claimed room only when nothing else fits; the
    refusal counts what is really free, not what is claimed."""
    claimed_gpu, other = claim(gpu("n1", 0, fraction=0.25), 0.75), gpu("n2", 0, fraction=0.5)
    assert place(Demand(0.25), [claimed_gpu, other]).gpus == ("GPU-n2-0",)
    assert place(Demand(0.25), [claimed_gpu, gpu("n2", 0)]).gpus == ("GPU-n2-0",), "an idle GPU before claimed room"
    assert place(Demand(0.5), [claimed_gpu, gpu("n2", 0, fraction=0.75)]).gpus == ("GPU-n1-0",), \
        "claimed room once nothing else fits"
    refused = place(Demand(1.0), [claimed_gpu])
    assert isinstance(refused, Refusal) and "the most free is 0.75" in refused.message, refused
    # Whole GPUs: the node whose GPUs nobody claims first; a claimed one only when the ask needs it.
    nodes = [claim(gpu("n1", 0), 1.0), gpu("n1", 1), gpu("n2", 0), gpu("n2", 1)]
    assert place(Demand(1.0, 2), nodes).node == "n2"
    assert place(Demand(1.0, 2), nodes[:2]).gpus == ("GPU-n1-0", "GPU-n1-1")


def test_a_resume_counts_its_own_claim_as_its_room():
    """The resuming lease's own claim is its room; another parked lease's claim on its node's other
    GPU keeps a remapped resume off that one while an unclaimed GPU fits."""
    from gpupool.hub_plugin.rules import resume

    own = claim(gpu("n1", 0, fraction=0.5), 0.5)
    states = {g.uuid: g for g in (own, claim(gpu("n1", 1), 0.75), gpu("n1", 2))}
    ask = resume.Resume("n1", ("GPU-n1-0",), A100, 0.5, 1, 40 * GiB, remap=True)
    assert resume.place(ask, states, list(states), None).gpus == ("GPU-n1-0",)
    states["GPU-n1-0"] = claim(gpu("n1", 0, fraction=1.0), 0.5)  # its GPU taken meanwhile
    assert resume.place(ask, states, list(states), None).gpus == ("GPU-n1-2",)


def test_placement_index_gives_the_same_answer_under_churn():
    import dataclasses
    import random

    from gpupool.hub_plugin.rules.placement_index import PlacementIndex

    rng = random.Random(3)
    decisions = placed = 0
    for _ in range(60):
        gpus = random_pool(rng)
        index = PlacementIndex(gpus, random_workload(rng))
        held: list[Placement] = []
        for _ in range(60):
            if held and rng.random() < 0.35:  # a lease ends
                index.give(held.pop(rng.randrange(len(held))))
                continue
            if rng.random() < 0.03:  # a node's agent registers again, offering other environments
                node, envs = rng.choice(index.all()).node, frozenset(rng.choice([(), ("default",), ("torch",)]))
                for uuid in index.node_gpus(node):
                    index.update(dataclasses.replace(index.states[uuid], environments=envs))
            if rng.random() < 0.15:  # a lease parks off a GPU, or a parked one resumes or ends: its claim
                state = rng.choice(index.all())
                index.update(claim(state, rng.choice([0.0, 0.25, 0.5, 1.0])))
            demand = random_demand(rng)
            expected = place(demand, index.all(), index.workload)
            assert index.place(demand) == expected, demand
            assert isinstance(index.place(demand, explain=False), type(expected)), demand
            decisions += 1
            if isinstance(expected, Placement):
                placed += 1
                held.append(expected)
                index.take(expected)
    assert decisions > 1000 and placed > 300  # both outcomes were exercised


def test_the_rules_import_no_sql_web_or_zmq():
    """The pure rules (hub_plugin/rules/), imported in a fresh interpreter, pull in no SQL, web or ZMQ module."""
    import pkgutil
    import subprocess
    import sys

    import gpupool.hub_plugin.rules as rules

    names = [m.name for m in pkgutil.iter_modules(rules.__path__)]
    code = ("import sys\n" + "".join(f"import gpupool.hub_plugin.rules.{name}\n" for name in names)
            + "print(sorted(m for m in ('sqlalchemy', 'tornado', 'zmq', 'jupyter_client', 'socket', 'asyncio')"
            " if m in sys.modules))")
    assert len(names) >= 9
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
