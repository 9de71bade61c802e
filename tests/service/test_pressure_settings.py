"""The pressure plan's settings change what the service does, end to end:
``c.PoolPressure.batch_first`` with ``preemption_grace = 0`` preempts a running
preemptible batch cell at once instead of parking a person's idle lease after
``pressure_grace``; ``c.PoolPressure.pressure_clears_nodes`` parks the idle leases of one
node for a waiting two-GPU request instead of every idle lease the request's GPUs
add up to; ``c.PoolPressure.batch_yields`` keeps a new batch request off a GPU while a
person waits. Real service, agents and (for preemption) a gpupool notebook kernel;
the defaults' behaviour is tests/service/test_pressure.py's.
"""

from __future__ import annotations

import time

import pytest

from frontend import notebook_pool, start_gpupool_kernel
from transcript import Transcript
from gpupool.errors import GPUPoolError
from gpupool.schema import LeaseState, parse_time
from gpupool.wire.leases import LeaseRequest
from procs import start_agent, start_service, wait_for


#: The pressure grace of these pools: far longer than the tests, so a park it sets never comes due in them.
#: The preemption notice: long enough that the test reads the lease before the park it announces
#: (the lease shows no preempt_at once it is parking; 1 s was too short on a loaded host).
LONG_GRACE, NOTICE = 60.0, 5.0
TOKENS = {"ann": "ann-token-" + "6" * 16, "bob": "bob-token-" + "7" * 16, "zoe": "zoe-token-" + "8" * 16}


def _active(service, user: str, request: LeaseRequest):
    """``user``'s lease for ``request``, active with its worker idle."""
    lease = service.client(user).create_lease(request)
    return wait_for(lambda: (got := service.client(user).get_lease(lease.id)).state is LeaseState.active
                    and got.worker and got.worker.get("execution_state") == "idle" and got, 60, f"{user}'s lease idle")


def _queued(service, user: str, request: LeaseRequest):
    lease = service.client(user).create_lease(request)
    assert lease.state is LeaseState.queued, lease
    return lease


@pytest.fixture
def batch_first_pool(tmp_path):
    """Two simulated GPUs; batch first, preemptible leases warned at once, a long pressure grace."""
    with notebook_pool(tmp_path, tokens=TOKENS, simulate="2xA100-80GB",
                       config={"heartbeat_ttl": 120.0, "idle_warning": 0, "pressure_grace": LONG_GRACE,
                               "preemption_notice": NOTICE, "preemption_grace": 0, "batch_first": True}) as pool:
        yield pool


def test_batch_first_preempts_a_running_batch_cell_before_a_person_idle_lease_is_parked(batch_first_pool, tmp_path):
    service, kernels = batch_first_pool
    (tmp_path / "nb").mkdir()
    km, kc = start_gpupool_kernel(kernels, tmp_path / "nb")
    notebook = Transcript(kc)
    notebook.listen()
    try:
        notebook.execute("%gpu acquire 1 --batch --preemptible")
        job, = service.client().list_leases(active=True)
        notebook.kc.execute("import time\nfor _ in range(1200): time.sleep(0.1)")
        wait_for(lambda: service.client().get_lease(job.id).worker["execution_state"] == "busy", 30, "the cell running")
        person = _active(service, "ann", LeaseRequest(fraction=1.0))  # a person's notebook, idle
        waiter = _queued(service, "zoe", LeaseRequest(fraction=1.0, wait=120))

        # The default order would park ann's idle lease 60 s from now and leave the job running.
        told = notebook.wait_for_event("preempt_notice", 30, "the preemption notice")
        assert told["message"].startswith(f"lease {job.id} is preemptible and 1 person is waiting for a GPU: in ")
        seen = service.client().get_lease(job.id)
        assert seen.preempt_at is not None
        assert service.client("ann").get_lease(person.id).pressure is None  # not pressed on
        asked = parse_time(waiter.created_at)
        assert (parse_time(seen.preempt_at) - asked).total_seconds() == pytest.approx(NOTICE, abs=0.01), seen
        parked = notebook.wait_for_event("parked", 60, "the park of the running cell")
        assert "the running cell waits and goes on when the pool resumes it" in parked["message"], parked
        wait_for(lambda: service.client("zoe").get_lease(waiter.id).state is LeaseState.active, 60, "zoe placed")
        # Between the park and zoe's placement one sweep may see zoe waiting and nothing but ann's lease
        # to press on: a deadline 60 s away that the next sweep, with nobody waiting, takes back.
        kept = wait_for(lambda: (got := service.client("ann").get_lease(person.id)).pressure is None and got, 10,
                        "no pressure once zoe is placed")
        assert kept.state is LeaseState.active, kept
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


