"""The ``gpupool.status`` comm message by message (issue 17), as the JupyterLab
extension uses it: a real gpupool kernel on a real pool (``e2e_pool``, heartbeat
TTL 3 s), driven with jupyter_client.

The comm gets the state on open and on every change, events for what happens
between cells and for what a cell says anyway, and answers requests with the
``%gpu`` magic's own parser and words; what the magic prints meanwhile comes in
the reply, never as a cell's output.
"""

from __future__ import annotations

import re

import pytest

from gpupool.heartbeat import LeaseHeartbeat
from gpupool.schema import LeaseState
from gpupool.wire.leases import Lease
from gpupool.magics.events import lease_state
from gpupool.wire.status import PHASES
from statuscomm import StatusComm

GIB = 1024**3
MODEL = "NVIDIA A100-SXM4-80GB"


@pytest.fixture
def status(kernel):
    _, kc = kernel
    return kc, StatusComm(kc)


def test_lease_state_has_every_key_in_every_phase():
    lease = Lease(id="L-1", owner="ann", state=LeaseState.queued, fraction=0.5, gpu_count=1, memory=40 * GIB,
                  queue_position=2, queue_estimate_s=30.0)
    keys = set(lease_state("detached"))
    for phase in PHASES:
        assert set(lease_state(phase, lease)) == keys and lease_state(phase, lease)["phase"] == phase
    queued = lease_state("queued", lease)
    assert (queued["queue_position"], queued["eta"], queued["share"]) == (2, 30.0, "0.50 of a GPU")
    assert lease_state("attached", lease)["queue_position"] is None
    with pytest.raises(ValueError, match="phase must be one of"):
        lease_state("busy")
    two = Lease(id="L-2", owner="ann", state=LeaseState.active, fraction=1.0, gpu_count=2, memory=40 * GIB)
    assert (lease_state("attached", two)["memory_limit"], lease_state("attached", two)["share"]) == (80 * GIB, "2 GPUs")


def test_state_on_open_then_on_attach_and_release_from_cells(status):
    kc, comm = status
    first = comm.next(lambda d: True)
    assert first["state"]["phase"] == "detached" and first["state"]["lease"] is None, first
    cell = comm.run("%gpu acquire 0.25")
    assert cell.ok, cell.text()
    attached = comm.event("attached")
    assert MODEL in attached["message"]
    state = comm.state("attached")
    assert state["share"] == "0.25 of a GPU" and state["gpu_model"] == MODEL and state["node"]
    assert state["lease"].startswith("L-") and isinstance(state["memory_limit"], int) and state["memory_limit"] > 10 * GIB and state["gpu_indices"]
    cell = comm.run("%gpu release")
    assert cell.ok, cell.text()
    assert state["lease"] in comm.event("released")["message"]
    assert comm.state("detached")["lease"] is None


def test_requests_run_the_magic_and_keep_its_output_out_of_cells(status):
    kc, comm = status
    comm.state("detached")
    reply = comm.ask({"request": "acquire", "text": "0.5 --memory 20GiB"})
    assert reply["reply"] == "acquire" and reply["ok"], reply
    assert "attached" in reply["output"] and MODEL in reply["output"]
    state = comm.last_state()
    assert state["phase"] == "attached", state
    assert state["fraction"] == 0.5 and state["memory_limit"] == 20 * GIB
    where = comm.run("import os; print(os.environ.get('GPUPOOL_LEASE_ID'))")
    assert where.stdout.strip() == state["lease"], "the next cell runs on the lease the dialog acquired"
    shown = comm.ask({"request": "status"})
    assert shown["ok"] and state["lease"] in shown["message"], shown
    assert shown["message"].endswith("\n\nno names hold GPU memory on the worker"), "as %gpu status says it"
    assert shown["holders"] == {"columns": ["holds GPU memory", "size", "on", "type"], "rows": [], "notes": []}
    assert comm.run("from gpupool.node import simgpu\nheld = simgpu.zeros(8 << 20, 'uint8')").ok
    rows = comm.ask({"request": "status"})["holders"]["rows"]
    assert rows == [["held", "8.0 MiB", "simgpu:0", "ndarray"]], "the popup's table of the names holding GPU memory"
    details = shown["details"]  # the popup's rows beside the state's facts: %gpu status's cells by column
    assert details["lease"] == state["lease"] and details["environment"] == "default", details
    assert details["worker"] in ("idle", "busy") and details["share"] == "0.50" and "GiB" in details["host"]
    again = comm.ask({"request": "acquire", "text": "0.25"})
    assert not again["ok"] and again["message"] == (f"already attached to {state['lease']}; run %gpu release "
                                                     "first, or %gpu acquire 0.25 in a cell to move there")
    released = comm.ask({"request": "release"})
    assert released["ok"] and f"released {state['lease']}" in released["output"], released
    assert comm.last_state()["phase"] == "detached" and comm.last_state()["lease"] is None
    assert comm.outputs_of_requests() == [], "a request's output must not reach any cell"


