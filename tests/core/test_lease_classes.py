"""The lease class table (gpupool.leaseclasses): its rows are what the wire,
the rules, the magics and ``gpupool run`` read; a class added to the table is
accepted and ranked with no other change, an unknown one refused in words."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from gpupool import leaseclasses
from gpupool.errors import GPUPoolError
from gpupool.hub_plugin.rules import priority, queue
from gpupool.hub_plugin.rules.priority import Asking, Held
from gpupool.hub_plugin.rules.scheduler import Demand
from gpupool.leaseclasses import LeaseClass
from gpupool.wire.leases import Lease, LeaseRequest

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_the_table_is_well_formed():
    rows = leaseclasses.LEASE_CLASSES
    assert [row.name for row in rows] == ["interactive", "batch"]
    assert len({row.name for row in rows}) == len({row.rank for row in rows}) == len(rows)
    assert all(0 < len(row.name) <= leaseclasses.MAX_NAME and row.name.isidentifier() for row in rows)
    assert [row.name for row in rows if row.default] == ["interactive"]
    assert leaseclasses.lease_class(None).name == "interactive"
    assert leaseclasses.script_default().name == "batch"


@pytest.mark.parametrize("name", ["urgent", "", "BATCH", "inference"])
def test_an_unknown_class_is_refused_in_words(name):
    with pytest.raises(ValueError, match=r"lease class .* is not one of interactive, batch"):
        leaseclasses.lease_class(name)
    with pytest.raises(GPUPoolError, match="'lease_class' must be one of interactive, batch"):
        LeaseRequest.from_json({"lease_class": name})


INFERENCE = LeaseClass("inference", -1, "latency-sensitive serving", preempts=True)


@pytest.fixture
def third_class(monkeypatch):
    """The table with a third class ranked before interactive (not shipped: this test's row)."""
    monkeypatch.setattr(leaseclasses, "LEASE_CLASSES", (INFERENCE, *leaseclasses.LEASE_CLASSES))
    return INFERENCE


def test_a_third_class_is_accepted_by_the_wire(third_class):
    assert LeaseRequest.from_json({"lease_class": "inference"}).lease_class == "inference"
    with pytest.raises(GPUPoolError, match="'lease_class' must be one of inference, interactive, batch"):
        LeaseRequest.from_json({"lease_class": "urgent"})
    assert "inference" in LeaseRequest.json_schema()["properties"]["lease_class"]["enum"]


def test_a_third_class_is_ranked_by_the_rules(third_class):
    rows = [("b", "bob", "batch", 0), ("i", "ann", "interactive", 5), ("f", "cid", "inference", 9)]
    waiting = [queue.Waiting(i, o, Demand(0.5), at(c), cls) for i, o, cls, c in rows]
    assert [w.lease_id for w in queue.order(waiting, {})] == ["f", "i", "b"]
    assert priority.class_rank("inference") < priority.class_rank("interactive") < priority.class_rank("batch")
    # Its waiters press on every later class's idle leases; an interactive waiter never on its leases.
    held = [Held("int", "ann", 1.0, "interactive", False, False, at(0), at(0), at(1800)),
            Held("inf", "bob", 1.0, "inference", False, False, at(0), at(0), at(1800))]
    rule = priority.Rule(120, 30, True)
    assert set(rule.plan(held, [Asking("q", "zoe", 1.0, "inference", at(100))], {}).parks) == {"int"}
    assert set(rule.plan(held, [Asking("q", "zoe", 2.0, "interactive", at(100))], {}).parks) == {"int"}
    # It preempts (a table field): an opted-in running batch cell is interrupted for it.
    running = [Held("run", "ann", 1.0, "batch", True, True, at(0))]
    assert set(rule.plan(running, [Asking("q", "zoe", 1.0, "inference", at(100))], {}).preemptions) == {"run"}


def test_a_third_class_is_asked_for_by_the_magics_and_run(third_class):
    from gpupool.magics.classes import class_note, requested_class
    from gpupool.run_cli import run_class
    assert requested_class(False, {}, "inference") == "inference"
    assert requested_class(False, {"GPUPOOL_LEASE_CLASS": "inference"}) == "inference"
    assert run_class(False, "inference") == "inference"
    lease = Lease.from_json({"id": "L-1", "owner": "ann", "state": "active", "lease_class": "inference",
                           "fraction": 0.5, "gpu_count": 1, "memory": 2**30})
    assert class_note(lease) == "; inference"


def test_unknown_classes_are_refused_by_the_magics_and_run():
    from gpupool.magics.classes import requested_class
    from gpupool.run_cli import run_class
    with pytest.raises(ValueError, match="--class 'urgent' is not a lease class; use one of interactive, batch"):
        requested_class(False, {}, "urgent")
    with pytest.raises(ValueError, match="--class 'urgent' is not a lease class; use one of interactive, batch"):
        run_class(False, "urgent")
    with pytest.raises(ValueError, match="say one of them"):
        run_class(True, "batch")
    assert run_class(False, None) == "batch" and run_class(True, None) == "interactive"
    assert requested_class(True, {}, None) == "batch" and requested_class(False, {}, None) == "interactive"
