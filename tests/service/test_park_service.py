"""Park in place, the service's side, end to end (docs/parking.md): a real
``gpupool service``, a real agent on a simulated A100 with the ``simulated``
checkpointer and this host's cgroup freezer, real ipykernel workers whose
cells run through a jupyter_client, and a thread that heartbeats the leases
as the notebook kernel would.

What is checked: an idle lease is parked at its idle deadline (the share
free in GET /pool, the lease parked in memory with its figures, the GPU
memory gone from the agent's NVML-style readings) and its resume puts it back
on its GPU with its worker's state intact and the same connection; usage
stops while parked; a resume while its GPU is taken waits first in line and
resumes when room comes; a preemptible busy lease is frozen mid-cell by a
waiting interactive request and resumed by the service once that one is
released, its loop counting every iteration; max_parked_memory sends a park
to disk, and a notebook kernel whose lease spilled reconnects to the new worker; a node lost while parked ends its parked leases in words; the
heartbeat TTL releases a parked lease; the owner's park and resume refuse
what they must; a service restarted while a lease is parking finishes the park; an agent
restarted as a lease's idle deadline comes parks it once back, never losing it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
from frontend import install_kernelspec, run, start_gpupool_kernel
from jupyter_client import BlockingKernelClient
from procs import start_agent, start_service, wait_for
from prometheus_client.parser import text_string_to_metric_families
from service_api import assert_error, http, wait_state
from workercell import worker_client

from gpupool.errors import GPUPoolError, Reason
from gpupool.schema import LeaseState
from gpupool.tables import lease_table, pool_table
from gpupool.wire.leases import Lease, LeaseRequest

pytestmark = pytest.mark.timeout(300)

GiB, MiB = 1024**3, 1024**2
#: What a worker holds: simulated GPU memory, a held lock, an open file and a half-consumed generator.
STATE = """
import threading, os
from gpupool.node import simgpu
import numpy as np
gpu = simgpu.zeros({nbytes}, 'uint8')
gpu[::4096] = 7
lock = threading.Lock(); lock.acquire()
notes = open({path!r}, 'w+'); notes.write('before the park'); notes.flush()
squares = (i * i for i in range(10)); first = [next(squares) for _ in range(3)]
x = 41
print(os.getpid())
"""
CHECK = "print(os.getpid(), lock.locked(), notes.tell(), next(squares), int(gpu[::4096].sum()) == 7 * len(gpu[::4096]))"
#: A loop that counts its iterations, for a cell frozen mid-way.
LOOP = "import time\ncount = 0\nfor i in range(30):\n    time.sleep(0.1)\n    count += 1\nprint('counted', count)"


class Notebook:
    """Heartbeats the leases it is given every second, as their notebook kernels would."""

    def __init__(self, svc) -> None:
        self.svc = svc
        self.leases: dict[str, str | None] = {}  # lease id -> user
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def beat(self, lease_id: str, user: str | None = None) -> None:
        self.leases[lease_id] = user

    def forget(self, lease_id: str) -> None:
        self.leases.pop(lease_id, None)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for lease_id, user in list(self.leases.items()):
                try:
                    self.svc.client(user).heartbeat(lease_id)
                except (GPUPoolError, OSError):
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


class Parks:
    """The module's pool: the service ``svc`` (users tester, bob, ann the admin, dora whose
    max_parked_memory is 1 MiB), ``agent`` node-1 (one simulated A100), the heartbeating
    ``notebook``, and what each test made (released after it)."""

    def __init__(self, svc, agent, notebook: Notebook) -> None:
        self.svc, self.agent, self.notebook = svc, agent, notebook
        self.made: list[tuple[str, str | None]] = []
        self.kernels: list[BlockingKernelClient] = []

    def acquire(self, user: str | None = None, **request: Any) -> Lease:
        lease = self.svc.client(user).create_lease(LeaseRequest(**{"fraction": 1.0, **request}))
        self.made.append((lease.id, user))
        self.notebook.beat(lease.id, user)
        if lease.state is LeaseState.queued:
            return lease
        lease = wait_state(self.svc, lease.id, "starting", user)
        assert lease.state is LeaseState.active, lease.reason
        return lease

    def kernel(self, lease: Lease) -> BlockingKernelClient:
        kc = worker_client(lease.connection)
        self.kernels.append(kc)
        return kc

    def until(self, lease_id: str, state: str, user: str | None = None, timeout: float = 60) -> Lease:
        """The lease once it is in ``state`` (long polls)."""
        client = self.svc.client(user)
        deadline = time.monotonic() + timeout
        lease = client.get_lease(lease_id)
        while lease.state.value != state and time.monotonic() < deadline:
            assert not lease.state.ended or state in ("released", "reclaimed", "failed"), lease.reason
            lease = client.get_lease(lease_id, wait=min(10, deadline - time.monotonic()), state=lease.state.value)
        assert lease.state.value == state, (lease.state, lease.reason, lease.events)
        return lease

    def gpu(self, node: str = "node-1") -> dict[str, Any]:
        return next(n for n in self.svc.client().pool()["nodes"] if n["name"] == node)["gpus"][0]

    def node(self, name: str = "node-1") -> dict[str, Any]:
        return next(n for n in self.svc.client().pool()["nodes"] if n["name"] == name)

    def metrics(self) -> dict[tuple, float]:
        status, text = http(self.svc, "GET", "/metrics", prefix="")
        assert status == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def clean(self) -> None:
        for kc in self.kernels:
            kc.stop_channels()
        self.kernels.clear()
        for lease_id, user in self.made:
            self.notebook.forget(lease_id)
            self.svc.client(user).release(lease_id)
        self.made.clear()


@pytest.fixture(scope="module")
def pool_for_parks(tmp_path_factory):
    root = tmp_path_factory.mktemp("parks")
    simgpu = Path("/dev/shm") / f"gpupool-test-parks-{uuid.uuid4().hex[:8]}"
    was = os.environ.get("GPUPOOL_SIMGPU_ROOT")
    os.environ["GPUPOOL_SIMGPU_ROOT"] = str(simgpu)  # the agent's workers' simulated GPU memory
    svc = start_service(root, tokens={user: f"{user}-{uuid.uuid4().hex}" for user in ("bob", "ann", "dora")}, config={
        "heartbeat_ttl": 6.0, "node_ttl": 3.0, "parked_node_grace": 3.0, "worker_stop_timeout": 5.0,
        "preemption_grace": 0, "preemption_notice": 0.5, "admin_users": {"ann"}, "max_wait": "10m",
        "quotas": {"user:dora": {"max_parked_memory": "1MiB"}}})
    agent = start_agent(root, svc, name="node-1", simulate="1xA100-80GB",
                        extra_args=["--transport-encryption=none", "--warm-workers=0"])
    notebook = Notebook(svc)
    try:
        yield Parks(svc, agent, notebook), root
    finally:
        notebook.close()
        agent.stop()
        svc.stop()
        if was is None:
            os.environ.pop("GPUPOOL_SIMGPU_ROOT", None)
        else:
            os.environ["GPUPOOL_SIMGPU_ROOT"] = was


@pytest.fixture
def parks(pool_for_parks):
    made = pool_for_parks[0]
    yield made
    made.clean()


#: The agents' options here: cells reach workers through jupyter_client, no warm worker to wait for.
AGENT_ARGS = ["--transport-encryption=none", "--warm-workers=0"]


def one_node_notebook(tmp_path, monkeypatch, tag: str):
    """A service, an agent on one simulated A100 (simulated GPU memory under a ``tag`` folder of its
    own) and a gpupool notebook kernel on them: ``(svc, agent, km, kc)``, for the test to stop."""
    monkeypatch.setenv("GPUPOOL_SIMGPU_ROOT", str(Path("/dev/shm") / f"gpupool-test-{tag}-{uuid.uuid4().hex[:8]}"))
    svc = start_service(tmp_path, config={"node_ttl": 120.0})
    agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=AGENT_ARGS)
    km, kc = start_gpupool_kernel(install_kernelspec(tmp_path / "prefix", svc.url, svc.user_token), tmp_path)
    return svc, agent, km, kc


def close_notebook(svc, agent, km, kc) -> None:
    """Stop what :func:`one_node_notebook` started (``agent``: the one running now), its lease given up."""
    run(kc, "%gpu release --discard")
    kc.stop_channels()
    km.shutdown_kernel(now=True)
    agent.stop()
    svc.stop()


def resumed_cell(svc, lease_id: str, code: str, asked: bool = False) -> str:
    """Resume parked ``lease_id`` (``asked``: a resume is asked already), wait until it is active
    again, and run ``code`` on its worker; the cell's output."""
    if not asked:
        svc.client().resume(lease_id)
    lease = wait_state(svc, wait_state(svc, lease_id, "parked").id, "starting")
    assert lease.state is LeaseState.active, lease.events
    kc = worker_client(lease.connection)
    try:
        return cell(kc, code)
    finally:
        kc.stop_channels()


