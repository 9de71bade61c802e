"""The data plane's front door: every connection to a worker's
``transfer_port`` is accepted, and its hello read, on one thread (a
selector), under a deadline and with a bound on how many connections may be
waiting at once. Only a connection whose hello opens a registered transfer
(:func:`gpupool.dataplane.check_hello`) is handed on, to a thread of its own.

So connections that never authenticate cost the worker no thread and at
most :data:`MAX_WAITING` file descriptors, however many there are: the
oldest waiting one is closed to make room for a new one (a real client
sends its hello at once, so it is never the oldest for long), and each is
closed :data:`HELLO_TIMEOUT` seconds after it was accepted if its hello has
not come, or :data:`REGISTER_WAIT` seconds after a hello that names no
transfer yet (the comm request that registers it and the connection leave
the client together; either may arrive first).
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from gpupool.dataplane import HELLO_BYTES, Ticket, TransferError, check_hello, send_status

log = logging.getLogger("gpupool.worker")
#: Connections that may wait for their hello (or for its transfer) at once.
MAX_WAITING = 64
#: Seconds a connection may take to send its hello.
HELLO_TIMEOUT = 5.0
#: Seconds a hello waits for its transfer to be registered.
REGISTER_WAIT = 10.0


@dataclass
class _Waiting:
    conn: socket.socket
    deadline: float
    hello: bytearray = field(default_factory=lambda: bytearray(HELLO_BYTES))
    got: int = 0

    @property
    def complete(self) -> bool:
        return self.got == HELLO_BYTES


class HelloGate:
    """Serves ``listener`` on a thread of its own. ``lookup(id)``: the ticket
    of the registered transfer ``id`` (16 bytes) or None, without waiting;
    ``accept(conn, ticket, lane)``: called on the gate's thread for a connection
    whose hello checked out (blocking mode, no timeout set); it must return
    at once (start a thread). Call :meth:`registered` after each new
    registration and :meth:`close` to stop."""

    def __init__(self, listener: socket.socket, lookup: Callable[[bytes], Ticket | None],
                 accept: Callable[[socket.socket, Ticket, int], None], *, max_waiting: int = MAX_WAITING,
                 hello_timeout: float = HELLO_TIMEOUT, register_wait: float = REGISTER_WAIT) -> None:
        self.listener, self.lookup, self.accept = listener, lookup, accept
        self.max_waiting, self.hello_timeout, self.register_wait = max_waiting, hello_timeout, register_wait
        self._waiting: OrderedDict[int, _Waiting] = OrderedDict()  # by fd, oldest first
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for sock in (listener, self._wake_r, self._wake_w):
            sock.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gpupool-dataplane", daemon=True)
        self._thread.start()

    def registered(self) -> None:
        """A transfer was registered: hellos waiting for one are checked again."""
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake is pending anyway) or closed
            pass

    def close(self) -> None:
        self._closed = True
        self.registered()
        self._thread.join(5)

    @property
    def waiting(self) -> int:
        """Connections waiting for their hello or its transfer now."""
        return len(self._waiting)

    # -- the gate's thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closed:
                timeout = None
                if self._waiting:
                    timeout = max(0.0, min(w.deadline for w in self._waiting.values()) - time.monotonic())
                for key, _ in self._selector.select(timeout):
                    if key.data == "listener":
                        self._accept_all()
                    elif key.data == "wake":
                        self._drain_wakes()
                        self._check_complete()
                    else:
                        self._read(key.fileobj)
                self._expire(time.monotonic())
        finally:
            for fd in list(self._waiting):
                self._drop(fd)
            self._selector.close()
            for sock in (self.listener, self._wake_r, self._wake_w):
                sock.close()

    def _accept_all(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: the next round retries
                log.warning("data plane: cannot accept a connection: %s", exc)
                return
            while len(self._waiting) >= self.max_waiting:
                self._drop(next(iter(self._waiting)))  # the oldest makes room
            conn.setblocking(False)
            self._waiting[conn.fileno()] = _Waiting(conn, time.monotonic() + self.hello_timeout)
            self._selector.register(conn, selectors.EVENT_READ, "conn")

    def _drain_wakes(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _read(self, conn: socket.socket) -> None:
        waiting = self._waiting.get(conn.fileno())
        if waiting is None:
            return
        try:
            if waiting.complete:  # nothing more may come before the status: the client closed, or breaks the protocol
                self._drop(conn.fileno())
                return
            n = conn.recv_into(memoryview(waiting.hello)[waiting.got:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if n == 0:
            self._drop(conn.fileno())
            return
        waiting.got += n
        if waiting.complete:
            waiting.deadline = time.monotonic() + self.register_wait
            self._decide(conn.fileno(), final=False)

    def _check_complete(self) -> None:
        for fd in [fd for fd, w in self._waiting.items() if w.complete]:
            self._decide(fd, final=False)

    def _decide(self, fd: int, final: bool) -> None:
        """A complete hello: hand its connection on, refuse it (a wrong key), or,
        while its transfer is not registered yet and not ``final``, keep waiting."""
        waiting = self._waiting[fd]
        hello = bytes(waiting.hello)
        if not final and self.lookup(hello[:16]) is None:
            return
        try:
            ticket, lane = check_hello(hello, self.lookup)
        except TransferError as exc:
            log.info("data plane transfer refused: %s", exc)
            self._drop(fd, refusal=str(exc))
            return
        self._forget(fd)
        waiting.conn.setblocking(True)
        self.accept(waiting.conn, ticket, lane)

    def _expire(self, now: float) -> None:
        for fd in [fd for fd, w in self._waiting.items() if w.deadline <= now]:
            if self._waiting[fd].complete:
                self._decide(fd, final=True)  # refused with the reason: no such transfer
            else:
                self._drop(fd)  # no hello in time: closed without a word

    def _forget(self, fd: int) -> socket.socket:
        waiting = self._waiting.pop(fd)
        self._selector.unregister(waiting.conn)
        return waiting.conn

    def _drop(self, fd: int, refusal: str | None = None) -> None:
        conn = self._forget(fd)
        if refusal is not None:
            try:
                send_status(conn, refusal)  # a few bytes: they fit the socket's buffer
            except OSError:
                pass
        conn.close()
