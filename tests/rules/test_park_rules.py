"""Table tests of the pure rules of park in place (docs/parking.md): what the
sweep parks or ends, where a parked lease resumes (its own node only), its
place in the queue and its ETA, what a waiting resume presses on, and the
parked-memory quota (hub_plugin/rules/reclaim.py, pressure.py, resume.py,
queue.py, eta.py, priority.py, quotas.py)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

from gpupool.hub_plugin.rules import eta, priority, queue, quotas, resume
from gpupool.hub_plugin.rules import pressure as pressure_rules
from gpupool.hub_plugin.rules.hosts import HostState
from gpupool.hub_plugin.rules.reclaim import (MOVE_GRACE_S, ParkCode, Reclaim, agents_away, decide, lost_parked,
                                             outlived)
from gpupool.hub_plugin.rules.scheduler import Demand, GPUState, Placement, Refusal
from gpupool.schema import LeaseState
from gpupool.wire.quotas import Limits

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
GiB = 1024**3


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def lease(state: str = "active", worker: str = "idle", *, idle_for: float = 0.0, silent_for: float = 0.0,
          node: str = "n1", on_idle: str = "park", preemptible: bool = False) -> SimpleNamespace:
    """A lease as the reclaim rules read it, at T0 (idle timeout 30 min, heartbeat TTL 1 min)."""
    return SimpleNamespace(id="L-000000000001", state=state, worker_state=worker, node_name=node, on_idle=on_idle,
                           idle_since=at(-idle_for) if worker == "idle" else None, idle_timeout=1800.0,
                           heartbeat_ttl=60.0, started_at=at(-3600), last_heartbeat_at=at(-silent_for),
                           preemptible=preemptible)


IDLE = "idle for 30m (idle timeout 30m)"
SILENT = "the notebook kernel stopped sending heartbeats for 1m (heartbeat TTL 1m)"


@pytest.mark.parametrize("row, parkable, expected", [
    pytest.param(lease(idle_for=1800), {"n1"}, [(LeaseState.parked, IDLE, ParkCode.idle)], id="idle parks"),
    pytest.param(lease(idle_for=1799), {"n1"}, [], id="not yet"),
    pytest.param(lease(idle_for=1800, on_idle="release"), {"n1"}, [(LeaseState.reclaimed, IDLE, Reclaim.idle)],
                 id="on_idle release ends it"),
    pytest.param(lease(idle_for=1800), {"n2"}, [(LeaseState.reclaimed, IDLE, Reclaim.idle)],
                 id="its node cannot park: ends it as before"),
    pytest.param(lease(idle_for=1800), set(), [(LeaseState.reclaimed, IDLE, Reclaim.idle)], id="no node can park"),
    pytest.param(lease("busy", idle_for=9999, silent_for=9999), {"n1"}, [], id="a running cell is never touched"),
    pytest.param(lease(silent_for=60, idle_for=1800), {"n1"}, [(LeaseState.reclaimed, SILENT, Reclaim.heartbeat)],
                 id="its kernel died: released, not parked"),
    pytest.param(lease("parked", silent_for=60), {"n1"}, [(LeaseState.reclaimed, SILENT, Reclaim.heartbeat)],
                 id="parked, its kernel died: released"),
    pytest.param(lease("parked", "busy", silent_for=60), {"n1"}, [(LeaseState.reclaimed, SILENT, Reclaim.heartbeat)],
                 id="parked mid-cell, its kernel died: released too"),
    pytest.param(lease("parking", silent_for=60), {"n1"}, [(LeaseState.reclaimed, SILENT, Reclaim.heartbeat)],
                 id="parking, its kernel died"),
    pytest.param(lease("parked", silent_for=59, idle_for=99999), {"n1"}, [], id="parked, heartbeats coming: kept"),
])
def test_what_the_sweep_parks_or_ends(row, parkable, expected):
    assert [(d.state, d.reason, d.code) for d in decide([row], T0, parkable)] == expected


def test_the_simulator_call_without_parkable_nodes_reclaims_as_before():
    row = SimpleNamespace(id="L-1", state="active", worker_state="idle", idle_since=at(-1800), idle_timeout=1800.0,
                          heartbeat_ttl=60.0, started_at=at(-3600), last_heartbeat_at=T0)  # no node_name, no on_idle
    assert [d.state for d in decide([row], T0)] == [LeaseState.reclaimed]


def node(state: str = "lost", silent: float = 0.0, name: str = "n1", checkpointer: bool = True) -> SimpleNamespace:
    return SimpleNamespace(name=name, state=state, last_heartbeat_at=at(-silent),
                           checkpointer={"name": "simulated"} if checkpointer else None)


@pytest.mark.parametrize("row, expected", [
    pytest.param(lease(idle_for=1800), [], id="its agent away: the idle park waits for it"),
    pytest.param(lease(idle_for=1800, on_idle="release"), [(LeaseState.reclaimed, IDLE, Reclaim.idle)],
                 id="on_idle release ends it as before"),
    pytest.param(lease(silent_for=60, idle_for=1800), [(LeaseState.reclaimed, SILENT, Reclaim.heartbeat)],
                 id="its kernel died: released"),
])
def test_an_idle_lease_whose_agent_is_away_waits_for_it(row, expected):
    """An agent restarting (its refused connection marks the node lost at once) re-adopts its workers:
    an idle lease there is parked once it is back, not released with its variables."""
    away = agents_away([node("lost", 30 + 599), node("lost", 30 + 600, "n2"), node("up", 0, "n3"),
                        node("lost", 0, "n4", checkpointer=False)], T0, 30.0, 600.0)
    assert away == {"n1"}
    assert [(d.state, d.reason, d.code) for d in decide([row], T0, set(), away)] == expected
    assert [d.state for d in decide([row], T0, set(), set())][:1] == [LeaseState.reclaimed], "lost for good: ended"


@pytest.mark.parametrize("row, nodes, expected", [
    pytest.param(lease("parked"), {"n1": node("lost", 30 + 600)}, True, id="lost for ttl + grace"),
    pytest.param(lease("parked"), {"n1": node("lost", 30 + 599)}, False, id="may still come back"),
    pytest.param(lease("parked"), {"n1": node("up", 9999)}, False, id="not lost (yet)"),
    pytest.param(lease("active"), {"n1": node("lost", 9999)}, False, id="active leases are not parked ones"),
    pytest.param(lease("parked"), {}, False, id="its node unknown"),
])
def test_a_node_lost_while_parked_ends_its_parked_leases(row, nodes, expected):
    decisions = lost_parked([row], nodes, T0, 30.0, 600.0)
    assert bool(decisions) is expected
    if expected:
        [decision] = decisions
        assert decision.state is LeaseState.failed and decision.code is None
        assert decision.reason == ("node n1 was lost while lease L-000000000001 was parked (no heartbeat for 10m 30s): "
                                   "its worker and its variables there are gone")


def moved(old_state: str, new_state: str, ran: float) -> list[SimpleNamespace]:
    """A move's old lease L-old and the new L-new replacing it, started ``ran`` seconds before T0."""
    return [SimpleNamespace(id="L-old", state=old_state, replaces=None, started_at=at(-7200)),
            SimpleNamespace(id="L-new", state=new_state, replaces="L-old", started_at=at(-ran))]


