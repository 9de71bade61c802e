"""Table tests of the node pressure clears for a waiting whole-GPU request
(hub_plugin/rules/clearing.py) and of how the plan keeps it (hub_plugin/rules/priority.py):
what taking leases frees is counted in whole GPUs, GPU by GPU; GPUs on their way back
count whole; the node cleared for a request stays cleared while it can be; a request no
node can be cleared for preempts nothing. Each of these, missing, let a batch backlog's
replay preempt the same jobs over and over (bench/backlog_churn.py)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from gpupool.hub_plugin.rules import clearing, priority
from gpupool.hub_plugin.rules.priority import Asking, Held
from gpupool.hub_plugin.rules.scheduler import GPUState

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
RULE = priority.Rule(120, 5, True, preemption_grace=0.0, clear_nodes=True)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def job(lease_id, node, gpus, *gpu_ids, cls="batch", busy=True, preemptible=True, owner="bob"):
    """A lease on ``node`` holding ``gpus`` (fraction x count) on ``gpu_ids``: running (preemptible
    unless said), or idle since 0."""
    return Held(lease_id, owner, gpus, cls, preemptible, busy, at(0), None if busy else at(0), None, node,
                gpu_ids=tuple(gpu_ids))


def slices(node, share, count=8, prefix="s"):
    """A running batch slice of ``share`` on each of ``count`` GPUs of ``node``."""
    return [job(f"{prefix}{node}{i}", node, share, f"{node}{i}") for i in range(count)]


def ask(count=8, lease_id="q", created=100.0):
    return Asking(lease_id, "zoe", float(count), "interactive", at(created), count)


def clear(leases, free, count=8, staying=(), kept=None):
    found = clearing.clear(count, leases, free, True, priority.yields, priority.class_rank, staying, kept)
    return None if found is None else (found[0], {lease.lease_id for lease in found[1]})


@pytest.mark.parametrize("leases, free, staying, expected", [
    # eight half-GPU batch slices free eight whole GPUs, not four
    (slices("a", 0.5), {}, (), ("a", {f"sa{i}" for i in range(8)})),
    # two slices sharing a GPU free it together: 4 whole free + 3 GPUs of slices + 1 shared by two
    (slices("a", 0.3, 3) + [job("x", "a", 0.4, "a7"), job("y", "a", 0.5, "a7")], {"a": 4.0}, (),
     ("a", {"sa0", "sa1", "sa2", "x", "y"})),
    # a slice next to a person's running cell frees no GPU: the node falls short, nothing is taken there
    (slices("a", 0.5, 7) + [job("p", "a", 0.5, "a7", cls="interactive", preemptible=False)], {"a": 0.0}, (), None),
    # ... nor next to a lease pressure may not take (guaranteed, passed as staying)
    (slices("a", 0.5), {}, [job("g", "a", 0.25, "a3", cls="interactive")], None),
    # a lease of several whole GPUs frees them all
    ([job("w", "a", 4.0, "a0", "a1", "a2", "a3")], {"a": 4.0}, (), ("a", {"w"})),
    # of two nodes that can be cleared, the one stopping fewer running GPUs (b: slices of 0.25)
    (slices("a", 0.5) + slices("b", 0.25), {}, (), ("b", {f"sb{i}" for i in range(8)})),
])
def test_what_taking_leases_frees_is_counted_in_whole_gpus(leases, free, staying, expected):
    assert clear(leases, free, staying=staying) == expected


@pytest.mark.parametrize("kept, free, expected", [
    (None, {"a": 6.0, "b": 6.0}, "a"),  # the cheapest: equal costs, by name
    ("b", {"a": 6.0, "b": 6.0}, "b"),  # the node the last plan cleared for the request, while it still can be
    ("b", {"a": 6.0, "b": 6.0, "c": 8.0}, "b"),  # even where another now costs less
    ("b", {"a": 6.0, "b": 5.0}, "a"),  # b can no longer be cleared (5 free + 2): another one
])
def test_the_node_cleared_for_a_request_is_kept_while_it_can_be_cleared(kept, free, expected):
    leases = [job("a1", "a", 2.0, "a6", "a7"), job("b1", "b", 2.0, "b6", "b7")]
    assert clear(leases, free, kept=kept)[0] == expected


@pytest.mark.parametrize("allocated, leaving, expected", [
    ({}, {}, {"a": 8.0}),
    ({"a0": 0.5, "a1": 0.3}, {}, {"a": 6.0}),
    # slices being parked: their GPUs are on their way back, whole, however small the slices
    ({"a0": 0.5, "a1": 0.3}, {"a0": 0.5, "a1": 0.3}, {"a": 8.0}),
    # a GPU one of them shares with a lease that stays is not
    ({"a0": 0.5, "a1": 0.8}, {"a0": 0.5, "a1": 0.3}, {"a": 7.0}),
])
def test_whole_free_counts_gpus_on_their_way_back_whole(allocated, leaving, expected):
    gpus = [GPUState(f"a{i}", "a", "A100", i, 80 * 2**30, 79 * 2**30, allocated.get(f"a{i}", 0.0),
                     int(allocated.get(f"a{i}", 0.0) * 79 * 2**30)) for i in range(8)]
    assert clearing.whole_free(gpus, leaving) == expected


def test_a_node_packed_with_batch_slices_is_cleared_for_a_whole_node_ask():
    """Counted as fractions (4 GPUs) no node covered the ask and the plan preempted jobs pool-wide."""
    leases = slices("a", 0.5) + slices("b", 0.5)
    decided = RULE.plan(leases, [ask()], {}, {})
    assert decided.cleared == {"a": "q"}
    assert set(decided.preemptions) == {f"sa{i}" for i in range(8)}


def test_a_request_no_node_can_be_cleared_for_preempts_nothing():
    """A person's cell runs on each node: jobs stopped here and there would free nothing it can use,
    and their own resumes would take it back before the next sweep."""
    leases = [job(f"p{node}", node, 1.0, f"{node}0", cls="interactive", preemptible=False) for node in "ab"]
    leases += [job(f"j{node}", node, 7.0, *(f"{node}{i}" for i in range(1, 8))) for node in "ab"]
    decided = RULE.plan(leases, [ask()], {}, {})
    assert not decided.cleared and not decided.preemptions and not decided.parks


def test_the_plan_keeps_the_node_it_cleared_while_its_jobs_are_parked():
    """Sweep after sweep: a's jobs were preempted for q and are on their way back (whole free GPUs);
    b now costs nothing more, yet q keeps a, so its jobs' resumes are not let back onto a."""
    leases = [job("b1", "b", 2.0, "b6", "b7")]
    decided = RULE.plan(leases, [ask()], {}, {"a": 8.0, "b": 6.0}, {"a": 2.5}, kept={"a": "q"})
    assert decided.cleared == {"a": "q"} and not decided.preemptions
    assert RULE.plan(leases, [ask()], {}, {"a": 5.0, "b": 6.0}, kept={"a": "q"}).cleared == {"b": "q"}


def test_a_kept_node_goes_to_its_own_request_only():
    """The node kept for q is cleared for q, not for an older request r that finds another node."""
    leases = [job("a1", "a", 2.0, "a6", "a7"), job("b1", "b", 2.0, "b6", "b7")]
    decided = RULE.plan(leases, [ask(lease_id="r", created=50.0), ask()], {}, {"a": 6.0, "b": 6.0},
                        kept={"a": "q"})
    assert decided.cleared == {"a": "q", "b": "r"}