def cell(kc: BlockingKernelClient, code: str, timeout: float = 60) -> str:
    done = run(kc, code, timeout=timeout)
    assert done.ok, done.text()
    return done.stdout


def test_an_idle_lease_is_parked_at_its_idle_deadline_and_resumes_as_it_was(parks, tmp_path):
    lease = parks.acquire(idle_timeout=5)
    kc = parks.kernel(lease)
    pid = int(cell(kc, STATE.format(nbytes=1 * GiB, path=str(tmp_path / "notes.txt"))))
    wait_for(lambda: (parks.gpu()["memory_used"] or 0) >= GiB, 10, "the GPU memory reading")
    assert parks.gpu()["allocated_fraction"] == 1.0

    parked = parks.until(lease.id, "parked", timeout=30)
    park = parked.parked
    assert (park["tier"], park["checkpointer"], park["resume_requested"], park["lost"]) == (
        "memory", "simulated", False, [])
    assert park["reason"].startswith("idle for 5s (idle timeout 5s)"), park["reason"]
    assert park["gpu_bytes_moved"] == GiB and park["gpu_bytes_kept"] == 0 and park["host_bytes"] > GiB
    assert 0 < park["resume_estimate_s"] < 5
    assert parked.connection == lease.connection, "the notebook keeps its connection to the frozen worker"
    assert [e["state"] for e in parked.events][-2:] == ["parking", "parked"]
    assert parked.idle_deadline is None and parked.worker["pid"] == pid
    # The share is free in the pool; the node's parked memory says what the park holds.
    assert (parks.gpu()["allocated_fraction"], parks.gpu()["leases"]) == (0.0, 0)
    assert (parks.gpu()["parked_fraction"], parks.gpu()["parked_leases"]) == (1.0, 1), "its claim, shown apart"
    assert parks.svc.client().pool()["totals"]["parked"] == 1.0
    node = parks.node()
    assert (node["parked_leases"], node["parked_host_bytes"], node["checkpointer"]) == (1, park["host_bytes"],
                                                                                      "simulated")
    wait_for(lambda: parks.gpu()["memory_used"] == 0, 10, "the GPU memory freed in the NVML-style readings")
    # Usage stops while parked: GPU-seconds and GPU-hours stand still.
    used, hours = parked.usage_gpu_seconds, parks.svc.client().quota()["usage"]["today_gpu_hours"]
    assert used > 0
    time.sleep(1.5)
    still = parks.svc.client().get_lease(lease.id)
    assert still.usage_gpu_seconds == used and parks.svc.client().quota()["usage"]["today_gpu_hours"] == hours
    assert parks.svc.client().quota()["usage"]["parked_memory"] == park["host_bytes"]
    samples = parks.metrics()
    assert samples[("gpupool_leases", (("state", "parked"),))] == 1
    assert samples[("gpupool_node_parked_host_bytes", (("node", "node-1"),))] == park["host_bytes"]
    assert samples[("gpupool_parks_total", (("reason", "idle"), ("tier", "memory")))] >= 1
    text = lease_table([still])[0]
    assert "parked in memory on node-1 for" in text and "a resume takes about" in text, text
    shown = pool_table(parks.svc.client().pool())[0]
    assert "node-1 holds 1 parked lease: " in shown
    assert "  0.00 + 1.00 parked  0 + 1 parked" in shown, "the GPU is held by a parked lease, not free"

    resumed = parks.svc.client().resume(lease.id)
    assert resumed.state in (LeaseState.starting, LeaseState.active)
    resumed = parks.until(lease.id, "active")
    assert resumed.connection == lease.connection and resumed.gpus == lease.gpus and resumed.parked is None
    assert [e["state"] for e in resumed.events][-4:] == ["parking", "parked", "starting", "active"]
    assert resumed.events[-2]["reason"] == f"resuming on node-1: GPU 0 ({lease.gpus[0]['name']})"
    assert resumed.parked_seconds >= 1.5
    assert cell(kc, CHECK).split() == [str(pid), "True", "15", "9", "True"], "the worker's state is intact"
    wait_for(lambda: (parks.gpu()["memory_used"] or 0) >= GiB, 10, "the GPU memory back")
    assert (parks.gpu()["allocated_fraction"], parks.gpu()["parked_fraction"]) == (1.0, 0.0)
    time.sleep(0.5)
    assert parks.svc.client().get_lease(lease.id).usage_gpu_seconds == used, "a span is counted when it ends"
    assert parks.svc.client().quota()["usage"]["today_gpu_hours"] > hours, "the running span counts again"
    assert parks.metrics()[("gpupool_resume_seconds_count", ())] >= 1


