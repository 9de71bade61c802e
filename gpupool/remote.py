"""A blocking connection to one worker kernel over the Jupyter protocol: the
notebook kernel's (``%gpu``, forwarding) and ``gpupool run``'s.

Why not ``jupyter_client.BlockingKernelClient``: the magics run inside a
cell, in the kernel's main thread, while ipykernel's own asyncio loop is
running; the blocking client's sync wrappers need a loop of their own. This
class uses the same building blocks (``jupyter_client.session.Session`` for
signing and framing, pyzmq sockets) with plain polling, so every wait is
bounded and Ctrl-C (SIGINT in the main thread) interrupts it.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

import zmq

from .errors import GPUPoolError, Reason
from .kernelconn import connect_channel, kernel_session
from .kernelmsg import POLL_MS, deserialize

if TYPE_CHECKING:
    from .iopubrelay import IOPubRelay

#: Milliseconds to wait for more of a cell's output before answering its input request.
DRAIN_MS = 20
#: Seconds between pings of the worker's heartbeat channel while waiting on it.
HB_INTERVAL = 1.0
#: Seconds without a heartbeat echo after which the worker counts as unreachable.
#: ipykernel echoes from a thread of its own, so a busy cell still answers.
HB_TIMEOUT = 10.0


class RemoteKernel:
    """Shell, IOPub, stdin and control sockets to a worker.

    ``connection`` is the lease's Jupyter connection info (``ip``,
    ``transport``, ``*_port``, ``key`` as str, ``signature_scheme``, and
    ``curve_publickey`` when the worker encrypts its traffic: every socket,
    the heartbeat's included, is then a CurveZMQ client with a key pair of
    its own, :mod:`gpupool.kernelconn`).
    """

    def __init__(self, connection: dict[str, Any]) -> None:
        self.connection = connection
        self.session = kernel_session(connection, username="gpupool")
        self.context = zmq.Context()
        ident = uuid.uuid4().hex.encode()
        self.shell = self._socket("shell", ident)
        self.stdin = self._socket("stdin", ident)
        self.control = self._socket("control", uuid.uuid4().hex.encode())
        self.iopub = self._socket("iopub")
        self.hb = self._socket("hb")
        self._hb_sent: float | None = None
        self._hb_ok = 0.0
        self._liveness_paused = False  # the worker is frozen (parked): it answers no ping until thawed
        self._relay: IOPubRelay | None = None
        self._debug: zmq.Socket | None = None  # the control socket of the kernel's control thread
        self.poller = zmq.Poller()
        for sock in (self.shell, self.iopub, self.stdin):
            self.poller.register(sock, zmq.POLLIN)

    def _socket(self, channel: str, ident: bytes | None = None) -> zmq.Socket:
        return connect_channel(self.context, self.connection, channel, identity=ident)

    def close(self) -> None:
        """Close the sockets; the worker itself is the agent's to stop."""
        if self._relay is not None:
            self._relay.stop()
        self.context.destroy(linger=0)

    def relay_iopub(self, publish: Callable[[list, list, dict], None]) -> None:
        """Hand the worker's IOPub to a thread that passes every message of a
        request this client did not send itself (the front end's, forwarded
        with their own headers) to ``publish(idents, frames, msg)`` as signed
        frames plus the message with its content undecoded. Messages of this client's own
        requests, and ``status`` messages of all requests (so that a forwarded
        request's end can be awaited), still reach this object's waits."""
        inner = self.context.socket(zmq.PAIR)
        address = f"inproc://gpupool-relay-{uuid.uuid4().hex}"
        inner.bind(address)
        outer = self.context.socket(zmq.PAIR)
        outer.connect(address)
        from .iopubrelay import IOPubRelay  # the notebook kernel's only

        self._relay = IOPubRelay(self.iopub, outer, self.session, publish)
        self.poller.unregister(self.iopub)
        self.iopub = inner
        self.poller.register(inner, zmq.POLLIN)
        self._relay.start()

    def wait_ready(self, timeout: float = 30.0) -> dict[str, Any]:
        """Send ``kernel_info_request`` until IOPub delivers its status (the SUB
        socket has joined) and the reply arrives; returns the reply content.

        Raises GPUPoolError ``worker_unreachable`` after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        saw_iopub = False  # any IOPub message at all: the SUB socket has joined
        while time.monotonic() < deadline:
            msg = self.session.send(self.shell, "kernel_info_request", {})
            reply = None
            until = min(deadline, time.monotonic() + 1.0)
            while time.monotonic() < until and not (reply and saw_iopub):
                for sock, _ in self.poller.poll(POLL_MS):
                    got = self._recv(sock)
                    saw_iopub |= sock is self.iopub and got is not None
                    if sock is self.shell and got and got["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                        reply = got["content"]
                        # The reply came before IOPub joined: ask again soon rather
                        # than waiting out the round (its status then proves the join).
                        until = min(until, time.monotonic() + 0.05)
            if reply and saw_iopub:
                return reply
        raise GPUPoolError(Reason.worker_unreachable, f"the worker at {self.connection['ip']} did not answer "
                           f"within {timeout:.0f}s", 504)

    def _recv(self, sock: zmq.Socket) -> dict[str, Any] | None:
        _, parts = self.session.feed_identities(sock.recv_multipart(copy=False), copy=False)
        return deserialize(self.session, parts)

    def execute(self, code: str, handler: Callable[[dict[str, Any]], None],
                stdin_handler: Callable[[dict[str, Any]], str] | None = None,
                check: Callable[[], None] | None = None,
                user_expressions: dict[str, str] | None = None) -> dict[str, Any]:
        """Run ``code`` on the worker; returns the ``execute_reply`` content once
        the worker is idle again and the reply has arrived (with the values of
        ``user_expressions``, name -> expression, evaluated after a cell that
        succeeded: the reply's ``user_expressions``, as the protocol has them).

        Every IOPub message of this request goes to ``handler`` in order;
        ``input_request`` goes to ``stdin_handler`` whose return value is sent
        back; ``check`` runs between polls and may raise to abandon the cell
        (the lease was lost). KeyboardInterrupt interrupts the worker and waits
        for it to settle: the worker's own ``KeyboardInterrupt`` error then
        reaches ``handler`` like any other; GPUPoolError ``worker_unresponsive``
        when the worker has not settled 10 s after the interrupt.
        """
        msg = self.session.send(self.shell, "execute_request", {
            "code": code, "silent": False, "store_history": True,
            "allow_stdin": stdin_handler is not None, "stop_on_error": True,
            "user_expressions": user_expressions or {}})
        return self._until_idle(msg["header"]["msg_id"], handler, stdin_handler, check)["content"]

    def forward(self, msg: dict[str, Any], stdin_handler: Callable[[dict[str, Any]], str] | None = None,
                check: Callable[[], None] | None = None, wait_idle: bool = True,
                timeout: float | None = None,
                on_reply: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Send a front end's shell request ``msg`` (a deserialized message,
        header and ``msg_id`` kept, so the worker's IOPub is already parented
        to the front end's request) and return the worker's reply message.
        ``on_reply`` gets it the moment it arrives. ``wait_idle``: also wait
        for the worker's idle status of it (every IOPub message of the
        request has then been relayed). Interrupts and errors as for
        :meth:`execute`; GPUPoolError ``worker_timeout`` after ``timeout``
        seconds (None: no bound, a cell may run for days)."""
        if self._relay is not None:
            self._relay.front(msg)
            if wait_idle:
                self._relay.awaited = msg["header"]["msg_id"]  # before the send: its idle may come at once
        self.session.send(self.shell, msg)
        return self._until_idle(msg["header"]["msg_id"], lambda _: None, stdin_handler, check,
                                timeout=timeout, want_idle=wait_idle, on_reply=on_reply)

    def send(self, msg: dict[str, Any]) -> None:
        """Send a front end's shell message that has no reply (``comm_msg``,
        ``comm_close``), header kept."""
        if self._relay is not None:
            self._relay.front(msg)
        self.session.send(self.shell, msg)

    def control_request(self, msg: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        """Send a front end's control request ``msg`` (``debug_request``) and
        return the worker's reply message. Called on the notebook kernel's
        control thread only, which gets a control socket of its own (ZeroMQ
        sockets belong to one thread). Raises GPUPoolError ``worker_timeout``."""
        if self._debug is None:
            self._debug = self._socket("control", uuid.uuid4().hex.encode())
        if self._relay is not None:
            self._relay.front(msg)  # its debug_events
        self.session.send(self._debug, msg)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._debug.poll(POLL_MS):
                got = self._recv(self._debug)
                if got is not None and got["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                    return got
        raise GPUPoolError(Reason.worker_timeout, f"the worker did not answer the {msg['header']['msg_type']} "
                           f"within {timeout:.0f}s", 504)

    def pause_liveness(self, paused: bool) -> None:
        """Pause (or resume) :meth:`check_heartbeat` while the worker is frozen
        on its node (parked): its echoes wait, and HB_TIMEOUT counts again
        from the thaw. Callable from any thread."""
        self._liveness_paused = paused
        if not paused and self._hb_sent is not None:
            self._hb_sent = time.monotonic()

    def check_heartbeat(self) -> None:
        """Ping the worker's heartbeat channel every HB_INTERVAL seconds; raise
        GPUPoolError ``worker_unreachable`` when no echo came for HB_TIMEOUT
        (the worker's node or network is gone: no message would ever come).
        Nothing while paused (:meth:`pause_liveness`)."""
        now = time.monotonic()
        if self._liveness_paused:
            if self._hb_sent is not None:
                self._hb_sent = now
            return
        if self._hb_sent is None:
            if now - self._hb_ok >= HB_INTERVAL:
                self.hb.send(b"ping")
                self._hb_sent = now
            return
        if self.hb.poll(0):
            self.hb.recv()
            self._hb_sent, self._hb_ok = None, now
        elif now - self._hb_sent > HB_TIMEOUT:
            self.hb.close()  # a REQ socket without its reply cannot send again
            self.hb = self._socket("hb")
            self._hb_sent = None
            raise GPUPoolError(Reason.worker_unreachable,
                               f"the worker at {self.connection['ip']} stopped answering for "
                               f"{HB_TIMEOUT:.0f}s: its node or the network may be down. %gpu release frees the "
                               "slice.", 504)

    def comm_request(self, target: str, data: dict[str, Any], buffers: list | None = None,
                     timeout: float = 600.0, check: Callable[[], None] | None = None) -> tuple[dict[str, Any], list]:
        """Open a comm to ``target`` with ``data`` and ``buffers``; return the
        first ``comm_msg`` it sends back as ``(data, buffers)``. Interrupted
        (KeyboardInterrupt), it interrupts the worker, waits for it as for a
        cell, then raises :class:`CommInterrupted` with the worker's answer."""
        comm_id = uuid.uuid4().hex
        msg = self.session.send(self.shell, "comm_open", {"comm_id": comm_id, "target_name": target, "data": data},
                                buffers=buffers or [])
        answer: list[tuple[dict[str, Any], list]] = []

        def collect(reply: dict[str, Any]) -> None:
            if reply["header"]["msg_type"] == "comm_msg" and not answer:
                answer.append((reply["content"]["data"], reply.get("buffers", [])))

        interrupts: list[float] = []
        self._until_idle(msg["header"]["msg_id"], collect, None, check, timeout=timeout, want_reply=False,
                         interrupts=interrupts)
        if interrupts:
            raise CommInterrupted(answer[0][0] if answer else None)
        if not answer:
            raise GPUPoolError(Reason.transfer_failed, f"the worker did not answer the {data.get('op')} request; "
                               "is gpupool installed on the GPU node?", 502)
        return answer[0]

    def interrupt(self) -> None:
        """Send ``interrupt_request`` on the control channel (the worker is
        remote: a signal cannot reach it)."""
        self.session.send(self.control, "interrupt_request", {})

    def _until_idle(self, msg_id: str, handler, stdin_handler, check, timeout: float | None = None,
                    want_reply: bool = True, want_idle: bool = True,
                    on_reply: Callable[[dict[str, Any]], None] | None = None,
                    interrupts: list[float] | None = None) -> dict[str, Any]:
        """Wait for the reply to ``msg_id`` (if ``want_reply``) and the worker's
        idle status of it (if ``want_idle``); returns the reply message (``{}``
        when none was wanted). A KeyboardInterrupt meanwhile interrupts the
        worker and the wait goes on; its time is added to ``interrupts``."""
        reply: dict[str, Any] | None = None
        idle = not want_idle
        deadline = None if timeout is None else time.monotonic() + timeout
        interrupted_at: float | None = None
        while not (idle and (reply is not None or not want_reply)):
            try:
                for sock, _ in self.poller.poll(POLL_MS):
                    got = self._recv(sock)
                    if got is None or got["parent_header"].get("msg_id") != msg_id:
                        continue
                    kind = got["header"]["msg_type"]
                    if sock is self.shell:
                        reply = got
                        if on_reply is not None:
                            on_reply(got)
                    elif sock is self.stdin and kind == "input_request":
                        drain_iopub(self, msg_id, handler)  # what was printed before input() comes first
                        value = stdin_handler(got["content"]) if stdin_handler else ""
                        self.session.send(self.stdin, "input_reply", {"value": value}, parent=got)
                    elif kind == "status":
                        idle = idle or got["content"]["execution_state"] == "idle"
                    else:
                        handler(got)
                if check is not None:
                    check()
                self.check_heartbeat()
                if deadline is not None and time.monotonic() > deadline:
                    raise GPUPoolError(Reason.worker_timeout, f"the worker did not finish within {timeout:.0f}s", 504)
                if interrupted_at is not None and self._liveness_paused:
                    interrupted_at = time.monotonic()  # frozen: the interrupt is taken once it is thawed
                if interrupted_at is not None and time.monotonic() - interrupted_at > 10:
                    raise GPUPoolError(Reason.worker_unresponsive,
                                       "the worker did not stop within 10s of the interrupt; "
                                       "it may be stuck in native code. %gpu restart gives you a fresh worker "
                                       "on a new slice (its variables are lost); %gpu release frees the slice.", 504)
            except KeyboardInterrupt:
                if interrupted_at is None:
                    self.interrupt()
                    interrupted_at = time.monotonic()
                    if interrupts is not None:
                        interrupts.append(interrupted_at)
        return reply or {}


class CommInterrupted(KeyboardInterrupt):
    """A comm request interrupted by the user; ``answer``: what the worker
    answered after its own interrupt (None: nothing), which says whether it
    had done the request anyway."""

    def __init__(self, answer: dict[str, Any] | None) -> None:
        super().__init__("interrupted")
        self.answer = answer


def drain_iopub(remote: RemoteKernel, msg_id: str, handler: Callable[[dict[str, Any]], None]) -> None:
    """Pass ``remote``'s IOPub messages of ``msg_id`` other than ``status`` to
    ``handler`` until none comes for DRAIN_MS: a worker flushes its output
    before it asks for input, but that output travels on another socket."""
    while remote.iopub.poll(DRAIN_MS):
        got = remote._recv(remote.iopub)
        if got is not None and got["parent_header"].get("msg_id") == msg_id and got["header"]["msg_type"] != "status":
            handler(got)


def interrupt_from_thread(connection: dict[str, Any]) -> None:
    """Interrupt the worker in ``connection`` (KeyboardInterrupt in its running
    cell) over a connection of the calling thread's own: another thread may be
    using the main one (ZeroMQ sockets belong to one thread). Waits for the
    reply, since a message sent on a socket closed at once may be dropped;
    raises GPUPoolError ``worker_timeout`` without one."""
    remote = RemoteKernel(connection)
    try:
        remote.control_request(remote.session.msg("interrupt_request", {}))
    finally:
        remote.close()
