"""Pressure end to end: a full pool, a waiting interactive request,
an idle over-quota lease parked early (its variables come back), the waiter
placed; a batch lease whose cell runs is not interrupted and yields once idle;
a preemptible one is told, interrupted, then parked. Through a real service,
agent and gpupool notebook kernel; short graces through the service's traits.
"""

from __future__ import annotations

import io
import re
import time

import pytest

from frontend import notebook_pool, start_gpupool_kernel
from transcript import Transcript
from gpupool.errors import GPUPoolError
from gpupool.leasewait import wait_started
from gpupool.schema import LeaseState, parse_time
from gpupool.wire.leases import LeaseRequest
from procs import start_service, wait_for

#: Seconds an idle lease may stay idle while someone waits, and the preemption notice, on this pool.
GRACE, NOTICE = 3.0, 1.0


@pytest.fixture(scope="module")
def full_pool(tmp_path_factory):
    """Service (one simulated GPU, heartbeat TTL 3 s, short pressure grace), agent,
    kernelspec for user tester; ann asks for GPUs through the API: ``(service, kernels dir)``."""
    with notebook_pool(tmp_path_factory.mktemp("pressure"), tokens={"ann": "ann-token-" + "5" * 16},
                       config={"heartbeat_ttl": 3.0, "idle_warning": 0, "pressure_grace": GRACE,
                               "preemption_notice": NOTICE}, simulate="1xA100-80GB") as pool:
        yield pool


@pytest.fixture
def notebook(full_pool, tmp_path):
    km, kc = start_gpupool_kernel(full_pool[1], tmp_path)
    transcript = Transcript(kc)
    transcript.listen()
    yield transcript
    kc.stop_channels()
    km.shutdown_kernel(now=False)
    for left in full_pool[0].client("ann").list_leases(active=True):  # a failed test's waiter fails no other
        full_pool[0].client("ann").release(left.id)


def wait_in_line(service):
    """ann asks for the whole GPU and waits; returns the queued lease."""
    lease = service.client("ann").create_lease(LeaseRequest(fraction=1.0, wait=120))
    assert lease.state is LeaseState.queued and lease.queue_position == 1, lease
    return lease


def placed(service, lease_id: str):
    """Wait until ann's request is active; release it and return it."""
    lease = wait_for(lambda: (got := service.client("ann").get_lease(lease_id)).state is LeaseState.active and got,
                     60, "the waiter placed")
    service.client("ann").release(lease_id)
    return lease


def test_an_idle_lease_is_parked_early_for_a_waiter_and_its_variables_come_back(full_pool, notebook):
    service, _ = full_pool
    notebook.execute("%gpu acquire 1")  # the default idle timeout, 30 minutes
    mine, = service.client().list_leases(active=True)
    notebook.execute("kept = [1, 2, 3]")
    # The ETA below walks from what the service knows: a cell it still sees running has no expected end yet.
    wait_for(lambda: (got := service.client().get_lease(mine.id)).idle_deadline and
             (got.worker or {}).get("execution_state") == "idle", 30, "the service saw the cell end")
    waiter = wait_in_line(service)
    # Its ETA counts the pressure it makes from the start: the idle lease is parked within the grace of
    # the ask, not at its own deadline (30 m idle), which the first answer gave before.
    assert 0 < waiter.queue_estimate_s <= GRACE, waiter

    parked = notebook.wait_for_event("parked", 60, "the early park")
    assert re.fullmatch(rf"lease {mine.id} was parked early: 1 person is waiting for a GPU \(idle for \d+s, pressure "
                        rf"grace {GRACE:.0f}s\): its worker is frozen on node-1 with its variables in host memory.*; "
                        r"the next cell resumes it where it was", parked["message"]), parked
    seen = service.client().get_lease(mine.id)
    assert seen.state is LeaseState.parked
    assert seen.parked["reason"].startswith("parked early: 1 person is waiting for a GPU"), seen
    assert placed(service, waiter.id).node  # placed, then released: the GPU is free again
    _, reply = notebook.execute("print(kept)")  # resumes in place
    assert "[1, 2, 3]" in notebook.text() and f"gpupool: resumed {mine.id}" in notebook.text()


