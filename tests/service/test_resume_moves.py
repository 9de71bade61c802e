"""A parked lease whose node has no room resumes on another node: a cold move
(``c.PoolLeases.resume_moves``; docs/parking.md), end to end: a real ``gpupool
service``, real agents on simulated A100s (the ``simulated`` checkpointer),
real ipykernel workers whose cells run through a jupyter_client.

What is checked: a lease parked in memory on node-1, node-1 then taken by
another lease, resumes on node-2 with its variable, the events naming the
move and what could not be saved (a held lock), and node-1's agent holds
neither a worker nor a spill of it afterwards; with ``resume_moves = False``
it waits for node-1 while node-2 is free; node-1's agent killed with -9
before the resume leaves it parked on node-1, in words, node-2's share free
again.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from frontend import run
from procs import free_port, processes_mentioning, start_agent, start_service, wait_for
from service_api import gpu_allocations, register
from statuscomm import StatusComm
from workercell import worker_client
from two_nodes import (AGENT_ARGS, BIG_STATE, acquire, notebook, simgpu_root, two_node_pool,  # noqa: F401
                       two_nodes, two_nodes_beating, until)

from gpupool.schema import LeaseState
from gpupool.tables import lease_table
from gpupool.wire.leases import Lease

pytestmark = pytest.mark.timeout(300)

#: What the worker holds before its park: a value, and a held lock, which a spill cannot save.
STATE = "import threading\nx = 41\nlock = threading.Lock(); lock.acquire()\nprint('set')"


def cell(connection: dict, code: str) -> str:
    kc = worker_client(connection)
    try:
        done = run(kc, code, timeout=60)
        assert done.ok, done.text()
        return done.stdout
    finally:
        kc.stop_channels()


def parked_on_a_full_node_1(svc, both_nodes: bool = True, state: str = STATE) -> tuple[Lease, Lease]:
    """A lease parked in memory on node-1 with ``state`` (``x = 41`` and a held lock), and a lease
    that took node-1's GPU since (with ``both_nodes``, one on node-2 first, released at once: the
    parked lease's claim on node-1 sends new leases elsewhere while other room fits)."""
    lease = acquire(svc)
    assert lease.node == "node-1"  # both empty: by name
    assert cell(lease.connection, state).strip() == "set"
    parked = svc.client().park(lease.id)
    assert (parked.state, parked.parked["tier"]) == (LeaseState.parked, "memory"), parked.events
    elsewhere = acquire(svc) if both_nodes else None
    assert elsewhere is None or elsewhere.node == "node-2"
    taker = acquire(svc)
    assert taker.node == "node-1"
    if elsewhere is not None:
        svc.client().release(elsewhere.id)
    return parked, taker


def parked_bytes(svc) -> dict[str, int]:
    """Node -> the host bytes ``GET /pool`` says its parked (or moving away) leases hold there."""
    return {node["name"]: node["parked_host_bytes"] for node in svc.client().pool()["nodes"]}


def agent_has(svc, agent, lease_id: str) -> list[str]:
    """What ``agent`` holds of ``lease_id``: its worker (``GET /workers``), its spill folder."""
    from parkagent import call

    token = (svc.state_dir / "agent_token").read_text().strip()
    status, reply = call(f"{agent.url}/workers", token=token)
    assert status == 200, reply
    held = ["worker"] if any(w["lease_id"] == lease_id for w in reply["workers"]) else []
    return held + (["spill"] if (agent.state_dir / "spill" / lease_id).exists() else [])


