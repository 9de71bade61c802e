"""One user cannot hurt another, with real service processes:

- a thousand queued requests of one user (caps raised) leave another user's
  ``/health``, lease calls and place in the queue answered; with the default
  caps the extra requests get 429 naming the setting;
- a SQLite store locked by another process stalls the writes that need it,
  not ``/health`` or reads (no SQL on the event loop);
- requests without a token are refused before their body is read: many
  connections declaring big bodies leave the service's and the agent's
  memory as it was; a connection that stalls its headers is closed;
- a missing lease and another user's take the same queries;
- a state directory that cannot be written stops the service with words
  naming it, and leaves no temporary token file.

Timings go to ``bench/flood_bench.py``; these tests assert answers, not times.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from procs import start_agent, start_service
from service_api import assert_error, http, register, silent_listener

from gpupool.errors import GPUPoolError
from gpupool.wire.leases import LeaseRequest

GPUPOOL = Path(sys.executable).with_name("gpupool")
MiB = 1024**2


def _users(*names: str) -> dict[str, str]:
    return {name: f"{name}-{uuid.uuid4().hex}" for name in names}


@pytest.fixture
def silent_pool(tmp_path):
    """``silent_pool(**config)``: a service (users flood and ann, ``config`` over fast
    test settings) with one registered node of one GPU whose agent never answers,
    so placed leases stay ``starting``. Stopped after the test."""
    started = []
    with silent_listener() as silent:
        def make(**config):
            config = {"node_ttl": 3600, "worker_start_timeout": "10m", **config}
            svc = start_service(tmp_path, tokens=_users("flood", "ann"), config=config)
            started.append(svc)
            svc.silent_url = "http://127.0.0.1:%d" % silent.getsockname()[1]
            register(svc, "node-f", gpus=1)
            return svc

        yield make
        for svc in started:
            svc.stop()


def _queue_one(svc, user: str) -> dict:
    status, body = http(svc, "POST", "/leases", {"fraction": 1.0, "wait": 600}, token=svc.extra_tokens[user])
    assert status == 201 and body["state"] in ("starting", "queued"), body
    return body


def test_a_thousand_queued_requests_of_one_user_leave_the_others_answered(silent_pool):
    svc = silent_pool(max_queued_per_user=2000, max_active_per_user=2000)
    done = threading.Event()
    answered: list[str] = []

    def others() -> None:
        """ann's calls while the flood goes on: each must be answered as usual."""
        ann = svc.extra_tokens["ann"]
        mine = None
        while not done.is_set():
            assert http(svc, "GET", "/health", prefix="", token=None)[0] == 200
            status, body = http(svc, "GET", "/leases", token=ann)
            assert status == 200, body
            if mine is None:
                mine = _queue_one(svc, "ann")["id"]
            status, body = http(svc, "GET", f"/leases/{mine}", token=ann)
            assert status == 200 and body["state"] == "queued", body
            assert http(svc, "GET", "/pool", token=ann)[0] == 200
            answered.append(mine)

    with ThreadPoolExecutor(17) as pool:
        watcher = pool.submit(others)
        floods = [pool.submit(_queue_one, svc, "flood") for _ in range(1000)]
        states = [f.result(timeout=120)["state"] for f in floods]
        done.set()
        watcher.result(timeout=60)
    assert states.count("starting") == 1 and states.count("queued") == 999
    assert len(answered) >= 3, "ann's calls were not answered during the flood"
    # Fairness: ann never used the pool, the flooder holds it, so ann's request is first in line.
    ann = svc.client("ann").get_lease(answered[0])
    assert ann.queue_position == 1
    # The flooder's own listing answers too, with every place in line told once.
    status, body = http(svc, "GET", "/leases", token=svc.extra_tokens["flood"])
    assert status == 200 and len(body["leases"]) == 500
    places = [lease["queue_position"] for lease in body["leases"] if lease["state"] == "queued"]
    assert len(places) == len(set(places)) == 500 and min(places) >= 2


