"""A cold move of a spilled lease to another node, the agents' side
(docs/parking.md, "The agent's part"): two real agents on this host (two
nodes: their own state, spill folders and simulated GPUs, one agent token),
real workers. The old node serves the spill (``GET /workers/{id}/spill`` and
``.../spill/namespace``); the new one, asked ``POST /workers/{id}/resume``
with ``spill_from``, fetches it node to node and loads it into a new worker.

What is checked: the variables arrive (a plain value, a NumPy array of several
chunks, a simulated GPU array back on the new node's GPU); the old node keeps
the spill until its ``DELETE``; another owner's resume gets 409 and a fetch
that fails gets 502 in words, neither leaving anything on the new node; the
spill endpoints serve only spills, and only for the agent token.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from frontend import run
from gpupool.demo_pool import free_port
from parkagent import MiB, TOKEN, ParkAgent, agent_pair

pytestmark = pytest.mark.timeout(300)

STATE = """
import numpy as np
from gpupool.node import simgpu
x = 41
arr = np.arange(1_500_000, dtype='int64') * 3
gpu = simgpu.zeros(8 * 2**20, 'uint8'); gpu[::4096] = 7
"""


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Two agents, node A and node B, each with two simulated GPUs of its own."""
    with agent_pair(tmp_path_factory.mktemp("spill-move")) as pair:
        yield pair


def cell(kc, code: str) -> str:
    done = run(kc, code, timeout=120)
    assert done.ok, done.text()
    return done.stdout


def nothing_of(agent: ParkAgent, lease: str) -> None:
    """``agent`` has no worker, no spill and no simulated GPU memory held for ``lease``."""
    assert lease not in agent.reports()
    assert not (agent.state_dir / "spill" / lease).exists()
    assert [g["memory_used"] for g in agent.inventory().metrics()] == [0, 0]


def test_a_spilled_lease_moves_to_another_node_with_its_variables(nodes):
    a, b = nodes
    kc = a.client(a.start_worker("L-move")["connection"])
    cell(kc, STATE)
    status, parked = a.park("L-move", tier="disk", reason="its node has no room")
    assert status == 200 and parked["tier"] == "disk", parked

    status, manifest = a.call("GET", "/workers/L-move/spill")
    assert status == 200, manifest
    assert (manifest["lease_id"], manifest["owner"], manifest["lost"]) == ("L-move", "ann", [])
    assert {"x", "arr", "gpu"} <= set(manifest["names"]) and "folder" not in manifest
    assert manifest["namespace_bytes"] == manifest["disk_bytes"] > 12 * MiB

    # Another owner's resume of that lease id gets nothing of it.
    status, refused = b.resume("L-move", owner="bob", spill_from=a.url)
    assert (status, refused["error"]) == (409, "invalid_state"), refused
    assert f"the spill of lease L-move at {a.url} is not bob's" in refused["message"]
    nothing_of(b, "L-move")

    status, resumed = b.resume("L-move", spill_from=a.url + "/")
    assert status == 200 and resumed["tier"] == "disk" and resumed["lost"] == [], resumed
    kc = b.client(resumed["connection"])
    out = cell(kc, "import os; print(x + 1, int(arr.sum()), arr.dtype, simgpu.device_of(gpu), int(gpu.sum()), "
                   "os.environ['GPUPOOL_NODE'])")
    assert out.split() == ["42", str(3 * sum(range(1_500_000))), "int64", "0", str(7 * 2048), b.name]
    assert b.inventory().process_memory().get(resumed["pid"]) == 8 * MiB, "the GPU array is on node B's GPU"
    report = b.reports()["L-move"]
    assert (report["pid"], report["parked"]) == (resumed["pid"], None)
    assert not (b.state_dir / "spill" / "L-move").exists(), "the fetched copy goes once loaded"
    assert f"fetched the spill of lease L-move from {a.url}" in b.log.read_text()
    again = b.resume("L-move", spill_from=a.url)
    assert again[0] == 200 and again[1]["pid"] == resumed["pid"], "asked again: the moved worker, as it is"

    # Node A keeps the spill until the service's DELETE there.
    assert a.reports()["L-move"]["parked"] == "disk" and (a.state_dir / "spill" / "L-move").is_dir()
    assert a.call("DELETE", "/workers/L-move") == (200, {"lease_id": "L-move", "exit_code": None})
    assert not (a.state_dir / "spill" / "L-move").exists() and a.call("GET", "/workers/L-move/spill")[0] == 404
    assert b.call("DELETE", "/workers/L-move")[0] == 200


