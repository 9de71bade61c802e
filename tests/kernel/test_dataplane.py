"""The data plane: bulk bytes of push/pull on a TCP connection of their own, AEAD per chunk.

Against a real ipykernel worker with gpupool's extension and CurveZMQ (started
as the agent starts one: a ``transfer_port`` in its connection file), and
once through a notebook kernel on a real pool.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import re
import resource
import signal
import socket
import threading
import time

import numpy as np
import psutil
import pytest
from jupyter_client import KernelManager

from frontend import STAND_IN, remote_value
from service_api import active_leases
from gpupool import dataplane as dataplane_core
from gpupool import dataplane as gpupool_dataplane
from gpupool.dataplane import CHUNK, HELLO_BYTES, LANE_BYTES, Progress, Ticket, TransferError, recv_buffers, send_buffers
from gpupool.errors import GPUPoolError, Reason
from gpupool.magics import dataplane
from gpupool.remote import RemoteKernel
from gpupool.node.worker_extension.dataplane import DataPlaneServer
from gpupool.transfer import load_pulled
from gpupool.wire.transfer import TARGET, Pull
from frontend import run


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class _WorkerManager(KernelManager):
    """As the agent's: the data plane's port goes into the connection file."""

    def write_connection_file(self, **kwargs):
        kwargs.setdefault("transfer_port", _free_port())
        super().write_connection_file(**kwargs)


@pytest.fixture(scope="module")
def worker():
    """``(remote, connection)``: a CurveZMQ worker kernel with the extension and its client."""
    km = _WorkerManager(kernel_name="python3", ip="127.0.0.1", transport_encryption="required")
    km.start_kernel(extra_arguments=["--IPKernelApp.extra_extensions=gpupool.node.worker_extension"])
    with open(km.connection_file) as handle:
        written = json.load(handle)
    connection = {k: v for k, v in written.items() if k != "curve_secretkey"}
    remote = RemoteKernel(connection)
    try:
        remote.wait_ready(60)
        yield remote, connection
    finally:
        remote.close()
        km.shutdown_kernel(now=True)


def _comm(remote, seen: list | None = None):
    def comm(request, buffers):
        if seen is not None:
            seen.append(request.OP.value)
        answer, got = remote.comm_request(TARGET, request.to_json(), buffers, timeout=60)
        if not answer.get("ok"):
            raise GPUPoolError(Reason.transfer_failed, answer.get("message", ""), 502)
        return answer, got
    return comm


def _pull(remote, connection, names, **kw):
    header, buffers = dataplane.pull(_comm(remote), connection, Pull(names=names), progress=False, **kw)
    return load_pulled(header, buffers), header


def _on_worker(remote, expression: str) -> str:
    """``repr`` of ``expression`` evaluated on the worker."""
    out = []
    remote.execute(f"print(repr(({expression})))", lambda msg: out.append(msg))
    return "".join(m["content"].get("text", "") for m in out if m["header"]["msg_type"] == "stream").strip() or [m["content"] for m in out]


# -- through a real worker --------------------------------------------------------------------------------------------

def test_values_of_every_kind_round_trip_over_the_data_plane(worker):
    import pandas as pd
    import torch

    remote, connection = worker
    big = np.arange(3 * CHUNK // 8, dtype=np.float64).reshape(-1, 3)  # 3 MiB: several chunks, a short last one
    values = {"c_order": big, "fortran": np.asfortranarray(big), "view": big[::2, 1:],
              "objects": np.array([{"a": 1}, "text", None], dtype=object),
              "tensor": torch.arange(6.0, requires_grad=True), "bf16": torch.ones(4, 3, dtype=torch.bfloat16),
              "frame": pd.DataFrame({"x": np.arange(1000), "y": np.linspace(0, 1, 1000)}),
              "nested": {"list": [big[:10], (1, "two")], "set": {3}}}
    ops: list[str] = []
    chunks: list[int] = []
    header, answer = dataplane.push(_comm(remote, ops), connection, values, {}, progress=chunks.append)
    assert len(chunks) > 3 and max(chunks) == CHUNK, "the buffers went on the data plane"
    assert ops == ["push"]
    assert sorted(answer["loaded"]) == sorted(values) and not answer["errors"]
    assert _on_worker(remote, "fortran.flags.f_contiguous, view.shape, tensor.requires_grad, str(bf16.dtype)") == \
        "(True, (65536, 2), True, 'torch.bfloat16')"

    (back, items, errors), pulled = _pull(remote, connection, sorted(values))
    assert "stream" in pulled and not errors
    for name in ("c_order", "fortran", "view"):
        assert np.array_equal(back[name], values[name]) and back[name].dtype == values[name].dtype
    assert back["fortran"].flags.f_contiguous and back["c_order"].flags.writeable
    assert list(back["objects"]) == [{"a": 1}, "text", None]
    assert torch.equal(back["tensor"].detach(), values["tensor"].detach()) and back["tensor"].requires_grad
    assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["bf16"], values["bf16"])
    pd.testing.assert_frame_equal(back["frame"], values["frame"])
    assert np.array_equal(back["nested"]["list"][0], big[:10]) and back["nested"]["list"][1] == (1, "two")


#: The stand-in GPU array of the remoting tests, with a payload big enough for the data plane.
FAKE_GPU = STAND_IN + "import numpy as np\non_gpu = FakeGPUArray(np.ones(2 * 2**20, dtype=np.uint8), 'cuda:0')\n"


def test_a_device_value_lands_on_the_cpu_and_goes_back_to_its_device(worker):
    remote, connection = worker
    remote.execute(FAKE_GPU, lambda msg: None)
    (back, items, _), header = _pull(remote, connection, ["on_gpu"])
    assert "stream" in header and back["on_gpu"].device == "cpu" and items[0]["device"] == "cuda:0"
    remote.execute("del on_gpu", lambda msg: None)
    _, answer = dataplane.push(_comm(remote), connection, {"on_gpu": back["on_gpu"]}, {"on_gpu": "cuda:0"},
                               progress=False)
    assert answer["loaded"] == ["on_gpu"]
    assert _on_worker(remote, "on_gpu.device, int(on_gpu.data.sum())") == f"('cuda:0', {2 * 2**20})"


class _Tamper:
    """A TCP relay to the worker's data port that flips one byte at ``offset``
    of the stream going ``way`` (``"up"``: to the worker) on the ``lane``-th
    connection it accepts (a transfer's lanes connect in order); ``accepted``
    counts the connections. ``offset`` None: a plain relay."""

    def __init__(self, port: int, way: str, offset: int | None, lane: int = 0) -> None:
        self.port, self.way, self.offset, self.lane = port, way, offset, lane
        self.accepted = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            tampered = self.offset is not None and self.accepted == self.lane
            self.accepted += 1
            for src, dst, way in ((client, upstream, "up"), (upstream, client, "down")):
                threading.Thread(target=self._pipe, args=(src, dst, tampered and way == self.way), daemon=True).start()

    def _pipe(self, src, dst, tamper: bool) -> None:
        seen = 0
        try:
            while data := bytearray(src.recv(1 << 16)):
                if tamper and seen <= self.offset < seen + len(data):
                    data[self.offset - seen] ^= 0x01
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):  # wakes the other direction's thread too
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()


def test_a_tampered_chunk_is_refused_and_changes_nothing(worker):
    remote, connection = worker
    second_chunk = HELLO_BYTES + CHUNK + 16 + 1000  # past the hello and the first sealed chunk
    relay = _Tamper(connection["transfer_port"], "up", second_chunk)
    via = {**connection, "transfer_port": relay.listener.getsockname()[1]}
    with pytest.raises(GPUPoolError, match=r"^chunk \d+ of \d+ failed its integrity check.*nothing changed"):
        dataplane.push(_comm(remote), via, {"tampered": np.ones(3 * CHUNK, np.uint8)}, {}, progress=False)
    assert _on_worker(remote, "'tampered' in globals()") == "False"

    remote.execute(f"import numpy as np\nsecret = np.ones({3 * CHUNK}, np.uint8)", lambda msg: None)
    relay = _Tamper(connection["transfer_port"], "down", 1 + 10)  # past the status byte
    via = {**connection, "transfer_port": relay.listener.getsockname()[1]}
    with pytest.raises(GPUPoolError, match=r"chunk 1 of \d+ failed its integrity check.*nothing changed"):
        _pull(remote, via, ["secret"])


def test_a_transfer_with_another_key_or_without_encryption_is_refused(worker):
    remote, connection = worker
    server = DataPlaneServer("127.0.0.1", 0, encrypted=True)
    try:
        ticket = Ticket.new()
        server.expect(ticket, [CHUNK])
        forged = Ticket(ticket.id, Ticket.new().key, ticket.cipher)  # another lease's (or transfer's) key
        with pytest.raises(GPUPoolError, match="refused the transfer: the transfer's key does not match"):
            with dataplane._connect({"ip": "127.0.0.1", "transfer_port": server.port}, forged, [CHUNK]):
                pass
    finally:
        server.close()
    unencrypted = {k: v for k, v in connection.items() if k != "curve_publickey"}  # asks for a plain ticket
    with pytest.raises(GPUPoolError, match="this worker encrypts its traffic: a transfer without encryption is refused"):
        dataplane.push(_comm(remote), unencrypted, {"plain": np.ones(2 * CHUNK, np.uint8)}, {}, progress=False)
    assert _on_worker(remote, "'plain' in globals()") == "False"


def _interrupt_after_first_chunk(nbytes: int) -> None:
    signal.raise_signal(signal.SIGINT)


def test_an_interrupted_transfer_leaves_both_kernels_usable(worker):
    remote, connection = worker
    payload = np.ones(8 * CHUNK, np.uint8)
    with pytest.raises(KeyboardInterrupt):
        dataplane.push(_comm(remote), connection, {"cut": payload}, {}, progress=_interrupt_after_first_chunk)
    remote.execute(f"import numpy as np\nwhole = np.full({8 * CHUNK}, 7, np.uint8)", lambda msg: None)
    with pytest.raises(KeyboardInterrupt):
        dataplane.pull(_comm(remote), connection, Pull(names=["whole"]),
                       progress=_interrupt_after_first_chunk)
    assert _on_worker(remote, "'cut' in globals()") == "False"
    (back, _, _), _ = _pull(remote, connection, ["whole"])  # both ends still work
    assert int(back["whole"][-1]) == 7
    _, answer = dataplane.push(_comm(remote), connection, {"after": payload}, {}, progress=False)
    assert answer["loaded"] == ["after"]


#: A value big enough for two lanes (gpupool.dataplane.LANE_BYTES each), with a short last chunk.
TWO_LANES = 2 * LANE_BYTES + CHUNK // 3


def test_a_big_value_travels_on_several_lanes_both_ways(worker):
    remote, connection = worker
    relay = _Tamper(connection["transfer_port"], "up", None)
    via = {**connection, "transfer_port": relay.listener.getsockname()[1]}
    payload = np.random.default_rng(7).integers(0, 255, TWO_LANES, dtype=np.uint8)
    moved: list[int] = []
    _, answer = dataplane.push(_comm(remote), via, {"laned": payload}, {}, progress=moved.append, streams=4)
    assert answer["loaded"] == ["laned"] and relay.accepted == 2, "two lanes: one per 16 MiB, under the 4 asked"
    assert TWO_LANES <= sum(moved) < TWO_LANES + 1024, "every lane's bytes counted once (and the pickle's few)"
    (back, _, _), _ = _pull(remote, via, ["laned"], streams=4)
    assert relay.accepted == 4 and np.array_equal(back["laned"], payload)
    _, answer = dataplane.push(_comm(remote), via, {"one_lane": payload}, {}, progress=False, streams=1)
    assert answer["loaded"] == ["one_lane"] and relay.accepted == 5, "streams=1: one connection"


def test_a_tampered_chunk_on_another_lane_is_refused_and_changes_nothing(worker):
    """Chunk 2 goes on lane 1; its tag binds it to its transfer and number, whichever lane it came on."""
    remote, connection = worker
    relay = _Tamper(connection["transfer_port"], "up", HELLO_BYTES + 1000, lane=1)
    via = {**connection, "transfer_port": relay.listener.getsockname()[1]}
    with pytest.raises(GPUPoolError, match=r"^chunk 2 of \d+ failed its integrity check.*nothing changed"):
        dataplane.push(_comm(remote), via, {"tampered2": np.ones(TWO_LANES, np.uint8)}, {}, progress=False,
                       streams=2)
    assert _on_worker(remote, "'tampered2' in globals()") == "False"


def test_an_interrupted_transfer_on_lanes_stops_them_all_and_both_kernels_go_on(worker):
    remote, connection = worker
    with pytest.raises(KeyboardInterrupt):
        dataplane.push(_comm(remote), connection, {"cut2": np.ones(TWO_LANES, np.uint8)}, {},
                       progress=_interrupt_after_first_chunk, streams=2)
    assert not [t for t in threading.enumerate() if t.name.startswith("gpupool-dataplane-lane")], "no lane left"
    assert _on_worker(remote, "'cut2' in globals()") == "False"
    _, answer = dataplane.push(_comm(remote), connection, {"after2": np.ones(TWO_LANES, np.uint8)}, {},
                               progress=False, streams=2)
    assert answer["loaded"] == ["after2"]


def test_a_push_interrupted_while_its_lanes_connect_ends_at_once_and_changes_nothing(worker, monkeypatch):
    remote, connection = worker
    real = gpupool_dataplane._connect_lane

    def interrupted_at_lane_2(address, ticket, timeout, lane):
        if lane == 2:
            raise KeyboardInterrupt
        return real(address, ticket, timeout, lane)

    monkeypatch.setattr(gpupool_dataplane, "_connect_lane", interrupted_at_lane_2)
    started = time.monotonic()
    with pytest.raises(dataplane.TransferInterrupted) as caught:
        dataplane.push(_comm(remote), connection, {"early": np.ones(4 * LANE_BYTES, np.uint8)}, {}, progress=False,
                       streams=4)
    assert time.monotonic() - started < 10, "the worker saw the lanes close: no 30 s wait for the rest"
    assert caught.value.moved == 0 and not caught.value.defined
    monkeypatch.undo()
    assert _on_worker(remote, "'early' in globals()") == "False"
    _, answer = dataplane.push(_comm(remote), connection, {"later": np.ones(4 * LANE_BYTES, np.uint8)}, {},
                               progress=False, streams=4)
    assert answer["loaded"] == ["later"]


IDLE_FLOOD = 3000


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip(f"this test holds {wanted} sockets and the fd limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def test_idle_unauthenticated_connections_cost_the_worker_no_thread_and_a_push_still_works(worker):
    """3,000 connections that never send a hello (ungated, each would hold a thread and an fd until
    its hello was checked, up to the process's fd limit): the worker's threads stay as they were, its
    fds within the gate's bound, and a real push gets through meanwhile. A connection whose hello
    never comes is closed after the hello deadline; one with a forged hello is refused at once."""
    from gpupool.node.worker_extension import hello_gate

    remote, connection = worker
    _raise_fd_limit(IDLE_FLOOD + 1024)
    worker_pid = int(_on_worker(remote, "__import__('os').getpid()"))
    proc = psutil.Process(worker_pid)
    threads, fds = proc.num_threads(), proc.num_fds()
    address = (connection["ip"], int(connection["transfer_port"]))
    idle = []
    try:
        for _ in range(IDLE_FLOOD):
            idle.append(socket.create_connection(address, timeout=10))
        peak_threads, peak_fds = proc.num_threads(), proc.num_fds()
        _, answer = dataplane.push(_comm(remote), connection, {"amid_flood": np.ones(4 * CHUNK, np.uint8)}, {},
                                   progress=False)
        assert answer["loaded"] == ["amid_flood"]
        during = max(peak_threads, proc.num_threads()), max(peak_fds, proc.num_fds())
    finally:
        for sock in idle:
            sock.close()
    assert during[0] <= threads + 2, f"threads {threads} -> {during[0]} under {IDLE_FLOOD} idle connections"
    assert during[1] <= fds + hello_gate.MAX_WAITING + 8, f"fds {fds} -> {during[1]}"
    assert _on_worker(remote, "int(amid_flood.sum())") == str(4 * CHUNK)

    with socket.create_connection(address, timeout=30) as silent:  # no hello: closed after the deadline
        began = time.monotonic()
        assert silent.recv(1) == b""
        assert time.monotonic() - began <= hello_gate.HELLO_TIMEOUT + 2
    with socket.create_connection(address, timeout=30) as forged:  # a hello nobody registered: refused in words
        forged.sendall(Ticket.new().hello())
        assert "no such transfer" in dataplane.recv_status(forged)
    wait = time.monotonic() + 10
    while proc.num_fds() > fds + 2 and time.monotonic() < wait:
        time.sleep(0.1)
    assert proc.num_fds() <= fds + 2, "the idle connections were all closed"


# -- the protocol alone ------------------------------------------------------------------------------------------------

def test_plain_chunks_without_encryption_arrive_whole():
    server = DataPlaneServer("127.0.0.1", 0, encrypted=False)
    try:
        ticket = Ticket.new(encrypted=False)
        payload = [np.arange(CHUNK + 5, dtype=np.uint8), b"tail"]
        server.expect(ticket, [memoryview(b).nbytes for b in payload])
        connection = {"ip": "127.0.0.1", "transfer_port": server.port}
        with dataplane._connect(connection, ticket, [memoryview(b).nbytes for b in payload]) as socks:
            send_buffers(socks, ticket, payload)
            assert dataplane.recv_status(socks[0]) is None
        got = server.take(ticket.id)
        assert bytes(got[0]) == payload[0].tobytes() and bytes(got[1]) == b"tail"
    finally:
        server.close()


def test_a_lane_the_transfer_does_not_have_is_refused_and_nothing_stays_open():
    server = DataPlaneServer("127.0.0.1", 0, encrypted=True)
    try:
        ticket = Ticket.new(streams=2)
        server.expect(ticket, [CHUNK])  # 1 MiB: one lane, whatever the ticket allows
        with pytest.raises(TransferError, match="lane 1 is not one this transfer waits for"):
            dataplane.connect(("127.0.0.1", server.port), ticket, 5, lanes=2)
        # Lane 0 had come (the whole transfer, here) and was closed with the refusal: dropped, nothing taken.
        with pytest.raises(TransferError, match="closed .* early"):
            server.take(ticket.id, connect_timeout=5)
    finally:
        server.close()


def test_a_push_whose_lanes_do_not_all_come_is_dropped_and_its_lane_closed():
    server = DataPlaneServer("127.0.0.1", 0, encrypted=True)
    try:
        ticket = Ticket.new(streams=2)
        server.expect(ticket, [2 * LANE_BYTES])
        first, = dataplane.connect(("127.0.0.1", server.port), ticket, 5, lanes=1)  # lane 0 of 2
        with first:
            with pytest.raises(TransferError, match="no data connection came within 1s"):
                server.take(ticket.id, connect_timeout=1.0)
            first.settimeout(5)
            assert first.recv(1) == b"", "the worker closed the lane it held"
    finally:
        server.close()


def test_a_push_whose_client_hangs_up_before_all_lanes_came_is_dropped_at_once():
    """An interrupt while the lanes connect closes those that came: the worker stops waiting then,
    not at its 30 s deadline for connections."""
    server = DataPlaneServer("127.0.0.1", 0, encrypted=True)
    try:
        ticket = Ticket.new(streams=2)
        server.expect(ticket, [2 * LANE_BYTES])
        first, = dataplane.connect(("127.0.0.1", server.port), ticket, 5, lanes=1)  # lane 0 of 2
        first.close()
        started = time.monotonic()
        with pytest.raises(TransferError, match="closed its data connections before they were all open"):
            server.take(ticket.id)
        assert time.monotonic() - started < 10
    finally:
        server.close()


def test_interrupts_while_a_push_awaits_its_answer_never_leave_the_answer_thread_running():
    """The worker's sockets are the answer thread's until it ends: Ctrl-C, twice, waits for it."""
    def slow_comm(request, buffers):
        time.sleep(1.0)
        return {"ok": True, "loaded": ["x"]}, []

    for interruptible in (False, True):
        asked = dataplane._Asked(slow_comm, None)
        for delay in (0.2, 0.4):
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)).start()
        if interruptible:
            with pytest.raises(KeyboardInterrupt):
                asked.answer()
        else:
            assert asked.answer(interruptible=False) == {"ok": True, "loaded": ["x"]}
        assert asked.finished.is_set() and asked.result == {"ok": True, "loaded": ["x"]}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sender_that_stops_early_is_named():
    ticket = Ticket.new()
    left, right = socket.socketpair()
    with left, right:
        send_buffers(left, ticket, [b"x" * 100])
        left.shutdown(socket.SHUT_WR)
        with pytest.raises(TransferError, match="closed .* early.*nothing changed"):
            recv_buffers(right, ticket, [CHUNK])


def test_a_receiver_that_goes_away_ends_an_encrypted_send_with_the_error():
    """A peer gone mid-transfer ends the sender's send_buffers with the socket's error, not a hang."""
    ticket = Ticket.new()
    left, right = socket.socketpair()
    with left:
        right.close()
        with pytest.raises(OSError):
            send_buffers(left, ticket, [np.zeros(16 * CHUNK, np.uint8)])


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def test_a_big_receive_buffer_is_in_huge_pages_where_the_kernel_offers_them():
    """A fresh 4 KiB-paged destination holds the receiver to about half the wire."""
    if not dataplane_core._huge_pages():
        pytest.skip("this kernel offers no transparent huge pages (/sys/kernel/mm/transparent_hugepage/enabled)")
    buffer = dataplane_core.allocate(64 * CHUNK)
    buffer[::4096] = b"\1" * len(buffer[::4096])  # what receiving into it does
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert _anon_huge_kib(address) > 0


def test_the_progress_line_gives_bytes_rate_and_time_left():
    out = io.StringIO()
    meter = Progress("pushing", 4 * 2**20, out=out, after=0.0, every=0.0)
    meter(2**20)
    meter.done()
    first, _, last = out.getvalue().partition("\r")
    assert first.startswith("gpupool: pushing 1.0 MiB of 4.0 MiB, ") and "/s, " in first and first.endswith(" s left")
    assert not last.strip() and last.endswith("\r"), "done blanks the line for what comes next"


# -- through a notebook kernel on a real pool ------------------------------------------------------------------------

def test_push_and_pull_use_the_port_the_agent_lists(e2e_pool, kernel):
    service, _, _ = e2e_pool
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25").ok
    lease, = active_leases(service)
    port = lease.connection["transfer_port"]
    assert port not in [v for k, v in lease.connection.items() if k.endswith("_port") and k != "transfer_port"]
    assert run(kc, "%%local\nimport numpy as np\nbig = np.arange(2**20, dtype=np.float64)").ok
    pushed = run(kc, "%gpu push big")
    assert pushed.ok and "pushed 1 variable: big (numpy.ndarray, 8.0 MiB)" in pushed.stdout, pushed.text()
    assert remote_value(kc, "float(big.sum()), bool(big.flags.writeable)") == (float(2**20 * (2**20 - 1) / 2), True)
    assert run(kc, "twice = big * 2").ok
    pulled = run(kc, "%gpu pull twice")
    assert pulled.ok, pulled.text()
    assert remote_value(kc, "%%local\nfloat(twice[-1])") == 2.0 * (2**20 - 1)


def rendered(text: str) -> str:
    """Stream text as Jupyter shows it: a carriage return goes back to the line's start and what
    follows overwrites it without clearing a longer tail (JupyterLab's fixCarriageReturn, a terminal)."""
    lines = []
    for line in text.split("\n"):
        shown = ""
        for part in line.split("\r"):
            shown = part + shown[len(part):]
        lines.append(shown)
    return "\n".join(lines)


def test_a_rewritten_progress_line_leaves_no_residue_and_clears_itself():
    out = io.StringIO()
    meter = Progress("pushing", 10 * 2**30, out=out, after=0.0, every=0.0)
    meter.start -= 100  # slow at first: "... 900 s left"
    meter(2**20)
    meter.start += 99.99  # then fast: "... 0 s left", shorter
    meter(10 * 2**30 - 2**20)
    assert rendered(out.getvalue()).rstrip().endswith(" 0 s left"), rendered(out.getvalue())
    meter.done()
    out.write("gpupool: pushed 1 variable: x\n")
    assert rendered(out.getvalue()).rstrip() == "gpupool: pushed 1 variable: x"


INTERRUPTED = 2**31  # 2 GiB: more than a second on this machine's data plane, so the progress line shows first


def _interrupt_when(km, kc, code: str, shown: str, timeout: float = 120):
    """Run ``code``; once a stream output holds ``shown``, interrupt the kernel as the stop button does.
    Returns ``(reply content, outputs, interrupted)``."""
    msg_id = kc.execute(code)
    outputs, interrupted, idle = [], False, False
    deadline = time.monotonic() + timeout
    while not idle and time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except Exception:  # queue.Empty
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status":
            idle = content["execution_state"] == "idle"
        elif kind != "execute_input":
            outputs.append((kind, content))
            if not interrupted and kind == "stream" and shown in content.get("text", ""):
                km.interrupt_kernel()
                interrupted = True
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=timeout)
    return reply["content"], outputs, interrupted


def _one_line_error(outputs, reply) -> str:
    """The cell's words on stderr, after checking that nothing else failed loudly: no traceback, no frames."""
    assert reply["status"] == "error" and reply.get("ename") == "UsageError", (reply, outputs)
    assert not [c for kind, c in outputs if kind == "error"], "a traceback was shown"
    text = "".join(c.get("text", "") for kind, c in outputs if kind == "stream")
    assert "Traceback" not in text and ".py" not in text, text
    stdout = "".join(c["text"] for kind, c in outputs if kind == "stream" and c["name"] == "stdout")
    assert not rendered(stdout).strip(), f"the progress line stayed: {rendered(stdout)!r}"
    stderr = "".join(c["text"] for kind, c in outputs if kind == "stream" and c["name"] == "stderr")
    assert stderr.count("\n") == 1, stderr
    return stderr


@pytest.mark.timeout(400)
def test_interrupted_push_pull_and_release_say_one_line_of_what_changed(e2e_pool, kernel):
    km, kc = kernel
    assert run(kc, "%gpu acquire 0.25").ok
    assert run(kc, f"%%local\nimport numpy as np\nbulk = np.ones({INTERRUPTED}, np.uint8)").ok
    reply, outputs, interrupted = _interrupt_when(km, kc, "%gpu push bulk", "gpupool: pushing")
    if not interrupted:
        pytest.skip("the push ended within a second, before its progress line: nothing to interrupt here")
    line = _one_line_error(outputs, reply)
    assert re.fullmatch(r"UsageError: push interrupted at [\d.]+ [KMG]iB of 2\.0 GiB; nothing was defined on the "
                        r"worker\n", line), line
    assert run(kc, 'print("bulk" in globals())').stdout == "False\n", "the worker holds nothing of it"

    assert run(kc, "%%local\ndel bulk").ok
    assert run(kc, f"import numpy as np\nback = np.ones({INTERRUPTED}, np.uint8)").ok  # on the worker
    reply, outputs, _ = _interrupt_when(km, kc, "%gpu pull back", "gpupool: pulling")
    line = _one_line_error(outputs, reply)
    assert re.fullmatch(r"UsageError: pull interrupted at [\d.]+ [KMG]iB of 2\.0 GiB; nothing was changed here\n",
                        line), line
    assert run(kc, '%%local\nprint("back" in globals())').stdout == "False\n"

    assert run(kc, '%%local\n%config GPUMagics.release_state_cap = "4GiB"').ok  # back is 2 GiB, the cap's default
    reply, outputs, interrupted = _interrupt_when(km, kc, "%gpu release", "gpupool: pulling")
    if not interrupted:  # a warm page cache can bring 2 GiB back within the second before the progress line
        assert reply["status"] == "ok" and "brought back 1 variable (back; 2.0 GiB)" in str(outputs), outputs
        pytest.skip("the release's pull ended before its progress line: nothing to interrupt here")
    line = _one_line_error(outputs, reply)
    lease = re.search(r"(L-[0-9a-f]+) is still attached", line)
    assert lease and "release interrupted at " in line and "nothing came back" in line, line
    assert "%gpu release --discard" in line
    assert lease.group(1) in run(kc, "%gpu status").text(), "still attached"
    assert "released" in run(kc, "%gpu release --discard").stdout