def test_a_parked_lease_whose_node_is_full_resumes_on_another_node_with_its_variables(two_nodes):
    svc, node_1, _ = two_nodes
    parked, taker = parked_on_a_full_node_1(svc)
    assert gpu_allocations(svc) == [1.0, 0.0]
    svc.client().resume(parked.id)
    moved = until(svc, parked.id, "active")
    assert (moved.node, [g["index"] for g in moved.gpus]) == ("node-2", [0])
    words = [e["reason"] for e in moved.events]
    assert ("moving to node-2 (GPU 0 (NVIDIA A100-SXM4-80GB)): node-1 has no room; its state goes from its worker "
            "on node-1 to a new worker on node-2, worker to worker (what cannot be moved is named)") in words, words
    resumed = words[-1]
    assert resumed.startswith("resumed on node-2 (moved from node-1) from memory in "), resumed
    assert resumed.endswith("; not kept: lock: _thread.lock cannot be moved: cannot pickle '_thread.lock' object"), \
        resumed
    assert cell(moved.connection, "print(x + 1)").strip() == "42"
    assert gpu_allocations(svc) == [1.0, 1.0]
    wait_for(lambda: agent_has(svc, node_1, parked.id) == [], 15, "node-1's worker of the moved lease gone")
    assert "spilled the worker" not in node_1.log.read_text(), "worker to worker: no disk"
    for lease in (moved, taker):
        svc.client().release(lease.id)


#: ``STATE`` and a value whose pickling takes 4 s: node-1's offer of it outlasts node-2's wait (2 s).
SLOW_STATE = STATE.replace("\nprint('set')", "\nimport time\nclass Slow:\n    def __reduce__(self):\n"
                           "        time.sleep(4)\n        return (int, (7,))\nslow = Slow()\nprint('set')")


def test_a_move_from_memory_that_fails_goes_through_the_old_nodes_disk(tmp_path, simgpu_root):
    with two_node_pool(tmp_path, node_2_args=("--AgentParking.spill_fetch_timeout=2",)) as (svc, node_1, _):
        parked, taker = parked_on_a_full_node_1(svc, state=SLOW_STATE)
        svc.client().resume(parked.id)
        moved = until(svc, parked.id, "active", timeout=120)
        resumed = moved.events[-1]["reason"]
        assert resumed.startswith("resumed on node-2 (moved from node-1) from disk in "), moved.events
        assert "lock: _thread.lock cannot be saved to disk" in resumed, resumed
        assert cell(moved.connection, "print(x + 1, slow)").split() == ["42", "7"]
        assert (f"lease {parked.id}: its move from node-1's memory to node-2 failed (could not move lease "
                f"{parked.id} from {node_1.url} worker to worker: it did not offer it within 2 s") in svc.log.read_text()
        wait_for(lambda: agent_has(svc, node_1, parked.id) == [], 15, "node-1's spill of the moved lease gone")
        for lease in (moved, taker):
            svc.client().release(lease.id)


@pytest.mark.parametrize("two_nodes_beating", [60.0], indirect=True)
def test_a_lease_released_while_it_moves_leaves_nothing_on_either_node(two_nodes_beating):
    """Released while its 400 MiB move from memory runs (node-1 has offered it; the release finds the
    lease on node-2, whose new worker is taking it): the move's end removes the old worker on
    node-1 (``DELETE``) and the new one on node-2 goes too, not a heartbeat (a minute apart here)
    after."""
    svc, node_1, node_2 = two_nodes_beating
    lease = acquire(svc)
    assert cell(lease.connection, BIG_STATE).strip() == "set"
    assert svc.client().park(lease.id).state is LeaseState.parked
    elsewhere, taker = acquire(svc), acquire(svc)
    assert (elsewhere.node, taker.node) == ("node-2", "node-1")
    svc.client().release(elsewhere.id)
    moving = svc.client().resume(lease.id)
    assert (moving.state, moving.parked["moving_from"]) == (LeaseState.starting, "node-1")
    wait_for(lambda: f"offered the namespace of lease {lease.id}" in node_1.log.read_text(), 60, "the move's offer")
    assert svc.client().release(lease.id).state is LeaseState.released
    wait_for(lambda: (agent_has(svc, node_1, lease.id), agent_has(svc, node_2, lease.id)) == ([], []), 30,
             "the released lease's workers on both nodes gone")
    svc.client().release(taker.id)