def test_a_resume_while_its_gpu_is_taken_waits_first_in_line(parks):
    first = parks.acquire(idle_timeout=600)
    kc = parks.kernel(first)
    cell(kc, "x = 41")
    assert parks.svc.client().park(first.id).state is LeaseState.parked
    taker = parks.acquire("bob", idle_timeout=600)  # the GPU it had
    waiting = parks.svc.client().resume(first.id)
    assert (waiting.state, waiting.parked["resume_requested"], waiting.queue_position) == (LeaseState.parked, True, 1)
    assert parks.svc.client().resume(first.id).queue_position == 1, "a resume is idempotent"
    # It presses on the lease that took its GPU (the only one it can go to): parked early after the
    # pressure grace (2 min), which is when the resume is likely placed.
    wait_for(lambda: parks.svc.client("bob").get_lease(taker.id).pressure, 10, "pressure on the taker")
    assert parks.svc.client("bob").get_lease(taker.id).pressure == "parked early: 1 person is waiting for a GPU"
    estimate = parks.svc.client().get_lease(first.id).queue_estimate_s
    assert estimate is not None and 100 < estimate <= 120, estimate
    later = parks.acquire("ann", fraction=0.5, wait=120)
    assert later.state is LeaseState.queued and later.queue_position == 2, "behind the resume asked after it"
    seen = parks.svc.client().get_lease(first.id)
    assert seen.parked["may_move"] is True, "c.PoolLeases.resume_moves: another node with room would do"
    text = lease_table([seen])[0]
    assert "its resume waits for room on node-1 or another node (there: a new worker loads its state from disk" \
        in text and "(place 1 in line)" in text, text

    parks.svc.client("bob").release(taker.id)
    parks.until(first.id, "active")
    assert parks.svc.client("ann").get_lease(later.id).state is LeaseState.queued  # the whole GPU is the resume's
    assert cell(kc, "print(x + 1)").strip() == "42"


@pytest.mark.parametrize("lease_class", ["batch", "interactive"])
def test_a_preempted_busy_lease_is_frozen_and_resumed_by_the_service(parks, lease_class):
    """The preempted lease's frozen cell waits for the person who preempted it (its resume waits
    behind the request already waiting, though of its own class when interactive: it never takes
    the room straight back), then goes on with every iteration counted."""
    batch = parks.acquire(lease_class=lease_class, preemptible=True, idle_timeout=600)
    kc = parks.kernel(batch)
    msg_id = kc.execute(LOOP)
    wait_for(lambda: (parks.svc.client().get_lease(batch.id).worker or {}).get("execution_state") == "busy", 10,
             "the running cell reported")
    person = parks.acquire("bob", wait=120, idle_timeout=600)
    assert person.state is LeaseState.queued
    frozen = parks.until(batch.id, "parked", timeout=30)
    assert frozen.parked["resume_requested"] and frozen.parked["reason"].startswith("preempted: 1 person is waiting")
    assert frozen.worker["execution_state"] == "busy"
    parks.until(person.id, "active", "bob")
    waited = parks.svc.client().get_lease(batch.id)
    assert waited.state is LeaseState.parked and len(waited.events) == len(frozen.events), \
        ("no resume before the person got the GPU", waited.events[len(frozen.events) - 1:])
    parks.svc.client("bob").release(person.id)
    parks.until(batch.id, "active", timeout=30)
    outputs, reply = [], None
    while reply is None:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            outputs.append(msg["content"]["text"])
        if msg["msg_type"] == "error":
            pytest.fail(f"the frozen cell saw {msg['content']['ename']}")
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            reply = "".join(outputs)
    assert reply.strip() == "counted 30", "every iteration counted, no KeyboardInterrupt"
    samples = parks.metrics()
    assert samples[("gpupool_parks_total", (("reason", "preemption"), ("tier", "memory")))] >= 1