def test_a_spill_that_cannot_be_fetched_leaves_nothing_on_the_new_node(nodes):
    a, b = nodes
    nowhere = f"http://127.0.0.1:{free_port()}"
    for url, words in ((nowhere, "cannot reach it"),
                       (a.url, "HTTP 404: lease L-gone has no spill on this node")):
        status, refused = b.resume("L-gone", spill_from=url)
        assert (status, refused["error"]) == (502, "park_failed"), refused
        assert refused["message"].startswith(f"could not fetch the spill of lease L-gone from {url}: {words}"), refused
        assert refused["message"].endswith("; it stays on the other node"), refused
        nothing_of(b, "L-gone")
    status, refused = b.resume("L-gone", spill_from="ftp://node-a")
    assert (status, refused["error"]) == (400, "bad_request") and "'spill_from'" in refused["message"]
    assert b.resume("L-gone")[0] == 404, "without spill_from, a lease this node never had is unknown"


class ShortAgent(BaseHTTPRequestHandler):
    """An agent whose spill of L-short is not what its manifest says: the
    server's ``length`` (the Content-Length it sends) and ``sent`` (the bytes
    it sends) of a namespace of ``claimed`` bytes."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.tokens.append(self.headers.get("Authorization"))
        if self.path == "/workers/L-short/spill":
            body = json.dumps({"lease_id": "L-short", "owner": "ann", "gpus": [], "fraction": 0.5, "memory": 2**30,
                               "since": 0.0, "disk_bytes": self.server.claimed,
                               "namespace_bytes": self.server.claimed}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(self.server.length))
        self.end_headers()
        self.wfile.write(b"x" * self.server.sent)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def short_agent(claimed: int, length: int, sent: int):
    """A :class:`ShortAgent` serving in a thread; yields its server (``tokens``: the Authorization headers it got)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), ShortAgent)
    server.claimed, server.length, server.sent, server.tokens = claimed, length, sent, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("claimed, length, sent, words", [
    (100, 50, 50, "it sent 50 bytes of a namespace of 100"),
    (100, 100, 50, "its answer was cut short (the connection closed)"),
    (2**60, 0, 0, "free, the spill holds 1048576.0 TiB (c.AgentParking.spill_dir)"),
])
def test_a_spill_cut_short_or_of_another_size_leaves_nothing_on_the_new_node(nodes, claimed, length, sent, words):
    _, b = nodes
    with short_agent(claimed, length, sent) as server:
        status, refused = b.resume("L-short", spill_from=server.url)
    assert (status, refused["error"]) == (502, "park_failed"), refused
    assert refused["message"].startswith(f"could not fetch the spill of lease L-short from {server.url}: "), refused
    assert refused["message"].endswith(f"{words}; it stays on the other node"), refused
    assert server.tokens == [f"token {TOKEN}"] * (1 if claimed > 100 else 2), "the agent token goes along"
    nothing_of(b, "L-short")


def test_a_fetched_spill_the_new_worker_cannot_load_leaves_nothing_on_the_new_node(nodes):
    _, b = nodes
    with short_agent(100, 100, 100) as server:  # 100 bytes of "x": not a namespace
        status, refused = b.resume("L-short", spill_from=server.url)
    assert (status, refused["error"]) == (502, "park_failed"), refused
    assert "the new worker of lease L-short could not load what was spilled" in refused["message"], refused
    assert refused["message"].endswith(f"; the spill stays on the other node ({server.url}), its copy here was "
                                       "removed"), refused
    nothing_of(b, "L-short")


def test_the_spill_endpoints_serve_only_spills_and_only_for_the_agent_token(nodes):
    a, _ = nodes
    kc = a.client(a.start_worker("L-here")["connection"])
    cell(kc, "x = 1")
    assert a.park("L-here")[1]["tier"] == "memory"
    for path in ("/workers/L-here/spill", "/workers/L-here/spill/namespace", "/workers/L-none/spill",
                 "/workers/L-none/spill/namespace"):
        status, refused = a.call("GET", path)
        assert (status, refused["error"]) == (404, "not_found"), (path, refused)
        assert "has no spill on this node" in refused["message"], refused
    assert a.park("L-here", tier="disk")[1]["tier"] == "disk"
    for path in ("/workers/L-here/spill", "/workers/L-here/spill/namespace"):
        for token in (None, "wrong"):
            status, refused = a.call("GET", path, token=token)
            assert (status, refused["error"]) == (401, "unauthorized"), (path, token, refused)
    request = urllib.request.Request(f"{a.url}/workers/L-here/spill/namespace",
                                     headers={"Authorization": f"token {TOKEN}"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.headers["Content-Type"] == "application/octet-stream"
        assert int(answer.headers["Content-Length"]) == len(answer.read()) == a.call(
            "GET", "/workers/L-here/spill")[1]["disk_bytes"]
    assert a.call("DELETE", "/workers/L-here")[0] == 200
