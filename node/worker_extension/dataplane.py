"""The worker's end of the data plane (:mod:`gpupool.dataplane`).

One listening socket on the worker's ``transfer_port`` (the agent puts it in
the connection file). Its connections are accepted and authenticated on one
thread (:mod:`.hello_gate`: a bounded number wait for their hello, each
under a short deadline); a connection whose hello opens a lane of a
registered transfer is held until every lane of it has come, and the last
to come moves the bytes on all of them (one thread per lane). The kernel's main thread
only registers transfers (from the comm, where it already runs) and, for a
push, takes the verified buffers to unpickle them into the namespace. So a
transfer never blocks a cell, and one the client abandons (interrupt, closed
notebook) changes nothing: its buffers are dropped, never assigned.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from gpupool.dataplane import Ticket, TransferError, close_all, recv_buffers, send_buffers, send_status
from gpupool.wire.transfer import Pulling, Push

from .hello_gate import HelloGate

log = logging.getLogger("gpupool.worker")
#: Seconds a registered transfer waits for its connection before it is dropped.
PENDING_TTL = 120.0
#: Seconds a data connection may stall (no byte moving) before it is dropped.
IDLE_TIMEOUT = 60.0
#: Seconds a push's comm handler waits for the client's data connection.
CONNECT_WAIT = 30.0


@dataclass
class _Pending:
    ticket: Ticket
    sizes: list[int]
    outgoing: Sequence | None = None  # a pull's buffers, to send
    received: list | None = None  # a push's buffers, once all verified
    error: str | None = None
    connected: bool = False  # every lane has come: the bytes are moving
    done: threading.Event = field(default_factory=threading.Event)
    since: float = field(default_factory=time.monotonic)
    lanes: list[socket.socket | None] = field(default_factory=list)  # by lane number, as they come

    def __post_init__(self) -> None:
        self.lanes = [None] * self.ticket.lanes(self.sizes)

    def hang_up(self) -> None:
        """Close the lanes that came (a transfer dropped before all did)."""
        close_all([sock for sock in self.lanes if sock is not None])


class DataPlaneServer:
    """Accepts data connections on ``(ip, port)``; ``encrypted``: refuse
    tickets without an AEAD (the worker's control channel is encrypted, so
    its bulk bytes must be too)."""

    def __init__(self, ip: str, port: int, encrypted: bool) -> None:
        self.encrypted = encrypted
        self.listener = socket.create_server((ip, port))
        self._pending: dict[bytes, _Pending] = {}
        self._lock = threading.Lock()
        self._gate = HelloGate(self.listener, self._lookup, self._accepted)

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    # -- called by the comm handler (the kernel's main thread) --------------------------

    def expect(self, ticket: Ticket, sizes: list[int]) -> None:
        """Register a push of buffers of ``sizes`` bytes; TransferError when
        the ticket's cipher is not allowed here."""
        self._register(_Pending(ticket, [int(s) for s in sizes]))

    def offer(self, ticket: Ticket, buffers: Sequence) -> list[int]:
        """Register a pull: ``buffers`` go to whoever opens ``ticket``; returns their sizes."""
        sizes = [memoryview(b).nbytes for b in buffers]
        self._register(_Pending(ticket, sizes, outgoing=buffers))
        return sizes

    def take(self, ident: bytes, connect_timeout: float = CONNECT_WAIT) -> list:
        """Wait for a push's buffers and return them once all verified;
        TransferError with the reason when they do not all arrive, when no
        connection came within ``connect_timeout`` seconds, or when this
        thread is interrupted. The transfer is forgotten either way."""
        with self._lock:
            pending = self._pending.get(ident)
        if pending is None:
            raise TransferError("no such transfer on this worker (it expired, or was never opened)")
        deadline = time.monotonic() + connect_timeout
        try:
            while not pending.done.wait(0.05):  # short waits: an interrupt reaches this thread
                if not pending.connected and time.monotonic() > deadline:
                    raise TransferError(f"no data connection came within {connect_timeout:.0f}s: nothing changed")
                if not pending.connected and self._hung_up(pending):
                    raise TransferError("the client closed its data connections before they were all open "
                                        "(interrupted?): nothing changed")
        except KeyboardInterrupt:
            raise TransferError("interrupted on the worker: nothing changed") from None
        finally:
            with self._lock:
                self._pending.pop(ident, None)
                pending.error = pending.error or "the worker stopped waiting for this transfer"
                if not pending.connected:
                    pending.hang_up()
        if pending.received is None:
            raise TransferError(pending.error)
        return pending.received

    def _hung_up(self, pending: _Pending) -> bool:
        """Whether a lane that came has been closed by the client while the others are awaited:
        nothing is sent before every lane is in, so a lane with something to read has ended."""
        with self._lock:
            if pending.connected:
                return False
            held = [sock for sock in pending.lanes if sock is not None]
        try:
            readable, _, _ = select.select(held, [], [], 0)
        except (OSError, ValueError):  # closed meanwhile
            readable = held
        with self._lock:  # the last lane may have come meanwhile, and its bytes with it
            return bool(readable) and not pending.connected

    def _register(self, pending: _Pending) -> None:
        refused = None
        if self.encrypted and pending.ticket.cipher == "none":
            refused = "this worker encrypts its traffic: a transfer without encryption is refused"
            pending.error = refused  # its hello is refused at once, with this reason
        now = time.monotonic()
        with self._lock:
            for ident in [i for i, p in self._pending.items() if now - p.since > PENDING_TTL]:
                self._pending.pop(ident).hang_up()  # abandoned: a client that never connected (all its lanes)
            self._pending[pending.ticket.id] = pending
        self._gate.registered()
        if refused:
            raise TransferError(refused)

    # -- the data threads ------------------------------------------------------------------

    def _lookup(self, ident: bytes) -> Ticket | None:
        with self._lock:
            pending = self._pending.get(ident)
        return pending.ticket if pending is not None else None

    def _accepted(self, conn: socket.socket, ticket: Ticket, lane: int) -> None:
        # Only connections that proved they hold a registered ticket get a thread (HelloGate).
        threading.Thread(target=self._serve, args=(conn, ticket, lane), name="gpupool-dataplane-conn",
                         daemon=True).start()

    def _serve(self, conn: socket.socket, ticket: Ticket, lane: int) -> None:
        """Take lane ``lane`` of ``ticket``'s transfer; the last lane to come moves the bytes."""
        conn.settimeout(IDLE_TIMEOUT)
        try:
            pending = self._join(conn, ticket, lane)
        except (TransferError, OSError) as exc:
            self._refuse(conn, None, exc)
            return
        if pending is None:  # held until the others come
            return
        try:
            if pending.outgoing is not None:
                send_buffers(pending.lanes, ticket, pending.outgoing)
                return
            pending.received = recv_buffers(pending.lanes, ticket, pending.sizes)
            pending.done.set()
            for sock in pending.lanes:
                send_status(sock, None)
        except (TransferError, OSError) as exc:
            self._refuse(pending.lanes[0], pending, exc)
        finally:
            pending.hang_up()

    def _join(self, conn: socket.socket, ticket: Ticket, lane: int) -> _Pending | None:
        """Hold ``conn`` as lane ``lane`` of its transfer and accept it (its status
        sent before any byte of the transfer can be); the transfer once every lane
        is in, else None. TransferError when it may not join."""
        with self._lock:
            pending = self._pending.get(ticket.id)
            if pending is None:
                raise TransferError("no such transfer is waiting on this worker (it expired)")
            if lane >= len(pending.lanes):
                raise TransferError(f"lane {lane} is not one this transfer waits for ({len(pending.lanes)} lane(s))")
            if pending.error or pending.connected or pending.lanes[lane] is not None:
                raise TransferError(pending.error or "this transfer is already under way")
            send_status(conn, None)
            pending.lanes[lane] = conn
            if any(sock is None for sock in pending.lanes):
                return None
            pending.connected = True
            if pending.outgoing is not None:  # a pull is sent once
                del self._pending[ticket.id]
            return pending

    @staticmethod
    def _refuse(conn: socket.socket, pending: _Pending | None, exc: Exception) -> None:
        """Say why on ``conn`` and end the transfer (a push's :meth:`take` hears it); ``conn`` is closed."""
        why = str(exc) if isinstance(exc, TransferError) else f"the connection failed: {exc}"
        log.info("data plane transfer dropped: %s", why)
        if pending is not None and pending.outgoing is None:
            pending.error, pending.received = pending.error or why, None
            pending.done.set()
        try:
            send_status(conn, why)
        except OSError:
            pass
        conn.close()

    def close(self) -> None:
        self._gate.close()