def test_a_refused_acquire_says_the_magics_words_and_changes_nothing(status):
    kc, comm = status
    comm.state("detached")
    cell = comm.run("%gpu acquire 1.5")
    assert not cell.ok
    bad = comm.ask({"request": "acquire", "text": "1.5"})
    assert not bad["ok"] and bad["message"] == f"Share or count: {cell.reply['evalue']}", (bad, cell.reply)
    huge = comm.ask({"request": "acquire", "text": "0.5 --memory 500GiB"})
    assert not huge["ok"] and "500" in huge["message"], huge
    refused = [d for d in comm.seen if d.get("event") == "refused"][-1]  # sent before the reply
    assert huge["message"] == "Memory: " + refused["message"] and refused["code"]
    for data, words in (({"request": "acquire"}, "say what to acquire"),
                        ({"request": "fly"}, "unknown request 'fly'"),
                        ({"nothing": 1}, "must be {\"request\": KIND}")):
        comm.send(data)
        answer = comm.next(lambda d: "reply" in d)
        assert not answer["ok"] and words in answer["message"], answer
    assert all(d["state"]["phase"] == "detached" for d in comm.seen if "state" in d), comm.seen
    assert comm.run("%gpu status").stdout.startswith("gpupool: not attached")


@pytest.mark.parametrize("text, words", [
    ("", "Share or count: say what to acquire: a fraction of one GPU (0.5) or a count of whole GPUs (2)"),
    (" --memory 20GiB", "Share or count: say what to acquire: a fraction of one GPU (0.5) or a count of whole GPUs (2)"),
    ("0.5 --bogus", "Share or count: unrecognized arguments: --bogus"),
    ("0.5 --memory lots", "Memory: --memory: cannot read 'lots' as a memory size"),
    ("0.5 --idle-timeout soon", "Idle timeout: --idle-timeout: cannot read 'soon' as a duration"),
    # the service's refusal, in the maximum's unit (it said "idle_timeout 4d 3h is above your maximum of 1d")
    ("0.5 --idle-timeout 99h", "Idle timeout: --idle-timeout 99h is above your maximum of 24h (max_idle_timeout"),
    # the pool's refusal of what a field asks, by the service's limit
    ("0.5 --model H100", "Model: the pool has no GPU of model H100; its models: "),
    ("0.5 --memory 500GiB", "Memory: "),
    ("3", "Share or count: "),
])
def test_the_acquire_dialogs_mistakes_name_its_field_and_no_json(status, text, words):
    """The Acquire dialog shows the reply's message under its fields: Share or count, Memory, Model, Idle timeout."""
    _, comm = status
    reply = comm.ask({"request": "acquire", "text": text})
    assert not reply["ok"] and reply["message"].startswith(words) and "{" not in reply["message"], reply
    assert comm.last_state()["phase"] == "detached"


def test_defaults_name_the_pools_models(status):
    _, comm = status
    reply = comm.ask({"request": "defaults"})
    assert reply["ok"] and reply["defaults"]["amount"] == "0.5" and reply["defaults"]["models"] == [MODEL], reply


def test_idle_warning_and_park_come_as_events_and_the_next_cell_resumes(status):
    kc, comm = status
    cell = comm.run("%gpu acquire 0.25 --idle-timeout 4s")
    assert cell.ok, cell.text()
    lease = comm.state("attached")["lease"]
    warning = comm.event("idle_warning")
    assert lease in warning["message"] and "parked" in warning["message"]
    assert lease in comm.event("parked")["message"]
    parked = comm.state("parked")
    assert parked["lease"] == lease and parked["share"] == "0.25 of a GPU"
    cell = comm.run("x = 1")
    assert cell.ok, cell.text()
    assert lease in comm.event("resumed")["message"]
    resumed = comm.state("attached")
    assert resumed["lease"] == lease, "resumed in place"
    assert comm.run("%gpu release").ok
    comm.state("detached")


