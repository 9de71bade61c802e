"""A move from memory, the agents' side (docs/parking.md, "The agent's
part"): two real agents on this host (two nodes: their own state, spill
folders and simulated GPUs, one agent token), real workers. The new node,
asked ``POST /workers/{id}/resume`` with ``move_from``, asks the old one's
offer (``POST /workers/{id}/offer``) and its new worker takes the namespace
from the old worker's data plane, worker to worker: no disk on either side.

What is checked: the variables arrive (a plain value, a NumPy array of several
chunks, a simulated GPU array back on the new node's GPU, a cell's result as
``Out[n]`` and ``_n``) and what cannot be pickled is named; nothing is written to either spill folder; the old worker
stays until its ``DELETE``, which frees its host copy; another owner's
resume and a move from an agent with no such worker leave both nodes as
they were; an offer nobody takes is spilled to disk, and that lease resumes
where it is with its variables.
"""

from __future__ import annotations

import time

import pytest

from frontend import run
from parkagent import MiB, ParkAgent, agent_pair
from test_spill_move import cell

pytestmark = pytest.mark.timeout(300)

STATE = """
import threading
import numpy as np
from gpupool.node import simgpu
x = 41
arr = np.arange(1_500_000, dtype='int64') * 3
gpu = simgpu.zeros(8 * 2**20, 'uint8'); gpu[::4096] = 7
lock = threading.Lock()
"""
CHECK = ("import os; print(x + 1, int(arr.sum()), arr.dtype, simgpu.device_of(gpu), int(gpu.sum()), "
         "os.environ['GPUPOOL_NODE'])")

#: Seconds an offer waits for its node before the old agent spills it (the nodes' spill_fetch_timeout).
OFFER_WAIT_S = 8


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Two agents, node A and node B, each with two simulated GPUs of its own."""
    with agent_pair(tmp_path_factory.mktemp("warm-move"), (f"--AgentParking.spill_fetch_timeout={OFFER_WAIT_S}",)) \
            as pair:
        yield pair


def spills(agent: ParkAgent) -> list[str]:
    folder = agent.state_dir / "spill"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def parked_in_memory(agent: ParkAgent, lease: str) -> dict:
    """A worker on ``agent`` for ``lease`` holding STATE, parked in memory; its report."""
    kc = agent.client(agent.start_worker(lease)["connection"])
    cell(kc, STATE)
    run(kc, "x * 2", timeout=60)  # a result the cell showed: Out[2]
    status, parked = agent.park(lease, reason="its node has no room")
    assert status == 200 and parked["tier"] == "memory", parked
    assert agent.inventory().metrics()[0]["memory_used"] == 0, "its GPU memory is in host memory"
    return agent.reports()[lease]


def test_a_lease_parked_in_memory_moves_to_another_node_worker_to_worker(nodes):
    a, b = nodes
    old = parked_in_memory(a, "L-warm")

    # Another owner's resume of that lease id changes nothing on either node.
    status, refused = b.resume("L-warm", owner="bob", move_from=a.url)
    assert (status, refused["error"]) == (409, "invalid_state"), refused
    assert "is not bob's: nothing moved, nothing changed" in refused["message"], refused
    assert "L-warm" not in b.reports() and a.reports()["L-warm"] == old

    status, resumed = b.resume("L-warm", move_from=a.url + "/")
    assert status == 200 and resumed["tier"] == "memory", resumed
    assert [w.split(":")[0] for w in resumed["lost"]] == ["lock"], resumed["lost"]
    assert "cannot be moved" in resumed["lost"][0], resumed["lost"]
    kc = b.client(resumed["connection"])
    out = cell(kc, CHECK)
    assert out.split() == ["42", str(3 * sum(range(1_500_000))), "int64", "0", str(7 * 2048), b.name]
    assert cell(kc, "print(Out[2], _2)").split() == ["82", "82"], "the cells' results went along"
    assert b.inventory().process_memory().get(resumed["pid"]) == 8 * MiB, "the GPU array is on node B's GPU"
    assert (spills(a), spills(b)) == ([], []), "no disk on either side"
    log = b.log.read_text()
    assert f"moved lease L-warm from {a.url} into a new worker" in log and "fetched the spill" not in log
    again = b.resume("L-warm", move_from=a.url)
    assert again[0] == 200 and again[1]["pid"] == resumed["pid"], "asked again: the moved worker, as it is"

    # Node A keeps its worker (thawed, offered) until the service's DELETE there.
    assert a.reports()["L-warm"]["parked"] == "memory"
    assert a.call("DELETE", "/workers/L-warm")[0] == 200
    assert "L-warm" not in a.reports() and spills(a) == []
    assert not list((a.simgpu / ".parked").glob("L-warm*")), "the host copy went with the worker"
    assert b.call("DELETE", "/workers/L-warm")[0] == 200


def test_a_move_from_an_agent_without_that_worker_leaves_nothing_on_the_new_node(nodes):
    a, b = nodes
    status, refused = b.resume("L-none", move_from=a.url)
    assert (status, refused["error"]) == (502, "park_failed"), refused
    assert refused["message"].startswith(f"could not move lease L-none from {a.url} worker to worker: HTTP 404"), \
        refused
    assert refused["message"].endswith("; it stays parked on the other node"), refused
    assert "L-none" not in b.reports() and spills(b) == []
    status, refused = b.resume("L-none", move_from="ftp://node-a")
    assert (status, refused["error"]) == (400, "bad_request") and "'move_from'" in refused["message"]


def test_an_offer_no_node_takes_is_spilled_and_resumes_where_it_is(nodes):
    a, _ = nodes
    parked_in_memory(a, "L-left")
    status, offered = a.call("POST", "/workers/L-left/offer", {"owner": "ann"})
    assert status == 200 and offered["stream"]["sizes"], offered
    assert a.call("POST", "/workers/L-left/offer", {"owner": "bob"})[0] == 409
    deadline = time.monotonic() + OFFER_WAIT_S + 30
    while a.reports()["L-left"]["parked"] != "disk":
        assert time.monotonic() < deadline, a.reports()["L-left"]
        time.sleep(0.5)
    assert "no node took it within" in a.log.read_text()
    status, resumed = a.resume("L-left")
    assert status == 200 and resumed["tier"] == "disk", resumed
    assert cell(a.client(resumed["connection"]), "print(x + 1, int(gpu.sum()), Out[2])").split() == [
        "42", str(7 * 2048), "82"]
    assert a.call("DELETE", "/workers/L-left")[0] == 200