def test_the_wait_line_follows_the_queue(full_pool, notebook):
    """ann's second request waits behind her first: its line says 2nd in line, then 1st with an ETA
    once the first is placed (the tester's idle lease parked early for it), then it is placed itself
    (the first, which nobody heartbeats, is reclaimed)."""
    service, _ = full_pool
    notebook.execute("%gpu acquire 1")
    client = service.client("ann")
    first, second = (client.create_lease(LeaseRequest(fraction=1.0, wait=120)) for _ in range(2))
    assert (first.queue_position, second.queue_position) == (1, 2)
    out = io.StringIO()
    try:
        placed_lease = wait_started(client, second, time.monotonic(), 60, stream=out, rewrite=False)
    finally:
        for lease in (first, second):
            client.release(lease.id)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"gpupool: {second.id} queued: 2nd in line"), lines
    first_in_line = [line for line in lines if "queued: 1st in line, about " in line]
    assert first_in_line and lines.index(first_in_line[0]) > 0, lines
    assert placed_lease.state is LeaseState.active, placed_lease


def test_a_batch_request_presses_on_no_notebook_and_its_eta_says_so(full_pool, notebook):
    """A batch request waits behind a person's idle notebook: it parks nothing early (only a person's
    request presses on every class), so its ETA is the notebook's own idle deadline (30 m), not the grace."""
    service, _ = full_pool
    notebook.execute("%gpu acquire 1")
    mine, = service.client().list_leases(active=True)
    waiter = service.client("ann").create_lease(LeaseRequest(fraction=1.0, wait=120, lease_class="batch"))
    try:
        assert waiter.state is LeaseState.queued and 1700 < waiter.queue_estimate_s <= 1800, waiter
        time.sleep(GRACE + 2.0)  # past what a person's request would give it
        assert service.client().get_lease(mine.id).state is LeaseState.active
        assert 1700 < service.client("ann").get_lease(waiter.id).queue_estimate_s <= 1800
    finally:
        service.client("ann").release(waiter.id)


def test_a_running_batch_cell_is_not_interrupted_and_the_lease_yields_once_idle(full_pool, notebook):
    service, _ = full_pool
    notebook.execute("%gpu acquire 1 --batch")
    mine, = service.client().list_leases(active=True)
    assert mine.lease_class == "batch" and not mine.preemptible
    cell = notebook.kc.execute("import time\nfor _ in range(120): time.sleep(0.1)\ndone = True")
    wait_for(lambda: service.client().get_lease(mine.id).worker["execution_state"] == "busy", 30, "the cell running")
    waiter = wait_in_line(service)
    # Past every deadline pressure could set (grace + notice after the request), the cell still runs untouched.
    past = parse_time(waiter.created_at).timestamp() + GRACE + NOTICE + 1.0
    wait_for(lambda: time.time() > past, 30, "every pressure deadline passing")
    seen = service.client().get_lease(mine.id)
    assert seen.worker["execution_state"] == "busy" and seen.preempt_at is None, seen
    reply = _reply(notebook, cell)
    assert reply["status"] == "ok", reply  # not interrupted
    notebook.wait_for_event("parked", 60, "the batch lease yielding")
    assert placed(service, waiter.id).node
    assert service.client().get_lease(mine.id).parked["reason"].startswith("parked early: 1 person is waiting for a GPU")