@pytest.mark.parametrize("leases, released", [
    pytest.param(moved("active", "active", MOVE_GRACE_S), True, id="outlived: the old one goes"),
    pytest.param(moved("parked", "active", MOVE_GRACE_S + 1), True, id="a parked old one too"),
    pytest.param(moved("active", "active", MOVE_GRACE_S - 1), False, id="the move may still be running"),
    pytest.param(moved("released", "active", MOVE_GRACE_S), False, id="the move released it"),
    pytest.param(moved("active", "released", MOVE_GRACE_S), False, id="the move failed: the old one stays"),
])
def test_a_moves_old_lease_is_released_once_its_replacement_outlived_it(leases, released):
    decisions = outlived(leases, T0)
    assert [(d.lease_id, d.state, d.code) for d in decisions] == \
        ([("L-old", LeaseState.reclaimed, Reclaim.replaced)] if released else [])


# -- pressure: the early deadline parks, preemption freezes -------------------------------------------------------

def test_pressure_parks_at_the_early_deadline_and_freezes_a_preempted_cell():
    idle = replace_ns(lease(idle_for=600), id="L-idle")
    busy = replace_ns(lease(worker="busy", preemptible=True), id="L-busy")
    plan = priority.Plan({"L-idle": priority.EarlyPark(at(-1), "parked early: 1 person is waiting for a GPU", 120.0)},
                         {"L-busy": priority.Preemption(at(-1), "preempted: 1 person is waiting for a GPU")})
    [early] = pressure_rules.due(plan, [idle, busy], T0, {"n1"})
    assert (early.state, early.code, early.running_cell) == (LeaseState.parked, ParkCode.pressure, "refuse")
    assert [d.state for d in pressure_rules.due(plan, [idle], T0, set())] == [LeaseState.reclaimed]  # cannot park
    [frozen] = pressure_rules.preempts(plan, [idle, busy], T0, {"n1"})
    assert (frozen.lease_id, frozen.state, frozen.code, frozen.running_cell) == (
        "L-busy", LeaseState.parked, ParkCode.preemption, "freeze")
    assert pressure_rules.preempts(plan, [busy], T0, set()) == []  # its notebook interrupts it, as before
    assert pressure_rules.preempts(plan, [busy], at(-2), {"n1"}) == []  # not yet
    assert pressure_rules.still_preempted(plan, busy, T0)
    assert not pressure_rules.still_preempted(plan, replace_ns(busy, worker_state="idle"), T0)