def test_with_the_default_caps_extra_requests_get_429_naming_the_setting(silent_pool):
    svc = silent_pool()
    for _ in range(11):  # one placed, ten queued: the default c.PoolQuotas.max_queued_per_user
        _queue_one(svc, "flood")
    reply = http(svc, "POST", "/leases", {"fraction": 1.0, "wait": 600}, token=svc.extra_tokens["flood"])
    body = assert_error(reply, 429, "quota_exceeded")
    assert body["limit"] == "max_queued_per_user" and body["cap"] == 10
    assert "c.PoolQuotas.max_queued_per_user = 10" in body["message"]
    # Another user is not held back by the flooder's cap.
    assert _queue_one(svc, "ann")["state"] == "queued"


def test_the_cap_on_active_leases(silent_pool):
    svc = silent_pool(max_active_per_user=2)
    client = svc.client("ann")
    client.create_lease(LeaseRequest(fraction=0.25))
    client.create_lease(LeaseRequest(fraction=0.25))
    with pytest.raises(GPUPoolError) as raised:
        client.create_lease(LeaseRequest(fraction=0.25))
    assert (raised.value.status, raised.value.extra["limit"]) == (429, "max_active_per_user")
    assert "release one first" in raised.value.message
    assert len(client.list_leases()) == 2


def test_a_locked_sqlite_stalls_writes_only(silent_pool):
    """Another process holds the SQLite write lock: a lease request waits for it
    (and gets 503 after the busy timeout), while /health and reads answer."""
    import sqlite3

    svc = silent_pool()
    holder = sqlite3.connect(svc.state_dir / "gpupool.sqlite", isolation_level=None, timeout=1)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with ThreadPoolExecutor(1) as pool:
            write = pool.submit(http, svc, "POST", "/leases", {"fraction": 0.25}, token=svc.extra_tokens["ann"])
            time.sleep(0.5)  # the write is waiting for the lock now (it waits up to 5 s)
            assert not write.done()
            assert http(svc, "GET", "/health", prefix="", token=None)[0] == 200
            assert http(svc, "GET", "/leases", token=svc.extra_tokens["ann"])[0] == 200  # WAL: reads go on
            assert not write.done(), "the checks above did not run while the store was locked"
            assert_error(write.result(timeout=30), 503, "store_busy")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert http(svc, "POST", "/leases", {"fraction": 0.25}, token=svc.extra_tokens["ann"])[0] == 201


# -- auth before body --------------------------------------------------------------------------------------------