@pytest.mark.parametrize("clears", [False, True])
def test_pressure_clears_one_node_for_a_whole_gpu_ask(tmp_path, clears):
    """Two nodes of two GPUs: ann idles on one GPU of one node, bob on both of the other; zoe
    asks for two whole GPUs. Counted in GPUs both idle leases are pressed on; with
    ``pressure_clears_nodes`` only the one lease whose node then holds two free GPUs."""
    service = start_service(tmp_path, tokens=TOKENS,
                            config={"heartbeat_ttl": 120.0, "pressure_grace": LONG_GRACE,
                                    "pressure_clears_nodes": clears})
    agents = []
    try:
        agents = [start_agent(tmp_path, service, name=name, simulate="2xA100-80GB") for name in ("node-1", "node-2")]
        ann = _active(service, "ann", LeaseRequest(fraction=1.0))
        bob = _active(service, "bob", LeaseRequest(fraction=1.0, gpu_count=2))
        assert ann.node != bob.node
        waiter = _queued(service, "zoe", LeaseRequest(fraction=1.0, gpu_count=2, wait=120))

        def pressed():
            leases = {who: service.client(who).get_lease(lease.id) for who, lease in (("ann", ann), ("bob", bob))}
            return {who for who, lease in leases.items() if lease.pressure}
        wait_for(pressed, 30, "the plan pressing on an idle lease")
        if clears:
            # node-1 (by name, at equal cost: one idle notebook, no running GPU) is cleared
            expected = {"ann"} if ann.node == "node-1" else {"bob"}
        else:
            expected = {"ann", "bob"}
        wait_for(lambda: pressed() == expected, 10, f"pressure on {expected}")
        asked = parse_time(waiter.created_at).timestamp()
        for who, lease in (("ann", ann), ("bob", bob)):
            seen = service.client(who).get_lease(lease.id)
            if who in expected:
                assert parse_time(seen.idle_deadline).timestamp() == pytest.approx(asked + LONG_GRACE, abs=0.01)
                assert seen.pressure == "parked early: 1 person is waiting for a GPU"
    finally:
        for agent in agents:
            agent.stop()
        service.stop()


@pytest.mark.parametrize("yields", [False, True])
def test_batch_yields_to_a_waiting_person(tmp_path, yields):
    """One node of two GPUs: ann idles on one, zoe waits for both. A new batch request of bob's
    backfills the free GPU; with ``batch_yields`` it waits, and a batch request without ``wait`` is
    refused naming the setting. Pressure counted pool-wide: no node is held for zoe (the next test),
    so only ``batch_yields`` decides, whether or not a sweep has planned yet."""
    service = start_service(tmp_path, tokens=TOKENS,
                            config={"heartbeat_ttl": 120.0, "pressure_grace": LONG_GRACE, "batch_yields": yields,
                                    "pressure_clears_nodes": False})
    agent = None
    try:
        agent = start_agent(tmp_path, service, simulate="2xA100-80GB")
        _active(service, "ann", LeaseRequest(fraction=1.0))
        _queued(service, "zoe", LeaseRequest(fraction=1.0, gpu_count=2, wait=120))
        batch = service.client("bob").create_lease(LeaseRequest(fraction=1.0, lease_class="batch", wait=120))
        assert batch.state is (LeaseState.queued if yields else LeaseState.starting), batch
        if yields:
            with pytest.raises(GPUPoolError) as refused:
                service.client("bob").create_lease(LeaseRequest(fraction=1.0, lease_class="batch"))
            assert refused.value.status == 409 and "c.PoolPressure.batch_yields" in refused.value.message
            time.sleep(1.0)  # sweeps drain the queue every 0.2 s: still not placed
            assert service.client("bob").get_lease(batch.id).state is LeaseState.queued
    finally:
        if agent is not None:
            agent.stop()
        service.stop()