def test_a_park_beyond_max_parked_memory_goes_to_disk(parks, tmp_path):
    lease = parks.acquire("dora", idle_timeout=600)
    kc = parks.kernel(lease)
    cell(kc, STATE.format(nbytes=64 * MiB, path=str(tmp_path / "notes.txt")))
    wait_for(lambda: (parks.svc.client("dora").get_lease(lease.id).worker or {}).get("memory_used"), 10,
             "the worker's GPU memory reported")
    parked = parks.svc.client("dora").park(lease.id)
    assert parked.state is LeaseState.parked, parked.events
    park = parked.parked
    assert park["tier"] == "disk" and park["host_bytes"] == 0 and park["disk_bytes"] > 0
    assert "beyond your max_parked_memory of 1.0 MiB" in park["reason"], park["reason"]
    assert any("lock" in words for words in park["lost"]), park["lost"]
    assert parked.connection is None, "its process ended: no connection to show"
    assert "spilled to disk on node-1" in lease_table([parked])[0]
    assert parks.metrics()[("gpupool_parks_total", (("reason", "owner"), ("tier", "disk")))] >= 1
    resumed = parks.svc.client("dora").resume(lease.id)
    resumed = parks.until(lease.id, "active", "dora")
    assert resumed.connection and resumed.connection != lease.connection, "a new worker's connection"
    assert "resumed on node-1 from disk" in resumed.events[-1]["reason"]
    fresh = parks.kernel(resumed)
    assert cell(fresh, "print(x, int(gpu[::4096].sum()) == 7 * len(gpu[::4096]))").split() == ["41", "True"]


def test_a_notebook_whose_lease_spilled_reconnects_to_the_new_worker_and_finds_its_variables(parks, tmp_path):
    """dora's parks go to disk (her max_parked_memory is 1 MiB): the gpupool kernel's next cell resumes the
    lease into a new worker, reconnects to it and finds what pickles; no notebook-side copy was made."""
    kernels = install_kernelspec(tmp_path / "prefix", parks.svc.url, parks.svc.extra_tokens["dora"])
    km, kc = start_gpupool_kernel(kernels, tmp_path)
    try:
        assert run(kc, "%gpu acquire 0.5").ok
        before = run(kc, "import os\nx = 41\nprint(os.getpid(), os.environ['GPUPOOL_LEASE_ID'])")
        pid, lease_id = before.stdout.split()
        parked = run(kc, "%gpu park")
        assert parked.ok and "max_parked_memory" in parked.stdout, parked.text()
        assert "its variables were saved to disk on node-1" in parked.stdout and "frozen" not in parked.stdout
        assert run(kc, "%%local\n'x' in globals()").outputs[-1][1]["data"]["text/plain"] == "False"
        after = run(kc, "print(x + 1, os.getpid())")
        assert after.ok and f"gpupool: resumed {lease_id}" in after.stdout, after.text()
        value, new_pid = after.stdout.strip().splitlines()[-1].split()
        assert value == "42" and new_pid != pid, after.text()
        assert run(kc, "print(os.environ['GPUPOOL_LEASE_ID'])").stdout.strip() == lease_id, "the same lease"
    finally:
        run(kc, "%gpu release --discard")
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_cell_after_an_admin_release_says_the_variables_were_lost_and_how_to_go_on(parks, tmp_path):
    """An admin's release ends the lease behind the notebook's back: the next cell fails with the
    admin's words, says the worker's variables were lost and names %gpu acquire; what happens is as before."""
    kernels = install_kernelspec(tmp_path / "prefix", parks.svc.url, parks.svc.extra_tokens["dora"])
    km, kc = start_gpupool_kernel(kernels, tmp_path)
    try:
        assert run(kc, "%gpu acquire 0.5").ok
        lease_id = run(kc, "import os\nx = 41\nprint(os.environ['GPUPOOL_LEASE_ID'])").stdout.strip()
        parks.svc.client("ann").release(lease_id, reason="admin needs it")
        after = run(kc, "print(x)")
        assert not after.ok and after.reply["ename"] == "UsageError", after.text()
        words = after.reply["evalue"]
        assert words.startswith(f"lease {lease_id} was released: released by admin ann: admin needs it. "
                                "The worker's variables were lost with it: none came back to this notebook"), words
        assert words.endswith("Run %gpu acquire 0.5 to attach again, then rerun the cells that made them."), words
        assert run(kc, "%%local\n'x' in globals()").outputs[-1][1]["data"]["text/plain"] == "False"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_the_owners_park_and_resume_refuse_what_they_must(parks):
    lease = parks.acquire(idle_timeout=600)
    for token in ("bob", None):  # another user: as if it did not exist; no token: 401
        reply = http(parks.svc, "POST", f"/leases/{lease.id}/park", {}, token=parks.svc.extra_tokens[token]
                     if token else None)
        assert_error(reply, 404 if token else 401, "not_found" if token else "unauthorized")
    assert_error(http(parks.svc, "POST", f"/leases/{lease.id}/park", {}, token=parks.svc.extra_tokens["ann"]), 403,
                 "forbidden")  # an admin sees it, but only its owner parks it
    assert_error(http(parks.svc, "POST", f"/leases/{lease.id}/park", {}, token="agent"), 403, "forbidden")
    assert_error(http(parks.svc, "POST", f"/leases/{lease.id}/resume", {}, token=parks.svc.extra_tokens["ann"]), 403,
                 "forbidden")
    assert_error(http(parks.svc, "POST", f"/leases/{lease.id}/park", raw=b"[1]"), 400, "bad_request")
    assert_error(http(parks.svc, "POST", "/leases/L-000000000000/park", {}), 404, "not_found")
    kc = parks.kernel(lease)
    kc.execute("import time; time.sleep(3)")
    wait_for(lambda: (parks.svc.client().get_lease(lease.id).worker or {}).get("execution_state") == "busy", 10,
             "the running cell reported")
    busy = assert_error(http(parks.svc, "POST", f"/leases/{lease.id}/park", {}), 409, "worker_busy")
    assert "a cell is running" in busy["message"]
    assert parks.svc.client().get_lease(lease.id).state is LeaseState.active
    assert parks.svc.client().resume(lease.id).state is LeaseState.active, "resuming an active lease: as it is"
    queued = parks.acquire("bob", wait=120)
    refused = assert_error(http(parks.svc, "POST", f"/leases/{queued.id}/park", {},
                                token=parks.svc.extra_tokens["bob"]), 409, "invalid_state")
    assert refused["message"] == f"lease {queued.id} is queued: only an active lease can be parked"
    assert refused["state"] == "queued"
    parks.svc.client("bob").release(queued.id)
    ended = assert_error(http(parks.svc, "POST", f"/leases/{queued.id}/resume", {},
                              token=parks.svc.extra_tokens["bob"]), 409, "invalid_state")
    assert "only a parked lease can be resumed" in ended["message"]
    wait_for(lambda: parks.svc.client().get_lease(lease.id).worker["execution_state"] == "idle", 15, "the cell's end")
    # The agent asks the worker itself at the park, and may still see the cell's end a moment late (a loaded host).
    assert wait_for(lambda: _park_unless_busy(parks, lease.id), 15, "the park once the worker is idle").state \
        is LeaseState.parked
    again = parks.svc.client().park(lease.id)
    assert again.state is LeaseState.parked and again.parked["reason"] == "parked by its owner", "idempotent"