def _declare_big_bodies(url: str, path: str, count: int, size: int = 8 * MiB) -> list[socket.socket]:
    """``count`` connections that send headers declaring ``size`` bytes, then 64 KiB, then stall."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    conns = []
    for _ in range(count):
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=30)
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {size}\r\n\r\n".encode() + b"[" * 65536)
        conns.append(conn)
    return conns


def _answer(conn: socket.socket) -> bytes:
    """What the server sent before closing (or within the socket's timeout)."""
    data = b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return data


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_requests_without_a_token_are_refused_before_their_body(tmp_path):
    """40 connections declaring 8 MB each, to the service and to the agent: each
    is answered 401 and closed at once, and neither process grows (tornado would
    have buffered 320 MB before asking who calls)."""
    svc = start_service(tmp_path)
    agent = start_agent(tmp_path, svc)
    try:
        for url, path, pid in ((svc.url, "/api/v1/leases", svc.proc.pid),
                               (agent.url, "/workers", agent.proc.pid)):
            before = _rss(pid)
            conns = _declare_big_bodies(url, path, 40)
            answers = [_answer(conn) for conn in conns]
            grown = _rss(pid) - before
            for conn in conns:
                conn.close()
            assert all(a.startswith(b"HTTP/1.1 401") and b'"unauthorized"' in a for a in answers), answers[0]
            assert answers[0].count(b"HTTP/1.1") == 1  # one answer, then the connection is closed
            assert grown < 40 * MiB, f"{url} grew by {grown / MiB:.0f} MiB"
        # A caller with the token who declares too big a body is told so, in the error shape.
        conn = socket.create_connection(("127.0.0.1", int(svc.url.rsplit(":", 1)[1])), timeout=30)
        conn.sendall(f"POST /api/v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization: token {svc.user_token}\r\n"
                     f"Content-Length: {64 * MiB}\r\n\r\n".encode())
        answer = _answer(conn)
        conn.close()
        assert answer.startswith(b"HTTP/1.1 400") and b"larger than 1048576 bytes" in answer, answer
    finally:
        agent.stop()
        svc.stop()


def test_a_connection_that_stalls_its_headers_is_closed(tmp_path):
    svc = start_service(tmp_path, config={"request_header_timeout": 1})
    try:
        conn = socket.create_connection(("127.0.0.1", int(svc.url.rsplit(":", 1)[1])), timeout=30)
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert _answer(conn) == b""  # closed by the service, within the socket's 30 s
        conn.close()
        assert http(svc, "GET", "/health", prefix="", token=None)[0] == 200
    finally:
        svc.stop()


# -- lease lookups do not tell ids apart by their time -----------------------------------------------------------

def test_a_missing_lease_and_someone_elses_take_the_same_queries(tmp_path):
    from sqlalchemy import event

    from gpupool.hub_plugin.agent_client import AgentClient
    from gpupool.hub_plugin.auth import Identity
    from gpupool.hub_plugin.config import ServiceSettings
    from gpupool.hub_plugin.db import Store
    from gpupool.hub_plugin.pool import Pool
    from gpupool.hub_plugin.models import Lease
    from gpupool.schema import utcnow

    store = Store(f"sqlite:///{tmp_path}/lookup.sqlite")
    store.migrate()
    with store.write() as session:
        session.add(Lease(id="L-0000000000b0", owner="bob", state="queued", fraction=0.5, gpu_count=1, memory=0,
                          idle_timeout=60, heartbeat_ttl=60, created_at=utcnow(), usage_gpu_seconds=0.0, groups=[]))
    statements: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))

    async def probe(lease_id: str) -> tuple[int, list[str]]:
        pool = Pool(ServiceSettings(), store, AgentClient("agent-token"))
        statements.clear()
        try:
            await pool.views.get(Identity("ann"), lease_id)
        except GPUPoolError as exc:
            status = exc.status
        finally:
            pool.state.work.close()
            pool.agents.close()
        return status, [text for text in statements if text != "BEGIN"]

    try:
        theirs = asyncio.run(probe("L-0000000000b0"))
        missing = asyncio.run(probe("L-0000000000b1"))
    finally:
        store.close()
    assert theirs[0] == missing[0] == 404
    assert theirs[1] == missing[1] and len(theirs[1]) == 1 and "leases.owner = ?" in theirs[1][0]


# -- the state directory -----------------------------------------------------------------------------------------

def test_a_state_dir_that_cannot_be_written_is_named_with_the_fix(tmp_path):
    """/sys/kernel exists and takes no new files, even for root."""
    done = subprocess.run([str(GPUPOOL), "service", "--state-dir", "/sys/kernel", "--port", "0"],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr
    assert "cannot write the state directory /sys/kernel" in done.stderr and "--state-dir" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_full_disk_leaves_no_temporary_token_file(tmp_path, monkeypatch):
    from gpupool.hub_plugin import app

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(app.os, "fsync", full)
    with pytest.raises(GPUPoolError) as raised:
        with app._state_dir_errors(tmp_path):
            app._secret_file(tmp_path / "agent_token", "")
    assert f"cannot write the state directory {tmp_path} (No space left on device" in raised.value.message
    assert list(tmp_path.iterdir()) == []