def from_connection_file(path: str) -> DataPlaneServer | None:
    """The server for the worker whose connection file is ``path``, listening
    on its ``transfer_port`` (none when the file names no such port: an
    older agent, or a kernel started by hand; transfers then use the comm)."""
    with open(path, encoding="utf-8") as handle:
        info: dict[str, Any] = json.load(handle)
    port = info.get("transfer_port")
    if not port:
        return None
    return DataPlaneServer(info.get("ip") or "127.0.0.1", int(port), encrypted=bool(info.get("curve_secretkey")))


#: Pulls whose buffers total fewer bytes go in the comm message itself (one round trip fewer).
STREAM_MIN = 1 << 20


def pushed_buffers(plane: DataPlaneServer | None, request: Push) -> list:
    """The buffers of a streamed push: register its ``stream`` (a ticket
    with the buffers' ``sizes``) and wait here, in the comm handler, until the
    client's stream has arrived and verified. Raises TransferError (also
    for a ticket this worker refuses) and then changes nothing."""
    if plane is None:
        raise TransferError("this worker has no data plane (its agent gave it no transfer_port)")
    ticket = Ticket.from_wire(request.stream)
    plane.expect(ticket, list(request.stream["sizes"]))
    return plane.take(ticket.id)


def offer_pull(plane: DataPlaneServer | None, request: Pulling, header: dict[str, Any], buffers: list
               ) -> tuple[dict[str, Any], list]:
    """A pull's answer: with a ticket in its ``stream`` and at least
    STREAM_MIN bytes (or any, with ``stream_all``: a move, whose bytes
    go to another worker), the buffers wait on the data plane and
    ``header["stream"]`` lists their sizes; else they go in the comm message."""
    small = sum(memoryview(b).nbytes for b in buffers) < STREAM_MIN and not request.stream_all
    if plane is None or not request.stream or small:
        return header, buffers
    header["stream"] = {"sizes": plane.offer(Ticket.from_wire(request.stream), buffers)}
    return header, []


def start_for_kernel() -> DataPlaneServer | None:
    """The data plane of this worker kernel (None outside an IPKernelApp, or
    without a transfer_port; logged, never raised: the comm still works)."""
    try:
        from ipykernel.kernelapp import IPKernelApp

        if not IPKernelApp.initialized():
            return None
        return from_connection_file(IPKernelApp.instance().abs_connection_file)
    except Exception:  # a port taken meanwhile, an unreadable file: transfers fall back to the comm
        log.warning("could not start the data plane", exc_info=True)
        return None