@pytest.mark.parametrize("two_nodes_beating", [5.0], indirect=True)
def test_a_spill_no_lease_holds_is_removed_at_its_nodes_next_heartbeat(two_nodes_beating):
    """A spill left behind (its lease ended, and the move's ``DELETE`` lost) goes with the node's next
    heartbeat: the service answers the report of it with a stop, as for a running worker no lease
    holds. Made here through node-1's agent API, for a lease the service never had (a beat that
    came while its worker ran stops that worker: then again with another)."""
    from parkagent import call

    svc, node_1, _ = two_nodes_beating
    token = (svc.state_dir / "agent_token").read_text().strip()
    gpu = next(node for node in svc.client().pool()["nodes"] if node["name"] == "node-1")["gpus"][0]["uuid"]
    for _ in range(5):
        lease_id = f"L-{uuid.uuid4().hex[:12]}"
        status, started = call(f"{node_1.url}/workers", "POST", {"lease_id": lease_id, "owner": "ann", "gpus": [gpu],
                                                                "fraction": 0.5, "memory": 2**30}, token=token)
        assert status == 201, started
        status, spilled = call(f"{node_1.url}/workers/{lease_id}/park", "POST", {"tier": "disk"}, token=token)
        time.sleep(0.5)  # a stop of the running worker that came during the spill is done by now
        if status == 200 and agent_has(svc, node_1, lease_id) == ["worker", "spill"]:
            break
    assert (status, spilled["tier"]) == (200, "disk") and spilled["disk_bytes"] > 0, spilled
    assert agent_has(svc, node_1, lease_id) == ["worker", "spill"], "spilled, with no stop during the spill"
    wait_for(lambda: agent_has(svc, node_1, lease_id) == [], 15, "the spill no lease holds removed")
    assert f"removed the spill of lease {lease_id}" in node_1.log.read_text()


def test_with_moves_off_it_waits_for_its_own_node(tmp_path, simgpu_root):
    """node-2 (an agent address only) is free, but the lease waits for node-1."""
    svc = start_service(tmp_path, config={"node_ttl": 3600, "heartbeat_ttl": 600, "resume_moves": False,
                                          "worker_stop_timeout": 5.0})
    agent = None
    try:
        agent = start_agent(tmp_path, svc, name="node-1", simulate="1xA100-80GB", extra_args=AGENT_ARGS)
        parked, taker = parked_on_a_full_node_1(svc, both_nodes=False)
        register(svc, "node-2", gpus=1, url=f"http://127.0.0.1:{free_port()}")
        waiting = svc.client().resume(parked.id)
        time.sleep(1.5)  # several of the queue's drains (every reclaim sweep, 0.2 s here)
        waiting = svc.client().get_lease(parked.id)
        assert (waiting.state, waiting.node, waiting.parked["resume_requested"]) == (LeaseState.parked, "node-1",
                                                                                      True), waiting.events
        assert waiting.queue_position == 1 and not any("moving" in e["reason"] for e in waiting.events)
        assert waiting.parked["may_move"] is False
        from gpupool.leasewait import progress_words
        assert progress_words(waiting).startswith("parked on node-1, waiting for room there: 1st in line"), \
            "with moves off the words name its own node only"
        assert gpu_allocations(svc) == [1.0, 0.0]
        svc.client().release(taker.id)  # its own node's room: it resumes there, from memory
        back = until(svc, parked.id, "active")
        assert back.node == "node-1" and back.events[-1]["reason"].startswith("resumed on node-1 from memory")
        assert cell(back.connection, "print(x + 1, lock.locked())").split() == ["42", "True"]
        svc.client().release(back.id)
    finally:
        if agent is not None:
            agent.stop()
        svc.stop()