def test_a_lease_asked_on_idle_release_is_released_at_its_idle_deadline(parks):
    lease = parks.acquire(idle_timeout=2, on_idle="release")
    assert lease.on_idle == "release"
    ended = parks.until(lease.id, "reclaimed", timeout=30)
    assert ended.reason.startswith("idle for 2s (idle timeout 2s)") and "parking" not in [e["state"] for e in
                                                                                      ended.events]


def test_a_parked_lease_whose_kernel_died_is_released(parks):
    lease = parks.acquire(idle_timeout=600)
    parks.svc.client().park(lease.id)
    parks.notebook.forget(lease.id)  # its kernel died: no heartbeats
    ended = parks.until(lease.id, "reclaimed", timeout=30)
    assert ended.reason.startswith("the notebook kernel stopped sending heartbeats"), ended.reason
    assert ended.parked is None and ended.connection is None
    wait_for(lambda: parks.node()["parked_leases"] == 0, 10, "its host memory back")


def test_a_node_lost_while_parked_ends_its_parked_leases_in_words(pool_for_parks):
    parks, root = pool_for_parks
    other = start_agent(root, parks.svc, name="node-2", simulate="1xH100-80GB",
                        extra_args=["--transport-encryption=none", "--warm-workers=0"])
    try:
        asked, left = (parks.acquire(fraction=0.5, model="H100", idle_timeout=600) for _ in range(2))
        for lease in (asked, left):
            assert lease.node == "node-2"
            assert parks.svc.client().park(lease.id).state is LeaseState.parked
        other.proc.send_signal(signal.SIGSTOP)  # no heartbeats from here on
        wait_for(lambda: parks.node("node-2")["state"] == "lost", 15, "node-2 lost")
        # Lost for less than node_ttl plus parked_node_grace, its agent may come back (a restart): the
        # resume waits for it, without moving (the state is on node-2), then ends with the grace.
        waiting = parks.svc.client().resume(asked.id)
        assert waiting.state is LeaseState.parked and waiting.node_state == "lost", waiting.events
        assert waiting.parked["resume_requested"] and not waiting.parked["may_move"], waiting.parked
        failed = parks.until(asked.id, "failed", timeout=30)
        assert failed.reason.startswith(f"node node-2 was lost while lease {asked.id} was parked"), failed.reason
        gone = parks.until(left.id, "failed", timeout=30)  # node_ttl plus parked_node_grace
        assert re.match(rf"node node-2 was lost while lease {left.id} was parked \(no heartbeat for [0-9]+s\): its "
                        "worker and its variables there are gone", gone.reason), gone.reason
    finally:
        other.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: parks.node("node-2")["state"] == "up", 15, "node-2 back")
        parks.clean()
        other.stop()  # its frozen workers were stopped on its first heartbeat back: nothing is left


