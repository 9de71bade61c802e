"""Table tests of the pure scheduling rules: class order in the
queue, pressure parks, guaranteed vs over-quota share, preemption only with
opt-in, and the ETA (hub_plugin/rules/priority.py, hub_plugin/rules/eta.py, hub_plugin/rules/queue.py)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from gpupool.hub_plugin.rules import eta, pressure, priority, queue
from gpupool.hub_plugin.rules.priority import Asking, Held
from gpupool.hub_plugin.rules.scheduler import Demand

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def held(lease_id, owner="ann", gpus=1.0, cls="interactive", *, busy=False, idle=0.0, started=0.0,
         preemptible=False, timeout=1800.0):
    return Held(lease_id, owner, gpus, cls, preemptible, busy, at(started),
                None if busy else at(idle), None if busy else at(idle + timeout))


def asking(lease_id, owner="zoe", gpus=1.0, cls="interactive", created=100.0):
    return Asking(lease_id, owner, gpus, cls, at(created))


def plan(held_, asking_, *, guaranteed=None, allow=True):
    return priority.plan(held_, asking_, priority.Rule(120, 30, allow), guaranteed or {})


# -- class order ------------------------------------------------------------------------------

@pytest.mark.parametrize("rows, expected", [
    # (id, owner, class, created): interactive before batch, whatever the age or the owner's last use
    ([("b", "bob", "batch", 0), ("i", "ann", "interactive", 10)], ["i", "b"]),
    ([("i2", "ann", "interactive", 5), ("b", "bob", "batch", 0), ("i1", "cid", "interactive", 9)], ["i2", "i1", "b"]),
    ([("b2", "bob", "batch", 5), ("b1", "cid", "batch", 1)], ["b1", "b2"]),
])
def test_interactive_goes_first(rows, expected):
    waiting = [queue.Waiting(i, o, Demand(0.5), at(c), cls) for i, o, cls, c in rows]
    assert [w.lease_id for w in queue.order(waiting, {})] == expected
    assert queue.positions([(i, o, at(c), cls) for i, o, cls, c in rows], {}) == \
        {lease_id: place for place, lease_id in enumerate(expected, start=1)}


def test_newest_position_counts_every_interactive_request_before_a_batch_one():
    counts = {("ann", "interactive"): 2, ("bob", "batch"): 1, ("cid", "batch"): 1}
    last = {"ann": at(50), "bob": None, "cid": at(10)}
    assert queue.newest_position("cid", "batch", counts, last) == 4  # ann's 2, bob's 1 (never used), its own
    assert queue.newest_position("ann", "interactive", counts, last) == 2  # batch ones are behind


def test_drain_places_interactive_first_when_only_one_fits():
    from gpupool.hub_plugin.rules.scheduler import GPUState
    gpu = [GPUState("g0", "n0", "A100", 0, 80 * 2**30, 79 * 2**30)]
    waiting = [queue.Waiting("b", "bob", Demand(1.0), at(0), "batch"),
               queue.Waiting("i", "ann", Demand(1.0), at(60), "interactive")]
    assert [item.lease_id for item, _ in queue.drain(waiting, gpu, {}, at(70))] == ["i"]


@pytest.mark.parametrize("value", ["urgent", "", None, "BATCH"])
def test_unknown_class_is_refused_naming_the_classes(value):
    with pytest.raises(ValueError, match="interactive, batch"):
        priority.check_class(value)


# -- guaranteed vs over quota ---------------------------------------------------------------

@pytest.mark.parametrize("leases, share, inside", [
    ([("a", 0.5, 0), ("b", 0.5, 10), ("c", 0.5, 20)], 1.0, {"a", "b"}),   # oldest first, within 1 GPU
    ([("a", 2.0, 0), ("b", 0.5, 10)], 1.0, set()),                        # the oldest is too big: none
    ([("a", 0.5, 0)], 0.0, set()),                                        # no guarantee: all over quota
    ([("a", 0.5, 5), ("b", 0.5, 0)], 0.5, {"b"}),                         # by start, not by id
])
def test_guaranteed_share(leases, share, inside):
    rows = [held(i, gpus=g, started=s) for i, g, s in leases]
    assert priority.guaranteed(rows, {"ann": share}) == inside


# -- pressure parks ------------------------------------------------------------------------

def test_no_waiter_no_pressure():
    assert plan([held("a", idle=0)], []) == priority.NO_PRESSURE


def test_idle_lease_parked_after_grace_from_the_later_of_idle_and_asked():
    decided = plan([held("a", idle=0), held("b", owner="bob", idle=500)], [asking("q", created=100)])
    # a has been idle longest: it alone covers the 1 GPU asked, 120 s after the request came
    assert decided.parks == {"a": priority.EarlyPark(at(220), "parked early: 1 person is waiting for a GPU", 120)}
    both = plan([held("a", idle=0), held("b", owner="bob", idle=500)],
                [asking("q", created=100), asking("r", owner="yan", created=110)])
    assert both.parks["b"].deadline == at(620)  # idle after the request: grace from its own idle start
    assert both.parks["b"].reason == "parked early: 2 people are waiting for a GPU"


def test_batch_and_over_quota_first_guaranteed_never():
    leases = [held("int-old", idle=0), held("batch-new", owner="bob", cls="batch", idle=90),
              held("safe", owner="cid", idle=-100)]
    decided = plan(leases, [asking("q")], guaranteed={"cid": 1.0})
    assert set(decided.parks) == {"batch-new"}
    decided = plan(leases, [asking("q", gpus=2.0)], guaranteed={"cid": 1.0})
    assert set(decided.parks) == {"batch-new", "int-old"}  # never "safe", however much waits


def test_busy_leases_are_never_parked_and_not_preempted_without_opt_in():
    decided = plan([held("run", busy=True), held("batch-run", cls="batch", busy=True)], [asking("q", gpus=2.0)])
    assert decided == priority.Plan({}, {})


def test_a_batch_waiter_presses_only_on_batch_leases():
    decided = plan([held("int", idle=0), held("bat", owner="bob", cls="batch", idle=0)],
                   [asking("q", cls="batch", gpus=2.0)])
    assert set(decided.parks) == {"bat"}


def test_no_early_park_past_the_lease_own_deadline():
    decided = plan([held("short", idle=0, timeout=60)], [asking("q", created=0)])
    assert decided.parks == {}  # its idle timeout (60 s) comes before the grace (120 s)


# -- preemption ---------------------------------------------------------------------------

@pytest.mark.parametrize("opted, allowed, guaranteed, idle_covers, preempted", [
    (True, True, 0.0, False, {"run"}),
    (False, True, 0.0, False, set()),   # no opt-in: its running cell is never touched
    (True, False, 0.0, False, set()),   # the pool allows none
    (True, True, 1.0, False, set()),    # within its guaranteed share
    (True, True, 0.0, True, set()),     # an idle lease frees enough: no need
])
def test_preemption_only_with_opt_in(opted, allowed, guaranteed, idle_covers, preempted):
    leases = [held("run", busy=True, preemptible=opted, cls="batch")]
    if idle_covers:
        leases.append(held("idle", owner="bob", idle=0))
    decided = plan(leases, [asking("q", created=100)], guaranteed={"ann": guaranteed}, allow=allowed)
    assert set(decided.preemptions) == preempted
    if preempted:
        assert decided.preemptions["run"] == priority.Preemption(at(250), "preempted: 1 person is waiting for a GPU")


def test_preemption_takes_whole_nodes_first():
    """An 8-GPU ask: the batch leases of the node with the most preemptible batch GPUs go first
    (what is freed comes in whole nodes), not the newest on every node."""
    def job(lease_id, node, gpus, started):
        return Held(lease_id, "ann", gpus, "batch", True, True, at(started), node=node)
    leases = [job("a1", "a", 4.0, 0), job("a2", "a", 4.0, 10), job("b1", "b", 1.0, 50), job("b2", "b", 1.0, 60)]
    decided = plan(leases, [asking("q", gpus=8.0)])
    assert set(decided.preemptions) == {"a1", "a2"}


@pytest.mark.parametrize("batch_first, parked, preempted", [
    (False, {"idle"}, set()),   # today's order: the person's idle notebook is parked, the batch job runs on
    (True, set(), {"run"}),     # the preemptible batch job yields first
])
def test_batch_first_preempts_batch_before_parking_idle_notebooks(batch_first, parked, preempted):
    leases = [held("run", busy=True, preemptible=True, cls="batch"), held("idle", owner="bob", idle=0)]
    decided = priority.plan(leases, [asking("q")], priority.Rule(120, 30, True, batch_first=batch_first), {})
    assert (set(decided.parks), set(decided.preemptions)) == (parked, preempted)


@pytest.mark.parametrize("preemption_grace, due", [(None, 250), (0.0, 130)])
def test_preemption_grace_is_the_pressure_grace_unless_set(preemption_grace, due):
    decided = priority.plan([held("run", busy=True, preemptible=True, cls="batch")], [asking("q", created=100)],
                            priority.Rule(120, 30, True, preemption_grace=preemption_grace), {})
    assert decided.preemptions["run"].at == at(due)


@pytest.mark.parametrize("node_idle, idle_nodes, headroom, interactive_waiting, allowed", [
    (False, 0, 2, False, True),    # a busy node: headroom does not apply
    (True, 3, 2, False, True),     # an idle node beyond the headroom
    (True, 2, 2, False, False),    # the last idle nodes are kept for interactive asks
    (False, 5, 0, True, False),    # a person waits: batch does not backfill
])
def test_batch_may_start(node_idle, idle_nodes, headroom, interactive_waiting, allowed):
    assert priority.batch_may_start(node_idle, idle_nodes, headroom, interactive_waiting) is allowed


def on(lease_id, node, gpus, cls="batch", *, busy=True, owner="ann"):
    """A lease on ``node``: running and preemptible, or idle since 0."""
    return Held(lease_id, owner, gpus, cls, busy, busy, at(0), None if busy else at(0), None, node)


@pytest.mark.parametrize("leases, free, preempted, parked", [
    # GPUs spread over nodes do not make a node; of the nodes that can be cleared, the one that
    # stops the fewest running GPUs (b: 6 free + 2)
    ([on("a1", "a", 4.0), on("b1", "b", 2.0), on("c1", "c", 2.0)], {"a": 4.0, "b": 6.0}, {"b1"}, set()),
    # a node needing no person's notebook parked goes first, even at more running GPUs
    ([on("a1", "a", 1.0, "interactive", busy=False), on("b1", "b", 4.0), on("b2", "b", 4.0)], {"a": 7.0},
     {"b1", "b2"}, set()),
    # no node can be cleared now (a person's running cell, not preemptible): it presses on nothing, since
    # what it would free there cannot hold it (tests/rules/test_clearing.py)
    ([Held("p", "bob", 1.0, "interactive", False, True, at(0), node="a"), on("r", "a", 7.0)], {}, set(), set()),
])
def test_a_whole_gpu_ask_has_one_node_cleared(leases, free, preempted, parked):
    decided = priority.plan(leases, [Asking("q", "zoe", 8.0, "interactive", at(100), 8)],
                            priority.Rule(120, 5, True, preemption_grace=0.0), {}, free)
    assert (set(decided.preemptions), set(decided.parks)) == (preempted, parked)
    assert all(p.at == at(105) for p in decided.preemptions.values())
    assert set(decided.cleared.values()) <= {"q"} and bool(decided.cleared) is bool(free)
    assert decided.held_nodes({"q"}) == set(decided.cleared) and not decided.held_nodes(set())


def test_the_node_being_cleared_stays_the_one_cleared_while_its_leases_are_parked():
    """b's lease is on its way back (being parked; ``free_gpus`` counts its GPUs, ``clearing.whole_free``):
    b stays the node cleared for the ask, not a."""
    leases = [on("a1", "a", 2.0)]
    decided = priority.plan(leases, [Asking("q", "zoe", 8.0, "interactive", at(100), 8)],
                            priority.Rule(120, 5, True, preemption_grace=0.0), {}, {"a": 6.0, "b": 8.0}, {"b": 4.0})
    assert decided.cleared == {"b": "q"} and not decided.preemptions


def test_a_whole_gpu_resume_is_not_given_another_node_cleared():
    decided = priority.plan([on("a1", "a", 8.0)], [Asking("r", "zoe", 8.0, "interactive", at(100), 8, node="b")],
                            priority.Rule(120, 5, True, preemption_grace=0.0), {}, {"a": 0.0})
    assert not decided.cleared and not decided.preemptions  # it presses on its own node b only


def test_preemptible_refused_where_the_pool_allows_none():
    assert priority.preemption_refusal(True, True) is None
    assert priority.preemption_refusal(False, False) is None
    assert "c.PoolPressure.allow_preemption = False" in priority.preemption_refusal(True, False)


# -- ETA -----------------------------------------------------------------------------------

def holding(fraction=1.0, gpus=(0,), cls="interactive", *, busy=True, started=0.0, idle=None, deadline=None,
            timeout=0.0, pressable=True, preempt=None):
    """``(active lease, pressable, preempted at)``: a lease on GPUs ``gpus`` (indexes of test_eta's room),
    whether it is outside a guaranteed share, and when the plan preempts it (None: never)."""
    lease = Held(f"L-{next(_IDS)}", "ann", fraction * len(gpus), cls, preempt is not None, busy, at(started),
                 None if idle is None else at(idle), None if deadline is None else at(deadline),
                 gpu_ids=tuple(f"G{g}" for g in gpus), cell_started=at(started) if busy else None,
                 idle_timeout=timeout)
    return lease, pressable, None if preempt is None else at(preempt)


_IDS = itertools.count()
NOW = at(1000)
TAKEN = (0.0, 0.0, 0.0, 0.0)  # four GPUs on two nodes (n0: 0, 1; n1: 2, 3), all taken
I, B = "interactive", "batch"
IDLE_NOTEBOOK = holding(busy=False, idle=900, deadline=2700, timeout=1800.0)  # idle since 900, 30 min timeout


@pytest.mark.parametrize("asks, free, leases, typical, grace, expected", [
    # one idle lease parked at 1200 (its deadline, or the plan's): the first waiter then
    ([(1.0, 1, I)], TAKEN, [holding(busy=False, deadline=1200)], {}, None, [200.0]),
    # a batch run started at 0 that typically takes 3000 s, and an idle one due at 1500: in queue order
    ([(1.0, 1, I), (1.0, 1, I)], TAKEN, [holding(cls=B, started=0), holding(gpus=(1,), busy=False, deadline=1500)],
     {B: 3000.0}, None, [500.0, 2000.0]),
    # two halves of one GPU free it: the 1-GPU waiter needs both
    ([(1.0, 1, I)], TAKEN, [holding(0.5, busy=False, deadline=1100), holding(0.5, busy=False, deadline=1300)], {},
     None, [300.0]),
    # nothing known of interactive cells: no guess
    ([(1.0, 1, I)], TAKEN, [holding(started=0)], {}, None, [None]),
    # its cell ran past the typical length: now + half of it
    ([(1.0, 1, I)], TAKEN, [holding(started=0)], {I: 600.0}, None, [300.0]),
    # a running cell's end, then its idle timeout; pressed, the grace if shorter; no timeout and unpressed: never
    ([(1.0, 1, I)], TAKEN, [holding(started=900, timeout=1800.0)], {I: 200.0}, None, [1900.0]),
    ([(1.0, 1, I)], TAKEN, [holding(started=900, timeout=1800.0)], {I: 200.0}, 120.0, [220.0]),
    ([(1.0, 1, I)], TAKEN, [holding(started=900, timeout=None)], {I: 200.0}, None, [None]),
    # an idle notebook: a person waiting presses on it (the grace from the ask), a batch waiter does not
    # (its own 30 min), nor on one within a guaranteed share; a batch waiter presses on an idle batch lease
    ([(1.0, 1, I)], TAKEN, [IDLE_NOTEBOOK], {}, 120.0, [120.0]),
    ([(1.0, 1, B)], TAKEN, [IDLE_NOTEBOOK], {}, 120.0, [1700.0]),
    ([(1.0, 1, I)], TAKEN, [holding(busy=False, idle=900, deadline=2700, timeout=1800.0, pressable=False)], {},
     120.0, [1700.0]),
    ([(1.0, 1, B)], TAKEN, [holding(cls=B, busy=False, idle=900, deadline=2700, timeout=1800.0)], {}, 120.0,
     [120.0]),
    # a person and a job wait: the person takes the notebook's GPU, the job the idle batch lease's
    ([(1.0, 1, I), (1.0, 1, B)], TAKEN, [IDLE_NOTEBOOK, holding(gpus=(1,), cls=B, busy=False, idle=950,
                                                                deadline=2750, timeout=1800.0)], {}, 120.0,
     [120.0, 120.0]),
    # a deadline already past (the sweep is about to act): 0; two halves fit on the one GPU it frees
    ([(0.5, 1, I), (0.5, 1, I), (1.0, 1, I)], TAKEN, [holding(busy=False, deadline=900)], {}, None, [0.0, 0.0, None]),
    # room now
    ([(0.5, 1, I)], (0.5, 0.0, 0.0, 0.0), [], {}, None, [0.0]),
    # the one ahead takes the first half that frees; this one the next GPU
    ([(0.5, 1, I), (0.5, 1, I)], TAKEN, [holding(0.5, (1,), busy=False, deadline=1030),
                                         holding(1.0, (3,), busy=False, deadline=1300)], {}, None, [30.0, 300.0]),
    # two whole GPUs on one node: GPU 3 frees beside the idle GPU 2 before GPU 1 beside GPU 0
    ([(1.0, 2, I)], (1.0, 0.0, 1.0, 0.0), [holding(gpus=(1,), busy=False, deadline=1150),
                                           holding(gpus=(3,), busy=False, deadline=1120)], {}, None, [120.0]),
    # a running preemptible batch cell the plan preempts at 1122: parked mid-cell then, whatever its length
    ([(1.0, 1, I)], TAKEN, [holding(cls=B, started=0, preempt=1122)], {B: 3000.0}, 120.0, [122.0]),
    ([(1.0, 1, I)], TAKEN, [holding(cls=B, started=0, preempt=1122)], {}, 120.0, [122.0]),
    # never, from what is known: no node gets two whole GPUs
    ([(1.0, 2, I)], TAKEN, [holding(gpus=(1,), busy=False, deadline=1150)], {}, None, [None]),
])
def test_eta(asks, free, leases, typical, grace, expected):
    room = eta.Room(free, ("n0", "n0", "n1", "n1"), ("G0", "G1", "G2", "G3"))
    plan = priority.Plan({}, {lease.lease_id: priority.Preemption(when, "preempted")
                              for lease, _, when in leases if when is not None})
    safe = {lease.lease_id for lease, pressable, _ in leases if not pressable}
    assert eta.eta_seconds(asks, room, [lease for lease, _, _ in leases], typical, NOW, grace, plan, safe) == expected


def test_typical_lengths_by_class():
    assert eta.typical_lengths([("batch", 10.0), ("batch", 30.0), ("batch", 20.0), ("interactive", 5.0)]) == \
        {"batch": 20.0, "interactive": 5.0}


@pytest.mark.parametrize("groups, expected", [
    ({"group:a": {"guaranteed_gpus": None}, "group:b": {"guaranteed_gpus": 1.0}}, 1.0),  # None is nothing here
    ({"group:a": {"guaranteed_gpus": 0.5}, "group:b": {"guaranteed_gpus": 2.0}}, 2.0),
    ({}, None),
])
def test_the_most_generous_guarantee_is_the_largest(groups, expected):
    from gpupool.hub_plugin.rules.quotas import parse_table, resolve
    assert resolve("ann", ("a", "b"), parse_table(groups)).guaranteed_gpus == expected


# -- the notebook's side: class, park and preemption timing (magics) ---------------------

@pytest.mark.parametrize("batch, environ, expected", [
    (False, {}, "interactive"),
    (True, {}, "batch"),
    (False, {"GPUPOOL_LEASE_CLASS": "batch"}, "batch"),           # a kernelspec's env, or papermill's run
    (True, {"GPUPOOL_LEASE_CLASS": "interactive"}, "batch"),      # the flag wins
])
def test_requested_class(batch, environ, expected):
    from gpupool.magics.classes import requested_class
    assert requested_class(batch, environ) == expected


def test_an_unknown_class_in_the_environment_is_refused_naming_the_variable():
    from gpupool.magics.classes import requested_class
    with pytest.raises(ValueError, match="GPUPOOL_LEASE_CLASS='urgent' is not a lease class; use one of interactive"):
        requested_class(False, {"GPUPOOL_LEASE_CLASS": "urgent"})


def client_lease(idle_for=None, deadline_in=None, preempt_in=None, pressure=None):
    from gpupool.schema import LeaseState, isoformat
    from gpupool.wire.leases import Lease
    def moment(seconds):  # from T0 + 1000 s, "now" in these tests
        return None if seconds is None else isoformat(at(1000 + seconds))

    return Lease(id="L-1", owner="ann", state=LeaseState.active, fraction=1.0, gpu_count=1, memory=1,
                 idle_timeout=1800.0, idle_since=moment(None if idle_for is None else -idle_for),
                 idle_deadline=moment(deadline_in), preempt_at=moment(preempt_in), pressure=pressure)


@pytest.mark.parametrize("running, service_says, shown", [
    (None, "busy", "idle"),    # the cell ended here; the service hears of it at the agent's next heartbeat
    ({"msg_id": "c"}, "busy", "busy"),  # %gpu status inside a forwarded cell: the worker runs it
    ({"msg_id": "c"}, "idle", "busy"),  # ... which the service hears of at the agent's next heartbeat
    (None, "idle", "idle"),
])
def test_status_shows_the_worker_as_this_kernel_knows_it(running, service_says, shown):
    from types import SimpleNamespace

    from gpupool.magics.status import as_seen_here
    from gpupool.schema import parse_time
    from gpupool.tables import idle_countdown

    ended = at(990).timestamp()
    cell = SimpleNamespace(running=running, ended_at=ended)
    lease = replace(client_lease(idle_for=10, deadline_in=1790), worker={"pid": 1, "execution_state": service_says,
                                                                         "memory_used": 0})
    seen = as_seen_here(cell, lease)
    assert seen.worker["execution_state"] == shown
    if shown == "idle" and service_says == "busy":
        assert parse_time(seen.idle_since) == at(990)
        assert idle_countdown(seen, at(1000)) == "29m 50s"  # counted from the cell's end
    if shown == "busy" and service_says == "idle":
        assert seen.idle_since is None and seen.idle_deadline is None  # no countdown while it runs


def test_the_warning_under_pressure_counts_to_the_early_deadline_and_says_why():
    from gpupool.magics.heartbeat import idle_warning_text
    early = replace(client_lease(idle_for=100, deadline_in=20, pressure="parked early: 2 people are waiting for a GPU"),
                    idle_warning=60.0)
    text = idle_warning_text(early, interval=1.0, now=at(1000))
    assert text.startswith("lease ") and "it will be parked within 20s" in text
    assert "(parked early: 2 people are waiting for a GPU)" in text


def test_status_shows_why_the_countdown_is_short():
    from gpupool.tables import idle_countdown
    lease = client_lease(idle_for=100, deadline_in=20, pressure="parked early: 1 person is waiting for a GPU")
    assert idle_countdown(lease, now=at(1000)) == "20s (parked early: 1 person is waiting for a GPU)"


PREEMPTED = "preempted: 1 person is waiting for a GPU"


@pytest.mark.parametrize("freezes, preempt_in, words", [
    # A node that freezes a running cell parks it where it is: nothing is interrupted.
    (True, 8, f"busy; {PREEMPTED}: parked (frozen where it is) in 8s"),
    (True, -4, f"busy; {PREEMPTED}: parked (frozen where it is) now"),  # due; the sweep acts within its interval
    (False, 8, f"busy; {PREEMPTED}: interrupted in 8s"),
    (None, 8, f"busy; {PREEMPTED}: parked in 8s (frozen where it is, or interrupted where its node cannot freeze "
              "a running cell)"),
])
def test_status_says_what_a_preemption_does_to_the_running_cell(freezes, preempt_in, words):
    from gpupool.tables import idle_countdown, lease_cells
    lease = replace(client_lease(preempt_in=preempt_in, pressure=PREEMPTED), node="node-1",
                    worker={"pid": 1, "execution_state": "busy", "memory_used": 0})
    assert idle_countdown(lease, now=at(1000), freezes=freezes) == words
    if freezes is not None:  # gpupool status: GET /pool's freezes_running_cell, by the lease's node (due by now)
        assert lease_cells(lease, {}, {"node-1": freezes})[-1] == idle_countdown(lease, freezes=freezes)
        assert lease_cells(lease, {}, {"node-2": freezes})[-1] == idle_countdown(lease, freezes=None)


def plan_preempting(lease_id: str) -> priority.Plan:
    return priority.Plan({}, {lease_id: priority.Preemption(at(1008), PREEMPTED)})


@pytest.mark.parametrize("state, worker_state, held_since, shown", [
    ("active", "busy", at(500), True),      # running, held since before the plan: to come
    ("active", "idle", at(500), False),     # idle: parked by its early deadline instead
    ("parking", "busy", at(500), False),    # it has come
    ("parked", "busy", None, False),
    ("active", "busy", at(1002), False),    # parked and resumed after the plan was made: not the lease it preempted
    ("active", "busy", at(1000), True),     # resumed as the plan was made: the plan saw it
])
def test_the_lease_json_shows_a_preemption_only_while_it_is_to_come(state, worker_state, held_since, shown):
    from types import SimpleNamespace
    lease = SimpleNamespace(id="L-1", state=state, worker_state=worker_state, held_since=held_since)
    plan = plan_preempting("L-1")
    assert (pressure.coming_preemption(plan, at(1000), lease) is not None) == shown
    assert pressure.coming_preemption(plan_preempting("L-2"), at(1000), lease) is None


# -- the plan's settings, as the service and the simulator build them --------------------------

def test_the_rule_of_the_service_settings_is_todays_plan_by_default():
    from gpupool.hub_plugin.config import PoolPressure

    assert priority.Rule.of(PoolPressure()) == priority.Rule(120.0, 30.0, True, None, False, True)
    assert priority.Rule.of(PoolPressure(preemption_grace=0, batch_first=True, pressure_clears_nodes=False)) == \
        priority.Rule(120.0, 30.0, True, 0, True, False)


@pytest.mark.parametrize("clear_nodes, ask, wanted", [
    (False, Asking("q", "zoe", 8.0, "interactive", at(100), 8), False),  # not clearing: free GPUs not read
    (True, Asking("q", "zoe", 8.0, "interactive", at(100), 8), True),
    (True, Asking("q", "zoe", 1.0, "interactive", at(100), 1), False),  # one GPU: counted in GPUs
    (True, Asking("q", "zoe", 8.0, "batch", at(100), 8), False),        # a batch waiter clears no node
])
def test_free_gpus_are_read_only_where_a_node_is_cleared(clear_nodes, ask, wanted):
    assert priority.Rule(120.0, clear_nodes=clear_nodes).wants_free_gpus([ask]) is wanted


@pytest.mark.parametrize("clear_nodes, preempted", [(False, {"a1", "b1"}), (True, {"b1"})])
def test_the_rule_clears_a_node_only_where_set(clear_nodes, preempted):
    """Counted in GPUs the plan stops work on two nodes; cleared, only on the one that then fits."""
    leases = [on("a1", "a", 4.0), on("b1", "b", 2.0)]
    rule = priority.Rule(120.0, 5.0, True, 0.0, clear_nodes=clear_nodes)
    decided = rule.plan(leases, [Asking("q", "zoe", 6.0, "interactive", at(100), 6)], {}, {"a": 4.0, "b": 4.0})
    assert set(decided.preemptions) == preempted


def test_acting_is_what_is_due_and_the_next_moment():
    decided = priority.Plan({"p1": priority.EarlyPark(at(10), "r"), "p2": priority.EarlyPark(at(30), "r")},
                            {"x": priority.Preemption(at(20), "r")})
    assert priority.acting(decided, at(10)) == ({"p1"}, set(), at(20))
    assert priority.acting(decided, at(25)) == ({"p1"}, {"x"}, at(30))
    assert priority.acting(decided, at(30)) == ({"p1", "p2"}, {"x"}, None)


def test_whole_free_counts_wholly_free_gpus_of_usable_nodes():
    from gpupool.hub_plugin.rules.clearing import whole_free
    from gpupool.hub_plugin.rules.scheduler import GPUState

    def gpu(node, index, taken=0.0, **state):
        return GPUState(f"{node}{index}", node, "A100", index, 80 * 2**30, 79 * 2**30, taken,
                        int(taken * 79 * 2**30), **state)
    gpus = [gpu("a", 0), gpu("a", 1, 0.5), gpu("a", 2, healthy=False), gpu("b", 0, 1.0),
            gpu("c", 0, node_up=False), gpu("d", 0, node_degraded=True), gpu("e", 0), gpu("e", 1)]
    assert whole_free(gpus) == {"a": 1.0, "e": 2.0}


def _gpus(*nodes):
    """GPU states: ``(node, [allocated fraction per GPU])`` each."""
    from gpupool.hub_plugin.rules.scheduler import GPUState
    return [GPUState(f"{node}-{i}", node, "A100", i, 80 * 2**30, 79 * 2**30, taken, int(taken * 79 * 2**30))
            for node, fractions in nodes for i, taken in enumerate(fractions)]


@pytest.mark.parametrize("yields, headroom, placed", [
    (False, 0, ["b"]),  # batch backfills the GPU the 2-GPU ask cannot use
    (True, 0, []),      # a person waits: batch yields
    (False, 1, ["b"]),  # a partly taken node: headroom does not apply
])
def test_drain_lets_batch_start_only_where_batch_may_start(yields, headroom, placed):
    waiting = [queue.Waiting("i", "ann", Demand(1.0, 2), at(0), "interactive"),
               queue.Waiting("b", "bob", Demand(1.0), at(10), "batch")]
    decided = queue.drain(waiting, _gpus(("n0", [1.0, 0.0])), {}, at(20), batch_yields=yields, headroom_nodes=headroom)
    assert [item.lease_id for item, _ in decided] == placed


@pytest.mark.parametrize("headroom, placed", [(0, ["b1", "b2"]), (1, ["b1"]), (2, [])])
def test_drain_keeps_headroom_nodes_idle_for_batch(headroom, placed):
    """Two idle nodes of one GPU: with headroom 1 the first batch job may take one, not the last."""
    waiting = [queue.Waiting("b1", "bob", Demand(1.0), at(0), "batch"),
               queue.Waiting("b2", "cid", Demand(1.0), at(5), "batch")]
    decided = queue.drain(waiting, _gpus(("n0", [0.0]), ("n1", [0.0])), {}, at(20), headroom_nodes=headroom)
    assert [item.lease_id for item, _ in decided] == placed


def test_placement_index_idle_nodes():
    from gpupool.hub_plugin.rules.placement_index import PlacementIndex
    index = PlacementIndex(_gpus(("a", [0.0, 0.0]), ("b", [0.5, 0.0]), ("c", [0.0])))
    assert (index.node_idle("a"), index.node_idle("b"), index.node_idle("x"), index.idle_nodes()) == (True, False,
                                                                                                       False, 2)


@pytest.mark.parametrize("clear_grace, idle, parked_at, words", [
    (None, 0, 220, "pressure grace 2m"),  # the pressure grace: 120 s after the ask
    (5.0, 0, 105, "its node cleared for a whole-node request, grace 5s"),  # idle since before the ask: 5 s after it
    (5.0, 150, 150, "its node cleared for a whole-node request, grace 5s"),  # went idle after ask + 5 s: at once
])
def test_an_idle_lease_on_the_cleared_node_is_parked_after_the_clear_grace(clear_grace, idle, parked_at, words):
    leases = [Held("nb", "bob", 1.0, "interactive", False, False, at(0), at(idle), at(idle + 1800), "a"),
              on("a1", "a", 7.0)]
    rule = priority.Rule(120.0, 5.0, True, 0.0, clear_nodes=True, clear_grace=clear_grace)
    decided = rule.plan(leases, [Asking("q", "zoe", 8.0, "interactive", at(100), 8)], {}, {})
    assert decided.parks["nb"].deadline == at(parked_at) and set(decided.preemptions) == {"a1"}
    assert pressure.grace_words(decided.parks["nb"]) == words  # what the parked user reads


def test_the_clear_grace_is_only_for_the_cleared_node():
    """Counted in GPUs (a one-GPU ask) an idle lease keeps the pressure grace."""
    rule = priority.Rule(120.0, clear_nodes=True, clear_grace=5.0)
    decided = rule.plan([held("nb", owner="bob")], [asking("q", created=100)], {}, {})
    assert decided.parks["nb"].deadline == at(220)


def test_the_sweeps_early_reclaim_says_pressure_in_words_and_in_its_code():
    from types import SimpleNamespace

    from gpupool.hub_plugin.rules.reclaim import Reclaim
    from gpupool.schema import LeaseState

    decided = plan([held("nb", owner="bob")], [asking("q")])
    lease = SimpleNamespace(id="nb", state="active", worker_state="idle", idle_since=at(0), idle_timeout=1800.0)
    assert pressure.due(decided, [lease], at(219)) == []  # 120 s of grace after the ask at 100
    [decision] = pressure.due(decided, [lease], at(220))
    assert (decision.lease_id, decision.state, decision.code) == ("nb", LeaseState.reclaimed, Reclaim.pressure)
    assert decision.reason == "parked early: 1 person is waiting for a GPU (idle for 3m 40s, pressure grace 2m)"