def replace_ns(row: SimpleNamespace, **changes) -> SimpleNamespace:
    return SimpleNamespace(**{**vars(row), **changes})


def test_a_waiting_resume_presses_only_on_its_own_node():
    """A resume can only go back to its node: pressure takes idle leases there, never elsewhere."""
    def held(lease_id, node, idle):
        return priority.Held(lease_id, "ann", 1.0, "interactive", False, False, at(-9000), at(idle), at(idle + 7200),
                             node)

    leases = [held("L-far", "n2", -3000), held("L-here", "n1", -100)]  # the one elsewhere is idle the longest
    resume_ask = priority.Asking("L-parked", "bob", 1.0, "interactive", at(-50), 1, "n1")
    plan = priority.plan(leases, [resume_ask], priority.Rule(120), {})
    assert set(plan.parks) == {"L-here"}
    anywhere = priority.plan(leases, [replace(resume_ask, node=None)], priority.Rule(120), {})
    assert set(anywhere.parks) == {"L-far"}  # a new request presses on the longest idle


def test_what_a_park_or_release_under_way_frees_counts_before_another_lease_is_taken():
    """A sweep during a park's move (seconds) must not take a second lease for the same waiter: the share
    still held by the lease being parked counts as freeing, the resumes of its node first."""
    def held(lease_id, node, idle):
        return priority.Held(lease_id, "ann", 1.0, "interactive", False, False, at(-9000), at(idle), at(idle + 7200),
                             node)

    leases = [held("L-a", "n1", -3000), held("L-b", "n2", -2000)]
    new = priority.Asking("L-new", "bob", 1.0, "interactive", at(-50), 1)
    assert set(priority.plan(leases, [new], priority.Rule(120), {}).parks) == {"L-a"}, "without one freeing"
    assert priority.plan(leases, [new], priority.Rule(120), {}, freeing={"n2": 1.0}).parks == {}
    resume = priority.Asking("L-parked", "cid", 1.0, "interactive", at(-60), 1, "n1")
    three = leases + [held("L-c", "n1", -1000)]
    assert set(priority.plan(three, [new, resume], priority.Rule(120), {}).parks) == {"L-a", "L-c"}
    both = priority.plan(three, [new, resume], priority.Rule(120), {}, freeing={"n1": 1.0})
    assert set(both.parks) == {"L-a"}, "n1's freeing share is the resume's; the new request takes the longest idle"
    half = priority.plan(leases, [new], priority.Rule(120), {}, freeing={"n1": 0.5})
    assert set(half.parks) == {"L-a"}, "half a GPU freeing does not cover a whole one"


# -- where a parked lease resumes --------------------------------------------------------------------------------

def gpu(uuid: str, node: str = "n1", index: int = 0, name: str = "A100", taken: float = 0.0, memory: int = 0,
        **more) -> GPUState:
    return GPUState(uuid, node, name, index, 80 * GiB, 80 * GiB, allocated_fraction=taken, allocated_memory=memory,
                    **more)