def test_a_spill_the_agent_makes_on_its_own_moves_the_park_to_disk(pool_for_parks, tmp_path):
    """Its parked-memory budget holds one parked worker, not two: the second park spills the first
    (the longest parked), which its heartbeats tell the service; that lease then resumes from disk."""
    parks, root = pool_for_parks
    other = start_agent(root, parks.svc, name="node-s", simulate="1xL4-24GB",
                        extra_args=["--transport-encryption=none", "--warm-workers=0", "--parked-memory=800MiB"])
    try:
        first, second = (parks.acquire(fraction=0.5, model="L4", idle_timeout=600) for _ in range(2))
        for lease in (first, second):
            cell(parks.kernel(lease), STATE.format(nbytes=400 * MiB, path=str(tmp_path / f"{lease.id}.txt")))
            wait_for(lambda: (parks.svc.client().get_lease(lease.id).worker or {}).get("memory_used"), 10,
                     "the worker's GPU memory reported")
            assert parks.svc.client().park(lease.id).parked["tier"] == "memory"
        spilled = parks.svc.client().get_lease(first.id)
        deadline = time.monotonic() + 30
        while spilled.parked["tier"] != "disk" and time.monotonic() < deadline:
            spilled = parks.svc.client().get_lease(first.id, wait=5, state="parked")  # wakes on the park's change
        assert (spilled.parked["tier"], spilled.parked["host_bytes"]) == ("disk", 0), spilled.parked
        assert any("lock" in words for words in spilled.parked["lost"]), spilled.parked["lost"]
        assert spilled.connection is None
        assert parks.svc.client().get_lease(second.id).parked["tier"] == "memory"
        assert parks.node("node-s")["parked_host_bytes"] == parks.svc.client().get_lease(second.id).parked[
            "host_bytes"], "the spilled one holds no host RAM there any more"
        parks.svc.client().resume(first.id)
        back = parks.until(first.id, "active")
        assert "resumed on node-s from disk" in back.events[-1]["reason"]
        assert cell(parks.kernel(back), "print(x)").strip() == "41"
    finally:
        parks.clean()
        other.stop()


def test_a_service_restarted_while_a_lease_is_parking_finishes_the_park(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUPOOL_SIMGPU_ROOT", str(Path("/dev/shm") / f"gpupool-test-restart-{uuid.uuid4().hex[:8]}"))
    config = {"node_ttl": 60.0}
    svc = start_service(tmp_path, config=config)
    agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=["--transport-encryption=none",
                                                                            "--warm-workers=0"])
    port = int(svc.url.rsplit(":", 1)[1])
    try:
        lease = svc.client().create_lease(LeaseRequest(fraction=1.0, idle_timeout=4))
        lease = wait_state(svc, lease.id, "starting")
        wait_for(lambda: (svc.client().get_lease(lease.id).worker or {}).get("execution_state") == "idle", 10,
                 "the idle worker reported")
        agent.proc.send_signal(signal.SIGSTOP)  # the park the sweep asks for waits on it
        try:
            assert wait_state(svc, lease.id, "active", timeout=30).state is LeaseState.parking
        finally:
            svc.stop()
            agent.proc.send_signal(signal.SIGCONT)
        svc = start_service(tmp_path, config=config, port=port)
        parked = wait_state(svc, lease.id, "parking", timeout=60)
        assert parked.state is LeaseState.parked and parked.parked["tier"] == "memory", parked.events
        assert "was parking when the service stopped" in svc.log.read_text()
        assert svc.client().pool()["nodes"][0]["gpus"][0]["allocated_fraction"] == 0.0
        svc.client().release(lease.id)
    finally:
        agent.stop()
        svc.stop()


def test_an_agent_restarted_at_the_idle_deadline_parks_the_lease_once_back(tmp_path, monkeypatch):
    """The agent killed (kill -9) as a lease's idle deadline comes, and started again while its node
    is lost but within its grace (node_ttl + parked_node_grace): the park it could not be asked keeps
    the lease active (it was reclaimed, its variables
    lost, though the agent re-adopts the worker); once the agent is back the sweep parks it, and it
    resumes with its variables."""
    monkeypatch.setenv("GPUPOOL_SIMGPU_ROOT", str(Path("/dev/shm") / f"gpupool-test-outage-{uuid.uuid4().hex[:8]}"))
    svc = start_service(tmp_path, config={"node_ttl": 3.0, "heartbeat_ttl": 600.0})
    args = ["--transport-encryption=none", "--warm-workers=0"]
    agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=args)
    try:
        lease = wait_state(svc, svc.client().create_lease(LeaseRequest(fraction=1.0, idle_timeout=3)).id, "starting")
        kc = worker_client(lease.connection)
        try:
            cell(kc, "x = 41")
            agent.proc.kill()
            agent.proc.wait(10)
            words = "it is parked once its agent answers"
            wait_for(lambda: any(words in e["reason"] for e in svc.client().get_lease(lease.id).events), 30,
                     "a park its agent could not be asked")
            # Silent past node_ttl (3 s), the node is lost; sweeps go on (every 0.2 s) while its agent is away.
            wait_for(lambda: svc.client().pool()["nodes"][0]["state"] == "lost", 30, "the node lost")
            time.sleep(3)
            assert svc.client().get_lease(lease.id).state in (LeaseState.active, LeaseState.parking)
            port = int(agent.url.rsplit(":", 1)[1])  # as systemd restarts it: its folder (it re-adopts), its port
            agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=args, port=port)
            parked = wait_state(svc, lease.id, "active", timeout=60)
            parked = wait_state(svc, lease.id, "parking", timeout=60)
            assert parked.state is LeaseState.parked and parked.parked["tier"] == "memory", parked.events
            svc.client().resume(lease.id)
            assert wait_state(svc, lease.id, "parked", timeout=60).state in (LeaseState.starting, LeaseState.active)
            assert wait_state(svc, lease.id, "starting", timeout=60).state is LeaseState.active
            assert cell(kc, "print(x)").strip() == "41"
        finally:
            kc.stop_channels()
        svc.client().release(lease.id)
    finally:
        agent.stop()
        svc.stop()