def test_a_preemptible_lease_is_frozen_mid_cell_and_the_cell_goes_on_after_its_resume(full_pool, notebook):
    service, _ = full_pool
    notebook.execute("%gpu acquire 1 --batch --preemptible")
    mine, = service.client().list_leases(active=True)
    # Counts wall-clock ticks: a frozen cell misses some, an interrupted one would never finish.
    cell = notebook.kc.execute("import time\nstart = time.time()\nfor i in range(100): time.sleep(0.1)\n"
                               "print('done', i, time.time() - start > 10)")
    wait_for(lambda: service.client().get_lease(mine.id).worker["execution_state"] == "busy", 30, "the cell running")
    waiter = wait_in_line(service)

    told = notebook.wait_for_event("preempt_notice", 60, "the preemption notice")
    assert told["message"].startswith(f"lease {mine.id} is preemptible and 1 person is waiting for a GPU: in about")
    # The status bar's state carries it too (the JupyterLab item says "preempted in 1s", the notice as its title).
    coming = notebook.wait_for_state(lambda s: s["preempt_at"], 30, "the state with preempt_at")
    assert coming["phase"] == "attached" and coming["lease"] == mine.id, coming
    assert coming["reason"] == "1 person is waiting for a GPU", coming
    assert parse_time(coming["preempt_at"]) > parse_time(waiter.created_at), coming
    parked = notebook.wait_for_event("parked", 60, "the park of the running cell")
    after = notebook.wait_for_state(lambda s: s["phase"] == "parked", 30, "the parked state")
    assert after["preempt_at"] is None and after["lease"] == mine.id, after  # the park clears it
    assert parked["message"].startswith(f"lease {mine.id} was preempted: 1 person is waiting for a GPU: its worker "
                                        "is frozen on node-1"), parked
    assert "the running cell waits and goes on when the pool resumes it" in parked["message"]
    assert placed(service, waiter.id).node  # ann's lease runs on the GPU, then gives it back
    resumed = notebook.wait_for_event("resumed", 90, "the service resuming the preempted lease once room came")
    assert resumed["message"].startswith(f"resumed {mine.id} on node-1 GPU 0 (parked "), resumed
    assert resumed["message"].endswith("; the running cell goes on"), resumed
    reply = _reply(notebook, cell)
    assert reply["status"] == "ok", reply
    notebook.wait_for_line(f"gpupool: resumed {mine.id} on node-1", 30, "the resume said in the running cell")
    notebook.wait_for_line("done 99 True", 30, "the cell's last line: all its ticks, past the freeze")
    assert service.client().get_lease(mine.id).state is LeaseState.active


def test_preemptible_is_refused_where_the_pool_allows_none(tmp_path):
    service = start_service(tmp_path, config={"allow_preemption": False})
    try:
        with pytest.raises(GPUPoolError) as caught:
            service.client().create_lease(LeaseRequest(fraction=0.5, lease_class="batch", preemptible=True, wait=60))
        assert caught.value.status == 400 and "c.PoolPressure.allow_preemption = False" in caught.value.message
        with pytest.raises(GPUPoolError, match="'lease_class' must be one of interactive, batch"):
            service.client().request("POST", "/leases", {"fraction": 0.5, "lease_class": "urgent"})
        assert service.client().list_leases(active=False) == []  # nothing queued or held
    finally:
        service.stop()


def test_a_new_request_sees_the_cells_as_the_store_has_them_not_as_the_last_sweep(tmp_path):
    """With no sweep (an hour apart), a request queued while the holder's cell runs has no ETA (a busy
    lease of a class with no history: unknown); once the cell has ended, the next request is told the
    pressure grace: its first answer reads the store, not the pool as an earlier request saw it."""
    tokens = {"ann": "ann-token-" + "6" * 16}
    with notebook_pool(tmp_path, tokens=tokens, config={"reclaim_interval": 3600, "pressure_grace": 600},
                       simulate="1xA100-80GB") as (service, kernels):
        km, kc = start_gpupool_kernel(kernels, tmp_path)
        try:
            notebook = Transcript(kc)
            notebook.listen()
            notebook.execute("%gpu acquire 1")
            mine, = service.client().list_leases(active=True)
            cell = kc.execute("import time\ntime.sleep(3)")
            wait_for(lambda: (service.client().get_lease(mine.id).worker or {}).get("execution_state") == "busy",
                     30, "the cell running")
            early = service.client("ann").create_lease(LeaseRequest(fraction=1.0, wait=600))
            service.client("ann").release(early.id)
            assert early.queue_estimate_s is None, early
            assert _reply(notebook, cell)["status"] == "ok"
            wait_for(lambda: (service.client().get_lease(mine.id).worker or {}).get("execution_state") == "idle",
                     30, "the cell's end seen")
            later = service.client("ann").create_lease(LeaseRequest(fraction=1.0, wait=600))
            service.client("ann").release(later.id)
            assert later.queue_estimate_s is not None and 0 < later.queue_estimate_s <= 600, later
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=False)


def _reply(notebook: Transcript, msg_id: str) -> dict:
    reply = notebook.kc.get_shell_msg(timeout=120)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = notebook.kc.get_shell_msg(timeout=120)
    return reply["content"]

