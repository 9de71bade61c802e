"""The wait queue: fair order and draining (pure, table-driven), then a real
service where a queued lease becomes active when another is released, is
cancelled by DELETE, or gives up when its wait has passed."""

from __future__ import annotations

import re
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from gpu_states import gpu
from procs import start_agent, start_service
from service_api import gpu_allocations, wait_state

from gpupool.errors import GPUPoolError
from gpupool.hub_plugin.rules.queue import Waiting, drain, estimate, order, position
from gpupool.hub_plugin.rules.scheduler import Demand
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest

T0 = datetime(2026, 3, 2, 12, 0, tzinfo=timezone.utc)


def waiting(lease_id: str, owner: str, minutes_ago: float, fraction: float = 0.5, count: int = 1) -> Waiting:
    return Waiting(lease_id, owner, Demand(fraction, count), T0 - timedelta(minutes=minutes_ago))


def ago(minutes: float) -> datetime:
    return T0 - timedelta(minutes=minutes)


ORDER = [
    pytest.param([waiting("a", "ann", 5), waiting("b", "bob", 1)], {"ann": ago(1), "bob": ago(60)},
                 ["b", "a"], id="who used least recently goes first, not who asked first"),
    pytest.param([waiting("a", "ann", 5), waiting("b", "bob", 1)], {"ann": ago(1), "bob": None},
                 ["b", "a"], id="never used comes first"),
    pytest.param([waiting("a", "ann", 1), waiting("b", "bob", 5)], {"ann": None, "bob": None},
                 ["b", "a"], id="ties: the older request"),
    pytest.param([waiting("a", "ann", 1), waiting("c", "ann", 9), waiting("b", "bob", 5)],
                 {"ann": T0, "bob": ago(1)}, ["b", "c", "a"], id="someone holding capacity now goes last"),
]


@pytest.mark.parametrize("queue, last_used, expected", ORDER)
def test_order(queue, last_used, expected):
    assert [w.lease_id for w in order(queue, last_used)] == expected
    assert [position(x, queue, last_used) for x in expected] == [1, 2, 3][:len(expected)]


def test_position_of_a_lease_not_queued():
    assert position("zz", [waiting("a", "ann", 1)], {}) is None


def test_drain_takes_turns_between_users():
    """Room for two slices: ann's three requests do not all go before bob's one."""
    queue = [waiting("a1", "ann", 9), waiting("a2", "ann", 8), waiting("a3", "ann", 7), waiting("b1", "bob", 1)]
    placed = drain(queue, [gpu("n1", 0)], {"ann": None, "bob": ago(30)}, T0)
    assert [(w.lease_id, p.gpus) for w, p in placed] == [("a1", ("GPU-n1-0",)), ("b1", ("GPU-n1-0",))]


def test_drain_backfills_past_a_request_that_does_not_fit():
    queue = [waiting("big", "ann", 9, count=2), waiting("small", "bob", 1, fraction=0.25)]
    placed = drain(queue, [gpu("n1", 0, fraction=0.5), gpu("n1", 1)], {}, T0)
    assert [(w.lease_id, p.gpus) for w, p in placed] == [("small", ("GPU-n1-0",))]


def test_drain_never_overallocates():
    queue = [waiting(f"l{i}", f"u{i % 3}", i, fraction=0.25) for i in range(12)]
    placed = drain(queue, [gpu("n1", 0), gpu("n1", 1, fraction=0.5)], {}, T0)
    assert len(placed) == 6
    per_gpu = {}
    for _, p in placed:
        per_gpu[p.gpus[0]] = per_gpu.get(p.gpus[0], 0) + p.fraction
    assert per_gpu == {"GPU-n1-0": 1.0, "GPU-n1-1": 0.5}


@pytest.mark.parametrize("place_in_line, lengths, holding, expected", [
    (1, [], 3, None), (1, [600.0, 1200.0, 60.0], 2, 300.0), (3, [600.0], 0, 1800.0),
])
def test_estimate(place_in_line, lengths, holding, expected):
    assert estimate(place_in_line, lengths, holding) == expected


# -- through the service --------------------------------------------------------------------------------------------

def test_a_queued_lease_starts_when_another_is_released(busy_pool):
    svc, holders = busy_pool
    ann = svc.client("ann")
    queued = ann.create_lease(LeaseRequest(fraction=0.5, wait=300))
    assert (queued.state, queued.node, queued.gpus) == (LeaseState.queued, None, [])
    assert queued.queue_position == 1 and queued.wait_until
    assert queued.events[-1]["reason"].startswith("waiting up to 5m: no GPU can take 0.50 now")
    # The tester, who holds the pool, queues behind ann although the rule is not first come.
    mine = svc.client().create_lease(LeaseRequest(fraction=0.5, wait=300))
    assert mine.queue_position == 2 and ann.get_lease(queued.id).queue_position == 1
    assert [x.id for x in ann.list_leases()] == [queued.id]  # queued leases are listed as active
    # Without a wait, the old answer: 409 with what is free.
    with pytest.raises(GPUPoolError) as full:
        ann.create_lease(LeaseRequest(fraction=0.5))
    assert full.value.code == "pool_full"
    svc.client().release(holders[0].id)
    started = wait_state(svc, queued.id, "queued", user="ann")
    started = wait_state(svc, started.id, "starting", user="ann") if started.state is LeaseState.starting else started
    assert started.state is LeaseState.active, started.reason
    assert started.queue_position is None and started.connection
    assert [e["state"] for e in started.events] == ["queued", "starting", "active"]
    # The tester's request fitted beside it on the same GPU (best fit).
    second = wait_state(svc, mine.id, "queued")
    assert second.state in (LeaseState.starting, LeaseState.active)
    assert sorted(gpu_allocations(svc)) == [1.0, 1.0]