def ask(**more) -> resume.Resume:
    return resume.Resume(**{"node": "n1", "gpus": ("G0",), "model": "A100", "fraction": 0.5, "gpu_count": 1,
                            "memory": 40 * GiB, **more})


def place(ask_: resume.Resume, gpus: list[GPUState], host: HostState | None = None):
    states = {g.uuid: g for g in gpus}
    return resume.place(ask_, states, [g.uuid for g in gpus if g.node == ask_.node], host)


@pytest.mark.parametrize("ask_, gpus, host, where", [
    pytest.param(ask(), [gpu("G0"), gpu("G1", index=1)], None, ("G0",), id="its own GPU first"),
    pytest.param(ask(), [gpu("G0", taken=0.75, memory=60 * GiB), gpu("G1", index=1)], None, None,
                 id="its GPU taken, no remap: it waits"),
    pytest.param(ask(remap=True), [gpu("G0", taken=0.75, memory=60 * GiB), gpu("G1", index=1)], None, ("G1",),
                 id="remap: another GPU of its model on its node"),
    pytest.param(ask(remap=True), [gpu("G0", taken=0.75), gpu("G1", index=1, name="H100")], None, None,
                 id="remap never to another model"),
    pytest.param(ask(remap=True), [gpu("G0", taken=0.75), gpu("X0", node="n2")], None, None,
                 id="never to another node"),
    pytest.param(ask(gpu_bytes_kept=2 * GiB), [gpu("G0", taken=0.5, memory=40 * GiB + 2 * GiB)], None, ("G0",),
                 id="the GPU memory it kept there is its own"),
    pytest.param(ask(), [gpu("G0", taken=0.5, memory=40 * GiB + 2 * GiB)], None, None,
                 id="someone else's kept memory is taken"),
    pytest.param(ask(cpus=4.0, host_memory=32 * GiB, parked_host_bytes=30 * GiB), [gpu("G0")],
                 HostState("n1", 8.0, 64 * GiB, 2, 4.0, 32 * GiB + 30 * GiB, 30 * GiB), ("G0",),
                 id="the host RAM its park holds comes back as it resumes"),
    pytest.param(ask(cpus=4.0, host_memory=32 * GiB), [gpu("G0")], HostState("n1", 8.0, 64 * GiB, 2, 4.0, 40 * GiB),
                 None, id="no host room for it"),
    pytest.param(ask(gpus=("G0", "G1"), gpu_count=2, fraction=1.0, memory=80 * GiB),
                 [gpu("G0"), gpu("G1", index=1)], None, ("G0", "G1"), id="whole GPUs"),
    pytest.param(ask(gpus=("G0", "G1"), gpu_count=2, fraction=1.0, memory=80 * GiB),
                 [gpu("G0"), gpu("G1", index=1, taken=0.1)], None, None, id="whole GPUs, one taken"),
    pytest.param(ask(), [gpu("G0", node_up=False)], None, None, id="its node lost: not placed"),
    pytest.param(ask(), [gpu("G1", index=1)], None, None, id="its GPU left the pool"),
])
def test_where_a_parked_lease_resumes(ask_, gpus, host, where):
    decision = place(ask_, gpus, host)
    if where is None:
        assert isinstance(decision, Refusal)
        assert decision.message
    else:
        assert isinstance(decision, Placement) and decision.gpus == where and decision.node == "n1"
        assert decision.fraction == ask_.fraction and decision.memory == ask_.memory


@pytest.mark.parametrize("demand, host, memory", [
    pytest.param(Demand(0.5), HostState("n1", 8.0, 64 * GiB, 1, 0.0, 0), 32 * GiB, id="the default share"),
    pytest.param(Demand(1.0), HostState("n1", 8.0, 64 * GiB, 1, 0.0, 3 * GiB, 3 * GiB), 61 * GiB,
                 id="a whole node's share gives way to what parked leases hold"),
    pytest.param(Demand(1.0), HostState("n1", 8.0, 64 * GiB, 1, 0.0, 40 * GiB, 3 * GiB), 64 * GiB,
                 id="not to what reservations hold: refused as before"),
    pytest.param(Demand(1.0), HostState("n1", 8.0, 4 * GiB, 1, 0.0, int(3.5 * GiB), int(3.5 * GiB)), 4 * GiB,
                 id="not below the floor: refused"),
    pytest.param(Demand(1.0, host_memory=64 * GiB), HostState("n1", 8.0, 64 * GiB, 1, 0.0, 3 * GiB, 3 * GiB),
                 64 * GiB, id="a named ask is what it names"),
])
def test_a_default_host_share_gives_way_to_parked_leases(demand, host, memory):
    from gpupool.hub_plugin.rules.hosts import host_ask, host_misfit

    assert host_ask(demand, host)[1] == memory
    assert (host_misfit(demand, host) is None) is (memory <= host.free_memory)