def test_an_agent_stopped_for_a_restart_saves_its_leases_to_disk_and_they_resume_after(tmp_path, monkeypatch):
    """``systemctl restart`` of an agent (SIGTERM; ``c.AgentParking.park_on_stop``, the default): an active
    lease and one parked in memory are saved to the node's disk and stay parked there (the share back in
    the pool, the node lost); a resume asked while the agent is away waits for it; once an agent runs
    again on the node's folder, each resumes into a new worker with its variables."""
    monkeypatch.setenv("GPUPOOL_SIMGPU_ROOT", str(Path("/dev/shm") / f"gpupool-test-restart-{uuid.uuid4().hex[:8]}"))
    svc = start_service(tmp_path, config={"node_ttl": 3.0, "heartbeat_ttl": 600.0})
    args = ["--transport-encryption=none", "--warm-workers=0"]
    agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=args)
    client = svc.client()
    try:
        active, other = (wait_state(svc, client.create_lease(LeaseRequest(fraction=0.5, idle_timeout=600)).id,
                                    "starting") for _ in range(2))
        for lease, value in ((active, 41), (other, 7)):
            kc = worker_client(lease.connection)
            cell(kc, f"x = {value}")
            kc.stop_channels()
        assert client.park(other.id).parked["tier"] == "memory"
        port = int(agent.url.rsplit(":", 1)[1])
        assert agent.stop() == 0  # raises if a worker's process survived
        for lease in (active, other):
            saved = client.get_lease(lease.id)
            assert saved.state is LeaseState.parked and saved.parked["tier"] == "disk", saved.events
            assert saved.parked["lost"] == [], saved.parked
        assert "the node agent on node-1 was stopped" in client.get_lease(active.id).parked["reason"]
        [node] = client.pool()["nodes"]
        assert node["state"] == "lost" and node["gpus"][0]["allocated_fraction"] == 0.0, node
        waiting = client.resume(active.id)
        assert waiting.state is LeaseState.parked and waiting.parked["resume_requested"], waiting.events
        agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=args, port=port)
        assert resumed_cell(svc, active.id, "print(x + 1)", asked=True).strip() == "42"
        assert svc.client().get_lease(active.id).connection != active.connection, "a new worker loaded what was saved"
        assert resumed_cell(svc, other.id, "print(x + 1)").strip() == "8"
        status, text = http(svc, "GET", "/metrics", prefix="")
        parks = {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
                 for s in family.samples if s.name == "gpupool_parks_total"}
        assert parks[(("reason", "agent_stopped"), ("tier", "disk"))] == 1.0, parks  # the active one
        for lease in (active, other):
            client.release(lease.id)
    finally:
        agent.stop()
        svc.stop()


def test_a_cell_whose_resume_failed_while_its_agent_was_away_resumes_once_it_is_back(tmp_path, monkeypatch):
    """A parked lease's cell asks a resume while the agent is killed: the service's try fails and leaves
    it parked; the cell asks again (it waited for good: no resume was pending any more) and runs once
    the agent, restarted on its folder and port, has re-adopted the frozen worker."""
    svc, agent, km, kc = one_node_notebook(tmp_path, monkeypatch, "away")
    args = AGENT_ARGS
    try:
        assert run(kc, "%gpu acquire 0.5").ok
        lease_id = run(kc, "import os\nx = 41\nprint(os.environ['GPUPOOL_LEASE_ID'])").stdout.strip()
        assert run(kc, "%gpu park").ok
        agent.proc.kill()
        agent.proc.wait(10)
        msg_id = kc.execute("print(x + 1)")
        wait_for(lambda: any("stays parked" in e["reason"] for e in svc.client().get_lease(lease_id).events), 30,
                 "the service's resume failing while the agent is away")
        port = int(agent.url.rsplit(":", 1)[1])
        agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=args, port=port)
        deadline, said = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            msg = kc.get_iopub_msg(timeout=deadline - time.monotonic())
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                said.append(msg["content"]["text"])
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        assert "42" in "".join(said).split(), said
        assert f"resumed {lease_id}" in "".join(said), said
    finally:
        close_notebook(svc, agent, km, kc)


def test_an_agent_stopped_while_the_service_is_down_has_its_saved_leases_parked_at_its_next_start(tmp_path,
                                                                                                      monkeypatch):
    """The stopping agent's last heartbeat is lost (the service is down): the service, back, still
    has the lease active; the next agent's registration reports it spilled, and the lease is parked on
    disk and resumes with its variables, instead of staying active on a worker that is gone."""
    monkeypatch.setenv("GPUPOOL_SIMGPU_ROOT", str(Path("/dev/shm") / f"gpupool-test-lostbye-{uuid.uuid4().hex[:8]}"))
    config = {"node_ttl": 60.0, "heartbeat_ttl": 600.0}
    svc = start_service(tmp_path, config=config)
    args = ["--transport-encryption=none", "--warm-workers=0"]
    agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=args)
    service_port, agent_port = int(svc.url.rsplit(":", 1)[1]), int(agent.url.rsplit(":", 1)[1])
    try:
        lease = wait_state(svc, svc.client().create_lease(LeaseRequest(fraction=0.5, idle_timeout=600)).id,
                           "starting")
        kc = worker_client(lease.connection)
        cell(kc, "x = 41")
        kc.stop_channels()
        svc.stop()
        assert agent.stop() == 0
        svc = start_service(tmp_path, config=config, port=service_port)
        assert svc.client().get_lease(lease.id).state is LeaseState.active, "it never heard of the save"
        agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=args, port=agent_port)
        saved = svc.client().get_lease(lease.id)
        assert saved.state is LeaseState.parked and saved.parked["tier"] == "disk", saved.events
        assert resumed_cell(svc, lease.id, "print(x + 1)").strip() == "42"
        svc.client().release(lease.id)
    finally:
        agent.stop()
        svc.stop()