def test_cancelling_a_queued_lease_removes_it(busy_pool):
    svc, _ = busy_pool
    queued = svc.client("ann").create_lease(LeaseRequest(fraction=0.5, wait=300))
    ended = svc.client("ann").release(queued.id)
    assert (ended.state, ended.reason, ended.usage_gpu_seconds) == (LeaseState.released, "released by its owner", 0)
    assert svc.client("ann").list_leases() == []
    assert svc.client("ann").quota()["usage"]["holding_gpus"] == 0


def test_interrupting_a_queued_acquire_cancels_it_in_one_line(busy_pool, tmp_path):
    """ann's notebook waits in the queue; the front end interrupts the kernel: the cell ends with one
    line (a UsageError, not the long poll's KeyboardInterrupt traceback) and nothing stays queued."""
    from frontend import install_kernelspec, start_gpupool_kernel
    from procs import wait_for

    svc, _ = busy_pool
    km, kc = start_gpupool_kernel(install_kernelspec(tmp_path / "prefix", svc.url, svc.extra_tokens["ann"]),
                                  tmp_path)
    try:
        msg_id = kc.execute("%gpu acquire 0.5 --wait 5m")
        wait_for(lambda: [lease.state for lease in svc.client("ann").list_leases()] == [LeaseState.queued], 30,
                 "ann's request in the queue")
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=30)
        content = reply["content"]
        assert (content["status"], content["ename"]) == ("error", "UsageError"), content
        assert content["evalue"].startswith("interrupted; the request L-") and "was cancelled" in content["evalue"]
        assert svc.client("ann").list_leases() == []
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_queued_lease_gives_up_after_its_wait(busy_pool):
    svc, _ = busy_pool
    queued = svc.client("ann").create_lease(LeaseRequest(fraction=0.5, wait=1))
    ended = wait_ended_as(svc, "ann", queued.id)
    assert ended.state is LeaseState.failed
    assert ended.reason.startswith("waited ")
    assert "in the queue for 0.50 of a GPU and nothing fitting became free" in ended.reason
    with pytest.raises(GPUPoolError) as too_long:
        svc.client("ann").create_lease(LeaseRequest(fraction=0.5, wait=3600))
    assert "above this pool's maximum of 10m" in too_long.value.message


def test_a_queued_lease_gives_up_at_its_wait_not_at_the_next_sweep(tmp_path):
    """With sweeps a minute apart, a request that may wait 2 s ends failed a few seconds after it
    was made (it used to end at the sweep after its wait)."""
    svc = start_service(tmp_path, config={"reclaim_interval": 60.0, "max_wait": "10m"})
    agent = start_agent(tmp_path, svc, simulate="1xA100-80GB")
    try:
        holder = svc.client().create_lease(LeaseRequest(fraction=1.0))
        assert wait_state(svc, holder.id, "starting").state is LeaseState.active
        asked = time.monotonic()
        queued = svc.client().create_lease(LeaseRequest(fraction=0.5, wait=2))
        assert queued.state is LeaseState.queued
        ended = wait_ended_as(svc, "tester", queued.id, timeout=50)
        assert ended.state is LeaseState.failed and ended.reason.startswith("waited "), ended.reason
        assert time.monotonic() - asked < 30  # the next sweep is 60 s after the service started
    finally:
        agent.stop()
        svc.stop()


def wait_ended_as(svc, user: str, lease_id: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    lease = svc.client(user).get_lease(lease_id)
    while not lease.state.ended and time.monotonic() < deadline:
        lease = svc.client(user).get_lease(lease_id, wait=min(10, deadline - time.monotonic()),
                                           state=lease.state.value)
    return lease



# -- what the notebook shows --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, words", [
    (dict(state="queued", queue_position=2, queue_estimate_s=300.0), "queued: 2nd in line, about 5m"),
    (dict(state="queued", queue_position=11), "queued: 11th in line"),
    (dict(state="queued", queue_position=1, lease_class="batch"), "queued (batch): 1st in line"),
    (dict(state="queued"), "queued"),
    (dict(state="starting", node="node-1"), "starting on node-1"),
    (dict(state="starting", node="node-2", parked={"tier": "memory", "moving_from": "node-1"}),
     "moving to node-2 from node-1 (a new worker there takes its state, worker to worker)"),
    (dict(state="starting", node="node-2", parked={"tier": "disk", "moving_from": "node-1"}),
     "moving to node-2 from node-1's disk (a new worker loads its state there)"),
])
def test_progress_words(fields, words):
    from gpupool.leasewait import progress_words
    from gpupool.wire.leases import Lease

    lease = Lease.from_json({"id": "L-000000000001", "owner": "ann", "fraction": 0.5, "gpu_count": 1, "memory": 0,
                             **fields})
    assert progress_words(lease) == words