@pytest.mark.parametrize("tier, moved, disk, seconds", [
    ("memory", 0, 0, 0.3), ("memory", 10 * 10**9, 0, 1.3), ("disk", 0, 2 * 10**9, 5.0), (None, None, None, 0.3),
])
def test_resume_estimate(tier, moved, disk, seconds):
    assert resume.resume_seconds(tier, moved, disk) == seconds


# -- the queue: a resume goes ahead of its class's new requests, on its own node -------------------------------

def test_a_resume_waits_ahead_of_new_requests_of_its_class_only():
    resume_ask = ask()
    rows = [queue.Waiting("L-new", "ann", Demand(0.5), at(0)),  # asked long before the resume
            queue.Waiting("L-batch-resume", "cid", Demand(0.5), at(5), "batch", ask(gpus=("G1",))),
            queue.Waiting("L-resume", "bob", Demand(0.5), at(10), "interactive", resume_ask),
            queue.Waiting("L-batch", "dan", Demand(0.5), at(1), "batch")]
    assert [w.lease_id for w in queue.order(rows, {"bob": at(9)})] == ["L-resume", "L-new", "L-batch-resume",
                                                                        "L-batch"]
    places = queue.positions([(w.lease_id, w.owner, w.created_at, w.lease_class, w.resume is not None)
                              for w in rows], {"bob": at(9)})
    assert places == {"L-resume": 1, "L-new": 2, "L-batch-resume": 3, "L-batch": 4}


def test_a_preempted_leases_resume_waits_behind_the_requests_already_waiting():
    """Preempted for ann's waiting request, bob's interactive lease would take its room straight
    back if its resume went ahead of its class's new requests: it waits behind them, as a new
    request asked at its park (the service asks its resume then), ordered by last use as they are."""
    rows = [queue.Waiting("L-new", "ann", Demand(1.0), at(0)),
            queue.Waiting("L-preempted", "bob", Demand(1.0), at(10), "interactive", ask(preempted=True))]
    assert [w.lease_id for w in queue.order(rows, {"ann": None, "bob": at(9)})] == ["L-new", "L-preempted"]
    places = queue.positions([(w.lease_id, w.owner, w.created_at, w.lease_class, queue.goes_ahead(w.resume))
                              for w in rows], {"bob": at(9)})
    assert places == {"L-new": 1, "L-preempted": 2}
    gpus = [gpu("G0")]  # the room its preemption freed: the waiting request's
    placed = queue.drain(rows, gpus, {"bob": at(9)}, T0)
    assert [item.lease_id for item, _ in placed] == ["L-new"]


def test_drain_resumes_on_its_own_gpu_before_a_new_request_takes_it():
    gpus = [gpu("G0"), gpu("G1", index=1, taken=1.0, memory=80 * GiB), gpu("X0", node="n2", taken=1.0,
                                                                            memory=80 * GiB)]
    waiting = [queue.Waiting("L-new", "ann", Demand(1.0), at(0)),
               queue.Waiting("L-resume", "bob", Demand(0.5), at(10), "interactive", ask())]
    placed = queue.drain(waiting, gpus, {}, T0)
    assert [(item.lease_id, decision.gpus) for item, decision in placed] == [("L-resume", ("G0",))]


def test_drain_leaves_a_resume_waiting_when_its_node_has_no_room_whatever_is_free_elsewhere():
    gpus = [gpu("G0", taken=1.0, memory=80 * GiB), gpu("X0", node="n2")]
    waiting = [queue.Waiting("L-resume", "bob", Demand(0.5), at(10), "interactive", ask()),
               queue.Waiting("L-new", "ann", Demand(0.5), at(0))]
    placed = queue.drain(waiting, gpus, {}, T0)
    assert [(item.lease_id, decision.gpus) for item, decision in placed] == [("L-new", ("X0",))]