def test_a_move_whose_old_agent_is_gone_leaves_it_parked_on_its_node(two_nodes):
    svc, node_1, _ = two_nodes
    parked, taker = parked_on_a_full_node_1(svc)
    node_1.proc.send_signal(signal.SIGKILL)  # no last heartbeat: node-1 stays up for the service
    node_1.proc.wait()
    try:
        svc.client().resume(parked.id)
        back = wait_for(lambda: (seen := svc.client().get_lease(parked.id)).state is LeaseState.parked
                        and len(seen.events) >= 2 and seen, 30, "placed to move, then parked again")
        states = [e["state"] for e in back.events]
        assert states[-2:] == ["starting", "parked"], back.events
        assert back.events[-2]["reason"].startswith("moving to node-2"), back.events
        why = back.events[-1]["reason"]
        assert why.startswith(f"it could not move to node-2: the agent on node-1 did not spill it to disk (the node "
                              f"agent at {node_1.url}/workers/{parked.id}/park could not be reached"), why
        assert why.endswith("it stays parked on node-1: resume again to retry"), why
        assert back.node == "node-1" and back.parked["tier"] == "memory" and not back.parked["resume_requested"]
        assert back.parked["since"] == parked.parked["since"], "parked since its park, not since the failed move"
        assert gpu_allocations(svc) == [1.0, 0.0], "node-2's share free again"
        svc.client().release(taker.id)
        svc.client().release(parked.id)
    finally:
        # The killed agent's workers (the frozen one too) are this test's to end.
        for pid in processes_mentioning(str(node_1.state_dir)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for(lambda: not processes_mentioning(str(node_1.state_dir)), 15, "node-1's workers gone")


def notebook_parked_on_a_full_node_1(svc, comm: StatusComm) -> tuple[str, Lease]:
    """The notebook's lease (id) parked on node-1 holding :data:`STATE`, and the lease that took node-1
    since (the parked lease's claim sends a first new lease to node-2, released at once)."""
    assert comm.run("%gpu acquire 1").ok
    lease_id = svc.client().list_leases()[0].id
    assert comm.run(STATE).ok
    assert comm.run("%gpu park").ok
    elsewhere, taker = acquire(svc), acquire(svc)
    assert (elsewhere.node, taker.node) == ("node-2", "node-1"), "node-1 taken while the lease is parked"
    svc.client().release(elsewhere.id)
    return lease_id, taker


def test_a_notebook_whose_parked_lease_moved_goes_on_on_the_other_node(two_nodes, tmp_path):
    """The gpupool kernel's next cell after a park, with node-1 taken meanwhile, resumes the lease on
    node-2 (a cold move), reconnects to the new worker there and finds what pickles; it says where
    the lease went and what was not kept (the status comm said the move while it went), and %gpu status
    shows the new node."""
    svc, _, _ = two_nodes
    with notebook(svc, tmp_path) as (_, comm):  # the JupyterLab extension's comm: its notification says the move too
        lease_id, taker = notebook_parked_on_a_full_node_1(svc, comm)
        after = comm.run("import os\nprint(x + 1, os.environ['GPUPOOL_LEASE_ID'])", timeout=120)
        assert after.ok, after.text()
        notified = comm.event("resumed")["message"]
        assert notified == f"resumed {lease_id} on node-2 (moved from node-1, which had no room)", notified
        moving = [d["state"] for d in comm.seen if d.get("state", {}).get("moving_from")]
        assert moving and {(m["phase"], m["moving_from"], m["node"]) for m in moving} == {("parked", "node-1", "node-2")}, \
            "while it moved, the status bar was told from where to where"
        assert f"gpupool: resumed {lease_id} on node-2 GPU 0 in " in after.stdout, after.text()
        assert ": moved from node-1, which had no room; not kept: " in after.stdout and "lock" in after.stdout, \
            "where it went, and what the move could not keep, is said"
        assert after.stdout.strip().splitlines()[-1].split() == ["42", lease_id], after.text()
        assert "node-2" in comm.run("%gpu status").text()
        svc.client().release(taker.id)


def test_a_cell_whose_lease_cannot_move_says_why_and_stops_waiting_after_a_few_tries(two_nodes, tmp_path):
    """node-1's agent killed (-9: no last heartbeat, so node-1 stays up for the service) after the park:
    each move to node-2 fails (neither the offer nor the spill can be asked there) and leaves the lease
    parked. The cell says each failure and asks again, and after RESUME_TRIES tries it stops waiting
    with the last failure's words; the lease stays parked."""
    svc, node_1, _ = two_nodes
    try:
        with notebook(svc, tmp_path) as (_, comm):
            lease_id, taker = notebook_parked_on_a_full_node_1(svc, comm)
            node_1.proc.send_signal(signal.SIGKILL)
            node_1.proc.wait()
            began = time.monotonic()
            done = comm.run("print(x + 1)", timeout=120)
            text = done.text()
            assert not done.ok and time.monotonic() - began < 60, text
            assert text.count("did not spill it to disk") >= 3 and text.count("; asking again") == 2, text
            assert f"the pool tried to resume {lease_id} 3 times and it stayed parked; the last try: it could not " \
                   "move to node-2" in text and "%gpu release --discard gives it up" in text, text
            assert svc.client().get_lease(lease_id).state is LeaseState.parked
            svc.client().release(taker.id)
    finally:
        for pid in processes_mentioning(str(node_1.state_dir)):  # the killed agent's workers are this test's to end
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for(lambda: not processes_mentioning(str(node_1.state_dir)), 15, "node-1's workers gone")


def test_a_resume_asked_in_jupyterlab_waits_for_its_node_and_the_next_cell_moves_it(two_nodes, tmp_path):
    """The JupyterLab extension asks for the resume when the user is back (``{"request": "resume"}``
    on the status comm), in place: a move would lose what cannot be saved to disk (the held lock)
    before any cell needs the worker, so it waits for node-1 though node-2 is free, and says so; the
    next cell moves it, saying what was not kept, and %gpu park parks it there."""
    svc, _, _ = two_nodes
    with notebook(svc, tmp_path) as (_, comm):
        lease_id, taker = notebook_parked_on_a_full_node_1(svc, comm)
        comm.ask({"request": "resume"})
        wait_for(lambda: svc.client().get_lease(lease_id).parked["resume_requested"], 10, "the resume asked")
        time.sleep(1.0)  # five sweeps (c.PoolLeases.reclaim_interval 0.2 s here), any of which would move it
        waiting = svc.client().get_lease(lease_id)
        assert (waiting.state, waiting.node, waiting.parked["may_move"]) == (LeaseState.parked, "node-1", False)
        assert "its resume waits for room on node-1 (" in lease_table([waiting])[0], lease_table([waiting])[0]
        after = comm.run("print(x + 1)", timeout=120)
        text = after.text()
        assert after.ok and text.strip().splitlines()[-1] == "42", text
        assert "moved from node-1, which had no room; not kept: lock" in text, text
        assert svc.client().get_lease(lease_id).node == "node-2"
        parked = comm.run("%gpu park")
        assert parked.ok and "parked already" not in parked.text(), parked.text()
        assert (svc.client().get_lease(lease_id).state, svc.client().get_lease(lease_id).node) == \
            (LeaseState.parked, "node-2")
        svc.client().release(taker.id)


def test_a_move_whose_old_agent_stops_answering_gives_up_once_its_node_is_lost(tmp_path, simgpu_root):
    """node-1's agent stopped (SIGSTOP: it accepts connections and never answers) as the move starts:
    once the service marks node-1 lost (node_ttl 3 s) the move fails, long before the park timeout
    (120 s here), and node-2's share is free again."""
    svc = start_service(tmp_path, config={"node_ttl": 3.0, "heartbeat_ttl": 600, "worker_park_timeout": 120.0,
                                          "parked_node_grace": 600.0, "worker_stop_timeout": 5.0})
    agents = []
    try:
        agents += [start_agent(tmp_path, svc, name=name, simulate="1xA100-80GB", extra_args=AGENT_ARGS)
                   for name in ("node-1", "node-2")]
        parked, taker = parked_on_a_full_node_1(svc)
        agents[0].proc.send_signal(signal.SIGSTOP)
        try:
            held = parked_bytes(svc)
            assert held["node-1"] > 0 and held["node-2"] == 0, held
            asked = time.monotonic()
            moving = svc.client().resume(parked.id)
            assert (moving.state, moving.node) == (LeaseState.starting, "node-2"), moving.events
            assert parked_bytes(svc) == held, "until its spill, its frozen worker's RAM is counted on node-1"
            back = wait_for(lambda: (seen := svc.client().get_lease(parked.id)).state is LeaseState.parked
                            and len(seen.events) >= 2 and seen, 60, "placed to move, then parked again")
            assert time.monotonic() - asked < 30, "given up once node-1 was lost, not at the park timeout"
            why = back.events[-1]["reason"]
            assert "node node-1 was lost (no heartbeat for c.PoolNodes.node_ttl)" in why, why
            assert back.node == "node-1" and gpu_allocations(svc) == [1.0, 0.0], "node-2's share free again"
        finally:
            agents[0].proc.send_signal(signal.SIGCONT)
        svc.client().release(taker.id)
        svc.client().release(parked.id)
    finally:
        for agent in reversed(agents):
            agent.stop()
        svc.stop()


def test_with_moves_off_a_resume_takes_the_room_pressure_frees_on_its_node(tmp_path, simgpu_root):
    """node-1's GPU taken while the lease is parked; its resume presses on the taker, which is
    parked early after the pressure grace (1 s here), and the resume takes the room it frees there:
    its default host share (the whole host of this one-GPU node) gives way to the taker's parked
    state as a new lease's does, where its old share would never fit beside it again."""
    svc = start_service(tmp_path, config={"node_ttl": 3600, "heartbeat_ttl": 600, "resume_moves": False,
                                          "pressure_grace": 1.0, "worker_stop_timeout": 5.0})
    agent = None
    try:
        agent = start_agent(tmp_path, svc, name="node-1", simulate="1xA100-80GB", extra_args=AGENT_ARGS)
        parked, taker = parked_on_a_full_node_1(svc, both_nodes=False)
        svc.client().resume(parked.id)
        back = until(svc, parked.id, "active", timeout=60)
        assert back.node == "node-1" and cell(back.connection, "print(x + 1)").strip() == "42"
        assert svc.client().get_lease(taker.id).state is LeaseState.parked, "the taker was parked early"
        svc.client().release(taker.id)
        svc.client().release(back.id)
    finally:
        if agent is not None:
            agent.stop()
        svc.stop()


#: A state whose move takes seconds (its spill, fetch and load), so that a release finds it moving.


@pytest.mark.parametrize("discard", [False, True])
def test_a_release_during_a_move_says_what_becomes_of_the_variables(two_nodes, tmp_path, discard):
    """The lease is parked and moved behind the notebook's back (its heartbeat has not shown the park
    yet): %gpu release asks the service first, so it neither pulls from the worker that is frozen or
    gone nor waits on it. Without --discard it says the move, follows it with progress and brings the
    variables home from node-2; with --discard it answers at once, saying the variables were discarded
    with the state on node-1's disk, which goes."""
    svc, node_1, _ = two_nodes
    with notebook(svc, tmp_path) as (_, comm):
        assert comm.run("%gpu acquire 1").ok
        lease_id = svc.client().list_leases()[0].id
        assert comm.run(BIG_STATE, timeout=120).ok
        assert svc.client().park(lease_id).state is LeaseState.parked
        elsewhere, taker = acquire(svc), acquire(svc)
        assert (elsewhere.node, taker.node) == ("node-2", "node-1")
        svc.client().release(elsewhere.id)
        moving = svc.client().resume(lease_id)
        assert (moving.state, moving.node, moving.parked["moving_from"]) == (LeaseState.starting, "node-2", "node-1")
        asked = time.monotonic()
        done = comm.run("%gpu release --discard" if discard else "%gpu release", timeout=120)
        took, text = time.monotonic() - asked, done.text()
        assert done.ok, text
        gone = svc.client().get_lease(lease_id)
        assert gone.state is LeaseState.released, gone.events
        if discard:
            assert took < 3.0, f"answered at once, not after the move: {took:.1f}s"
            assert (f"released {lease_id} after " in text and "; it was moving from node-1 to node-2: its variables "
                    "were discarded (its worker on node-1, which held its state, is ended, nothing of it stays on "
                    "node-2)") \
                in text, text
            assert "active" not in [e["state"] for e in gone.events[-3:]], "not resumed to be released"
            wait_for(lambda: agent_has(svc, node_1, lease_id) == [], 15, "node-1's spill of the released lease gone")
        else:
            assert f"{lease_id} is moving from node-1 to another node" in text, text
            assert "moving to node-2 from node-1 (a new worker there takes its state, worker to worker)" in text, text
            assert "brought back 2 variables (big, x; 400.0 MiB)" in text, text
            assert "threading" in text and "lock" in text, "what the move could not keep is said"
        svc.client().release(taker.id)