def test_gpu_quota_magic(busy_pool, monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    svc, _ = busy_pool
    monkeypatch.setenv("GPUPOOL_URL", svc.url)
    monkeypatch.setenv("GPUPOOL_TOKEN", svc.extra_tokens["ann"])
    # A shell of its own: IPython's global test shell starts only once per process, and
    # tests/kernel/test_magics_input.py must be the one that starts it.
    ip = InteractiveShell()
    ip.run_line_magic("load_ext", "gpupool.magics")
    try:
        with capture_output() as out:
            ip.run_line_magic("gpu", "quota")
    finally:
        ip.run_line_magic("unload_ext", "gpupool.magics")
    assert out.stdout.startswith("user ann (groups: none); days and weeks in UTC")
    assert re.search(r"GPUs held, queued or parked +0\.00 +unlimited", out.stdout)
    assert re.search(r"host memory of parked leases +0 B +unlimited", out.stdout)


def test_the_queue_survives_a_restart(tmp_path):
    """Queued requests live in SQL: after a restart they keep their place and are placed when room frees."""
    from service_api import register, silent_listener

    tokens = {"ann": "ann-" + uuid.uuid4().hex}
    config = {"node_ttl": 3600, "worker_stop_timeout": 1}
    svc = start_service(tmp_path, tokens=tokens, config=config)
    try:
        with silent_listener() as silent:
            svc.silent_url = "http://127.0.0.1:%d" % silent.getsockname()[1]
            register(svc, "node-s", gpus=1)
            holder = svc.client().create_lease(LeaseRequest(fraction=1.0))  # stays starting: the agent is silent
            queued = svc.client("ann").create_lease(LeaseRequest(fraction=0.5, wait=600))
            assert svc.stop() == 0
            svc = start_service(tmp_path, tokens=tokens, config=config)
            kept = svc.client("ann").get_lease(queued.id)
            assert (kept.state, kept.queue_position) == (LeaseState.queued, 1)
            svc.client().release(holder.id)
            placed = wait_state(svc, queued.id, "queued", user="ann")
            assert placed.state is LeaseState.starting and placed.node == "node-s"
            assert gpu_allocations(svc) == [0.5]
    finally:
        svc.stop()


def test_a_request_queued_behind_a_new_lease_gets_an_eta_from_it_not_from_the_last_sweep(tmp_path):
    """The ETA reads the pool again once capacity changed: with no sweep since the pool was empty, a
    request queued behind the lease just placed is told the pressure grace, not "about 0s"."""
    tokens = {"ann": "ann-" + uuid.uuid4().hex}
    svc = start_service(tmp_path, tokens=tokens, config={"reclaim_interval": 3600, "pressure_grace": 600})
    agent = start_agent(tmp_path, svc, simulate="1xA100-80GB")
    try:
        holder = wait_state(svc, svc.client().create_lease(LeaseRequest(fraction=1.0)).id, "starting")
        assert holder.state is LeaseState.active, holder.reason
        waiter = svc.client("ann").create_lease(LeaseRequest(fraction=1.0, wait=600))
        assert waiter.state is LeaseState.queued and waiter.queue_estimate_s is not None, waiter
        assert 300 < waiter.queue_estimate_s <= 600, waiter
    finally:
        agent.stop()
        svc.stop()


@pytest.mark.parametrize("owner, expected", [
    ("new", 3),     # never used: after the two of never-used "old" (asked earlier), before everyone who used
    ("bob", 6),     # used at 10:00: behind the never-used, "ann" (9:00) and his own earlier one
    ("holder", 9),  # holds capacity now: behind everyone
])
def test_the_newest_request_is_placed_as_order_would(owner, expected):
    from gpupool.hub_plugin.rules.queue import newest_position, order

    t = lambda hour: datetime(2026, 1, 1, hour, tzinfo=timezone.utc)  # noqa: E731
    last = {"old": None, "new": None, "ann": t(9), "bob": t(10), "holder": t(23)}
    queued = [Waiting(f"L-{i}", who, Demand(0.5), t(11)) for i, who in
              enumerate(["old", "old", "ann", "ann", "bob", "holder", "holder", "holder"])]
    newest = Waiting("L-new", owner, Demand(0.5), t(12))
    place = [item.lease_id for item in order([*queued, newest], last)].index("L-new") + 1
    counts = {}
    for item in [*queued, newest]:
        counts[(item.owner, "interactive")] = counts.get((item.owner, "interactive"), 0) + 1
    assert newest_position(owner, "interactive", counts, last) == place == expected
