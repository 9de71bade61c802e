"""A parked lease whose resume waits for room (the pool full) and a cell that stops waiting for it
(Ctrl-C): a real gpupool kernel on a real pool (``e2e_pool``: service, one agent with 2 simulated
A100s), driven with jupyter_client and the status comm.

``%gpu release`` says before it waits why it waits and what else there is, and, interrupted,
that nothing was released. A resume that goes on after its cell gave up is said atop the next
cell, timed by the service (the placement to the resumed worker), not by the wait in line.
"""

from __future__ import annotations

import re
import time

import pytest
from interrupting import interrupted_cell
from statuscomm import StatusComm

from gpupool.heartbeat import LeaseHeartbeat
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest

pytestmark = pytest.mark.timeout(240)

#: How long the pool stays full after the interrupt: a clock that counted the wait would say more.
FULL_AFTER_S = 6.0


@pytest.fixture
def parked_in_a_full_pool(e2e_pool, kernel):
    """The notebook attached, ``v = 123``, parked; a lease holding the whole pool (both GPUs), so that
    a resume waits for room. Yields ``(km, comm, lease id, make_room)``; ``make_room()`` releases the hog."""
    service = e2e_pool[0]
    km, kc = kernel
    comm = StatusComm(kc)
    assert comm.run("%gpu acquire 0.25").ok
    lease = comm.state("attached")["lease"]
    assert comm.run("v = 123").ok
    assert comm.run("%gpu park").ok
    client = service.client()
    hog = client.create_lease(LeaseRequest(fraction=1.0, gpu_count=2))
    beat = LeaseHeartbeat(client, hog.id, 1.0)  # kept past the heartbeat TTL (3 s)
    beat.start()
    freed = []

    def make_room() -> None:
        if not freed:
            freed.append(True)
            beat.stop()
            client.release(hog.id, reason="test: make room")

    try:
        yield km, comm, lease, make_room
    finally:
        make_room()
        comm.run("%gpu release --discard")


def resumed_in(text: str, lease: str) -> float:
    """The seconds of the ``resumed LEASE on node-1 GPU i in X.Xs (parked ...)`` line in ``text``."""
    found = re.search(rf"gpupool: resumed {lease} on node-1 GPU \d in (\d+\.\d)s \(parked ", text)
    assert found, text
    return float(found.group(1))


def test_an_interrupted_release_says_why_it_waited_and_releases_nothing(e2e_pool, parked_in_a_full_pool):
    km, comm, lease, make_room = parked_in_a_full_pool
    client = e2e_pool[0].client()
    cell, before = interrupted_cell(comm, km, "%gpu release", once="in line")
    said = (f"gpupool: %gpu release brings the variables home from {lease}'s worker, frozen on node-1, which must "
            "resume first: waiting for room (Ctrl-C stops waiting, releasing nothing; %gpu release --discard gives "
            "it up now, its variables lost)")
    assert said in before and before.index(said) < before.index("in line"), "said before the wait's progress"
    text = cell.text()
    assert not cell.ok and (f"interrupted: {lease} was not released; it stays parked on node-1 with its "
                            "variables, its resume withdrawn (the next cell asks it again)") in text, text
    assert "the next cell runs on it" not in text, text
    seen = client.get_lease(lease)
    assert seen.state is LeaseState.parked and not seen.parked["resume_requested"], seen.events
    make_room()
    time.sleep(1.0)  # sweeps that would have resumed it
    assert client.get_lease(lease).state is LeaseState.parked, "room came, and the withdrawn resume did not take it"
    assert comm.last_state()["phase"] == "parked"


def test_a_resume_done_after_its_cell_gave_up_is_said_atop_the_next_cell(e2e_pool, parked_in_a_full_pool):
    km, comm, lease, make_room = parked_in_a_full_pool
    client = e2e_pool[0].client()
    cell, _ = interrupted_cell(comm, km, "print(v)", once="in line")
    assert not cell.ok and "interrupted while waiting" in cell.text(), cell.text()
    time.sleep(FULL_AFTER_S)
    make_room()  # the resume asked goes on: the service resumes it in place
    comm.event("resumed", timeout=60)  # the heartbeat saw it
    assert client.get_lease(lease).state is LeaseState.active
    after = comm.run("print(v)")
    assert after.ok and after.stdout.strip().splitlines()[-1] == "123", after.text()
    assert resumed_in(after.text(), lease) < FULL_AFTER_S, "the resume's own time, not the wait in line"
    assert after.text().count(f"resumed {lease}") == 1, after.text()