def test_a_notebook_whose_agent_restarts_waits_for_it_and_goes_on_with_its_variables(tmp_path, monkeypatch):
    """The notebook's view of an agent restart (SIGTERM, then the agent started again on its folder):
    the next cell says it waits for the node's agent, then resumes from disk and finds ``x``."""
    svc, agent, km, kc = one_node_notebook(tmp_path, monkeypatch, "back")
    args = AGENT_ARGS
    try:
        assert run(kc, "%gpu acquire 0.5").ok
        assert run(kc, "x = 41").ok
        port = int(agent.url.rsplit(":", 1)[1])
        assert agent.stop() == 0
        time.sleep(1.5)  # as a person's next cell comes: after the park, by the clocks' slack (CLOCK_SLACK_S)
        msg_id = kc.execute("print(x + 1)")
        said: list[str] = []

        def heard(until: str) -> None:
            deadline = time.monotonic() + 60
            while until not in "".join(said):
                assert time.monotonic() < deadline, f"{until!r} not said: {said}"
                try:
                    msg = kc.get_iopub_msg(timeout=1)
                except Empty:
                    continue
                if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                    said.append(msg["content"]["text"])

        heard("whose agent is away")
        agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=args, port=port)
        heard("42")
        assert "resumed" in "".join(said), said
    finally:
        close_notebook(svc, agent, km, kc)


def test_after_an_agent_restart_the_resuming_cell_names_what_the_save_could_not_keep(tmp_path, monkeypatch):
    """The agent stopped while the notebook is idle (its heartbeat sees the park: the park's notice waits
    for the next cell, which drops it, since that cell says the resume itself), then back: that cell's
    resume line names what the save to disk could not keep (a lock), not only that it resumed."""
    monkeypatch.setenv("GPUPOOL_SIMGPU_ROOT", str(Path("/dev/shm") / f"gpupool-test-lostsaid-{uuid.uuid4().hex[:8]}"))
    svc = start_service(tmp_path, config={"node_ttl": 120.0, "heartbeat_ttl": 6.0})  # beats every 2 s
    agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=AGENT_ARGS)
    km, kc = start_gpupool_kernel(install_kernelspec(tmp_path / "prefix", svc.url, svc.user_token), tmp_path)
    try:
        assert run(kc, "%gpu acquire 0.5").ok
        assert run(kc, "import threading\nlk = threading.Lock()\nw = 5").ok
        port = int(agent.url.rsplit(":", 1)[1])
        assert agent.stop() == 0
        time.sleep(4)  # a beat or two: the kernel has seen the park
        agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=AGENT_ARGS, port=port)
        done = run(kc, "print(w)", timeout=90)
        text = done.text()
        assert done.ok and done.stdout.strip().endswith("5"), text
        assert "gpupool: resumed " in text and "not kept by the park: lk: _thread.lock cannot be saved to disk" in text, \
            text
    finally:
        close_notebook(svc, agent, km, kc)


def test_a_cell_interrupted_by_its_agents_restart_says_why_and_the_next_goes_on_with_its_variables(tmp_path,
                                                                                                    monkeypatch):
    """SIGTERM to the agent while a cell runs: the agent interrupts the cell and saves the worker to disk.
    The cell's own output says why it was interrupted (not a bare KeyboardInterrupt), before its idle;
    the next cell, once the agent is back, resumes the lease and finds ``x``."""
    svc, agent, km, kc = one_node_notebook(tmp_path, monkeypatch, "stopcell")
    try:
        assert run(kc, "%gpu acquire 0.5").ok
        lease_id = run(kc, "import os, time\nx = 41\nprint(os.environ['GPUPOOL_LEASE_ID'])").stdout.strip()
        msg_id = kc.execute("print('sleeping', flush=True)\ntime.sleep(30)")
        said: list[tuple[str, str]] = []  # (stream, text) of the cell, until its idle
        deadline = time.monotonic() + 60
        stopper = None
        while True:
            msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                break
            if kind == "stream":
                said.append((content["name"], content["text"]))
            elif kind == "error":
                said.append(("error", content["ename"]))
            if stopper is None and "sleeping" in "".join(text for _, text in said):
                stopper = threading.Thread(target=agent.stop)  # SIGTERM, as systemctl restart sends
                stopper.start()
        stopper.join(60)
        words = [text for stream, text in said if stream == "stderr" and text.startswith("gpupool:")]
        assert ("error", "KeyboardInterrupt") in said, said
        assert len(words) == 1, said
        assert re.search(rf"this cell was interrupted: the node agent on node-1 was stopped .*saved lease {lease_id}"
                         r".* to that node's disk .*the next cell resumes it.* with its variables", words[0]), words
        assert svc.client().get_lease(lease_id).state is LeaseState.parked
        port = int(agent.url.rsplit(":", 1)[1])
        agent = start_agent(tmp_path, svc, simulate="1xA100-80GB", extra_args=AGENT_ARGS, port=port)
        back = run(kc, "print(x + 1)")
        assert back.ok and "42" in back.stdout.split(), back.text()
        assert f"resumed {lease_id}" in back.text(), back.text()
    finally:
        close_notebook(svc, agent, km, kc)


def _park_unless_busy(parks, lease_id: str):
    """The owner's park of ``lease_id``; None while the agent still finds its cell running (409 worker_busy)."""
    try:
        return parks.svc.client().park(lease_id)
    except GPUPoolError as exc:
        if exc.code != Reason.worker_busy:
            raise
        return None