def test_an_idle_lease_on_the_cleared_node_is_parked_after_the_clear_grace(tmp_path):
    """As above with ``pressure_clear_grace = 1``: the cleared node's idle lease is reclaimed about a
    second after zoe asked (not after the 60 s pressure grace), the other one kept, and zoe placed."""
    service = start_service(tmp_path, tokens=TOKENS,
                            config={"heartbeat_ttl": 120.0, "pressure_grace": LONG_GRACE,
                                    "pressure_clears_nodes": True, "pressure_clear_grace": 1.0})
    agents = []
    try:
        agents = [start_agent(tmp_path, service, name=name, simulate="2xA100-80GB") for name in ("node-1", "node-2")]
        ann = _active(service, "ann", LeaseRequest(fraction=1.0))
        bob = _active(service, "bob", LeaseRequest(fraction=1.0, gpu_count=2))
        waiter = _queued(service, "zoe", LeaseRequest(fraction=1.0, gpu_count=2, wait=120))
        (cleared, lease), (kept, other) = sorted((("ann", ann), ("bob", bob)), key=lambda pair: pair[1].node)
        ended = wait_for(lambda: (got := service.client(cleared).get_lease(lease.id)).state is LeaseState.parked
                         and got, 30, "the cleared node's idle lease parked")
        assert ended.parked["reason"].startswith("parked early: 1 person is waiting for a GPU"), ended
        assert time.time() - parse_time(waiter.created_at).timestamp() < LONG_GRACE / 2, ended
        placed = wait_for(lambda: (got := service.client("zoe").get_lease(waiter.id)).state is not LeaseState.queued
                          and got, 30, "zoe placed")
        assert placed.node == lease.node
        assert service.client(kept).get_lease(other.id).state is LeaseState.active
    finally:
        for agent in agents:
            agent.stop()
        service.stop()


def test_a_batch_is_not_placed_on_the_node_pressure_clears_for_a_person(tmp_path):
    """The defaults (``pressure_clears_nodes``): the plan clears the one node for zoe's two GPUs as
    her request queues, not at the next sweep (an hour away here), so bob's batch request right
    after does not backfill its free GPU: it waits, or is refused in words."""
    service = start_service(tmp_path, tokens=TOKENS, config={"heartbeat_ttl": 120.0, "pressure_grace": LONG_GRACE,
                                                             "reclaim_interval": 3600})
    agent = None
    try:
        agent = start_agent(tmp_path, service, simulate="2xA100-80GB")
        ann = _active(service, "ann", LeaseRequest(fraction=1.0))
        _queued(service, "zoe", LeaseRequest(fraction=1.0, gpu_count=2, wait=120))
        assert service.client("ann").get_lease(ann.id).pressure, "the plan clears ann's node at once"
        with pytest.raises(GPUPoolError) as refused:
            service.client("bob").create_lease(LeaseRequest(fraction=1.0, lease_class="batch"))
        assert refused.value.status == 409 and "is held for a person's request" in refused.value.message
        batch = service.client("bob").create_lease(LeaseRequest(fraction=1.0, lease_class="batch", wait=120))
        assert batch.state is LeaseState.queued, batch
    finally:
        if agent is not None:
            agent.stop()
        service.stop()