def test_drain_places_no_batch_on_the_node_a_persons_resume_waits_for():
    """n1 has half a GPU free: bob's resume of a whole GPU there does not fit, and the preempted job's own
    resume of half a GPU, which would fit, is not placed back there (it would be preempted again); a new
    batch request goes to n2, and a batch resume on n2 resumes."""
    gpus = [gpu("G0", taken=0.5, memory=40 * GiB), gpu("X0", node="n2", taken=0.5, memory=40 * GiB),
            gpu("X1", node="n2", index=1)]
    waiting = [queue.Waiting("L-person", "bob", Demand(1.0), at(0), "interactive", ask(fraction=1.0, memory=80 * GiB)),
               queue.Waiting("L-job", "ann", Demand(0.5), at(1), "batch", ask()),
               queue.Waiting("L-job2", "ann", Demand(0.5), at(2), "batch", ask(node="n2", gpus=("X0",))),
               queue.Waiting("L-new", "cy", Demand(1.0), at(3), "batch")]
    placed = queue.drain(waiting, gpus, {}, T0)
    assert [(item.lease_id, decision.node) for item, decision in placed] == [("L-job2", "n2"), ("L-new", "n2")]


def test_drain_places_no_batch_on_a_node_pressure_clears_for_a_person():
    gpus = [gpu("G0"), gpu("X0", node="n2")]
    waiting = [queue.Waiting("L-new", "cy", Demand(1.0), at(0), "batch")]
    placed = queue.drain(waiting, gpus, {}, T0, held_nodes={"n1"})
    assert [(item.lease_id, decision.node) for item, decision in placed] == [("L-new", "n2")]
    assert queue.drain(waiting, gpus[:1], {}, T0, held_nodes={"n1"}) == []  # only the held node: it waits


def test_the_eta_of_a_resume_waits_for_its_own_gpu():
    """GPU 1 is free, but the resume may take only GPU 0, which its holder frees at 300 s."""
    room = eta.Room((0.0, 1.0), ("n1", "n1"), ("G0", "G1"))
    holding = [priority.Held("L-1", "ann", 1.0, "interactive", False, False, at(-200), idle_since=at(-100),
                             idle_deadline=at(300), gpu_ids=("G0",))]
    assert eta.eta_seconds([(0.5, 1, "interactive", (0,))], room, holding, {}, T0) == [300.0]
    assert eta.eta_seconds([(0.5, 1, "interactive", (0, 1))], room, holding, {}, T0) == [0.0]  # remap: at once
    assert eta.eta_seconds([(0.5, 1, "interactive")], room, holding, {}, T0) == [0.0]  # a new request: anywhere


# -- the parked-memory quota -----------------------------------------------------------------------------------

@pytest.mark.parametrize("cap, held, estimate, tier", [
    (None, 100 * GiB, 50 * GiB, "memory"),
    (32 * GiB, 10 * GiB, 20 * GiB, "memory"),
    (32 * GiB, 10 * GiB, 23 * GiB, "disk"),
    (0, 0, 0, "memory"),  # nothing to hold
    (0, 0, 1, "disk"),
])
def test_a_park_beyond_max_parked_memory_goes_to_disk(cap, held, estimate, tier):
    got, words = quotas.park_tier(Limits(max_parked_memory=cap), held, estimate)
    assert got == tier
    assert (words is None) is (tier == "memory")
    if words:
        assert "max_parked_memory" in words and "parked to disk" in words


@pytest.mark.parametrize("value, read", [("32GiB", 32 * GiB), (1024, 1024), (0, 0), ("0", 0), (None, None)])
def test_max_parked_memory_reads_human_units(value, read):
    assert quotas.parse_entry({"max_parked_memory": value})["max_parked_memory"] == read


@pytest.mark.parametrize("value", ["lots", -1, True, "1.5h"])
def test_a_bad_max_parked_memory_is_refused_in_words(value):
    with pytest.raises(ValueError, match="max_parked_memory"):
        quotas.parse_entry({"max_parked_memory": value})