def test_the_front_end_starts_a_parked_leases_resume_when_the_user_is_back(status):
    """What the JupyterLab extension asks when the user focuses or types in a parked notebook."""
    kc, comm = status
    assert comm.run("%gpu acquire 0.25").ok
    lease = comm.state("attached")["lease"]
    assert comm.run("%gpu park").ok
    assert comm.state("parked")["lease"] == lease
    reply = comm.ask({"request": "resume"})
    assert reply["ok"] and reply["message"] == f"resuming {lease}", reply
    # README: "resumed" comes as a notification and the next cell's first line says it, a click's resume too
    resumed = comm.event("resumed", timeout=60)
    assert re.fullmatch(rf"resumed {lease} on node-1 GPU \d+ in [\d.]+s \(parked [\d.]+s\)", resumed["message"]), resumed
    assert comm.state("attached", timeout=60)["lease"] == lease, "resumed in place before any cell ran"
    assert comm.ask({"request": "resume"})["message"] == "not parked"
    cell = comm.run("y = 2")
    # news, on stdout (JupyterLab shows stderr as a warning)
    assert cell.ok and cell.stdout.splitlines()[0] == f"gpupool: {resumed['message']}", cell.text()
    assert "gpupool:" not in comm.run("y").text(), "said once"
    assert comm.run("%gpu release --discard").ok


def test_a_queued_request_shows_its_place_then_admitted_then_attached(e2e_pool, status):
    from gpupool.wire.leases import LeaseRequest
    from gpupool.units import parse_gpu_amount

    service = e2e_pool[0]
    kc, comm = status
    comm.state("detached")
    client = service.client()
    fraction, count = parse_gpu_amount("2")
    hog = client.create_lease(LeaseRequest(fraction=fraction, gpu_count=count))  # the whole pool
    try:
        comm.send({"request": "acquire", "text": "0.5 --wait 2m", "id": "queued-1"})
        queued = comm.state("queued")
        assert queued["queue_position"] == 1 and queued["share"] == "0.50 of a GPU" and queued["lease"], queued
    finally:
        client.release(hog.id, reason="test: make room")
    admitted = comm.event("admitted", timeout=60)
    assert queued["lease"] in admitted["message"] and "left the queue" in admitted["message"]
    reply = comm.next(lambda d: d.get("id") == "queued-1", timeout=60)
    assert reply["ok"], reply
    assert comm.last_state()["phase"] == "attached" and comm.last_state()["lease"] == queued["lease"]
    assert comm.ask({"request": "release"})["ok"]


def test_a_parked_lease_whose_resume_waits_for_room_stays_parked_and_can_be_given_up(e2e_pool, kernel, status):
    """A parked lease's resume waiting for room (a cell waits for it; the pool is full) reads ``parked``
    with its place in line at every step, as the snapshot says it between them (the cell's wait said
    ``queued``, so the extension greyed out Release); a plain release is answered at once, naming the
    choice (its variables come home only after the resume), and a release with discard gives it up."""
    from gpupool.wire.leases import LeaseRequest

    service = e2e_pool[0]
    km, _ = kernel
    kc, comm = status
    assert comm.run("%gpu acquire 0.25").ok
    lease = comm.state("attached")["lease"]
    assert comm.run("%gpu park").ok
    assert comm.state("parked")["lease"] == lease
    client = service.client()
    hog = client.create_lease(LeaseRequest(fraction=1.0, gpu_count=2))  # the whole pool: no room to resume
    beat = LeaseHeartbeat(client, hog.id, 1.0)  # kept past the heartbeat TTL (3 s)
    beat.start()
    try:
        waiting_cell = kc.execute("x = 1")  # resumes first: waits in line
        waiting = comm.next(lambda d: "state" in d and d["state"]["queue_position"] is not None)["state"]
        assert waiting["phase"] == "parked" and waiting["lease"] == lease and waiting["queue_position"] == 1, waiting
        comm.listen(4)  # beats and the wait's polls meanwhile
        steps = [d["state"] for d in comm.seen if "state" in d]
        assert [s["phase"] for s in steps[steps.index(waiting):]] == ["parked"] * (len(steps) - steps.index(waiting)), \
            [(s["phase"], s["queue_position"]) for s in steps]
        km.interrupt_kernel()  # the cell gives up waiting; the resume stays asked
        reply = kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != waiting_cell:
            reply = kc.get_shell_msg(timeout=30)
        assert reply["content"]["status"] == "error", reply["content"]
        refused = comm.ask({"request": "release"}, timeout=15)  # at once, not once room comes
        assert not refused["ok"] and refused["message"].startswith(
            f"{lease} is parked and its resume waits for room (place 1 in line"), refused
        assert "come home only after the resume" in refused["message"] and "discard" in refused["message"]
        assert comm.last_state()["phase"] == "parked"
        released = comm.ask({"request": "release", "discard": True}, timeout=30)
        assert released["ok"], released
        assert released["message"].startswith(f"gpupool: released {lease}"), released
        assert "its variables were discarded (frozen with its worker, they could come home only after its resume, " \
               "which was still waiting for room)" in released["message"], released
        assert comm.last_state()["phase"] == "detached"
        assert client.get_lease(lease).state.ended
    finally:
        beat.stop()
        client.release(hog.id, reason="test: make room")
