"""The data plane: bulk bytes between the notebook kernel and a worker, on TCP
connections of their own to the worker's ``transfer_port``, while the Jupyter
comm carries what a transfer is (the values' description and a
:class:`Ticket`: a fresh 256-bit key and a transfer id). Why not the comm
(docs/security.md, "What encryption costs") and the wire, byte by byte:
docs/api.md, "The data plane (bulk bytes)".

A big transfer runs on several connections at once, its *lanes*
(:meth:`Ticket.lanes`): chunk ``n`` goes on lane ``n % lanes``, each lane
on a thread of its own, so sealing and opening chunks (one AES-GCM core is
a few GB/s; ``cryptography`` lets go of the GIL while it works) and the
kernel's copies spread over cores, as parallel TCP streams do in GridFTP's
and ``bbcp``'s bulk copies.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import mmap
import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

#: Bytes per chunk: big enough that per-chunk costs vanish, small enough to stay in cache.
CHUNK = 1 << 20
TAG = 16
#: The ciphers a ticket may name; ``none`` only where the worker's traffic is not encrypted.
CIPHERS = ("aes-256-gcm", "chacha20-poly1305", "none")
_HELLO = b"gpupool-dataplane-hello"
_ID_BYTES = 16
#: Buffers smaller than this are allocated on the heap; larger ones as anonymous mappings (:func:`allocate`).
_MMAP_FROM = 1 << 16
#: Bytes each lane of a transfer carries at least: a lane costs a connection, a hello and a thread.
LANE_BYTES = 16 << 20
#: Most lanes a ticket may ask for (one byte of the hello names the lane).
MAX_STREAMS = 16
#: Most lanes one transfer opens by default (``c.GPUMagics.transfer_streams = 0``): past a few, a
#: link is full before the cores are (one AES-GCM lane moves several GB/s).
AUTO_STREAMS = 4


class TransferError(Exception):
    """A transfer that could not be completed; the message is for a person
    and says what was left unchanged."""


@functools.cache
def default_cipher() -> str:
    """``"aes-256-gcm"`` where the CPU has AES instructions (the ``aes`` flag
    of /proc/cpuinfo, or any non-Linux host), else ``"chacha20-poly1305"``,
    which is fast in software."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return "aes-256-gcm" if "aes" in line.split(":", 1)[1].split() else "chacha20-poly1305"
    except OSError:
        pass
    return "aes-256-gcm"


def streams_for(setting: int = 0) -> int:
    """The most lanes a transfer opens: ``setting`` (``c.GPUMagics.transfer_streams``), or
    for 0 one per CPU core this process may run on, at most :data:`AUTO_STREAMS`."""
    if setting > 0:
        return setting
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(AUTO_STREAMS, cores))


@dataclass(frozen=True)
class Ticket:
    """One transfer's id (16 random bytes), key (32 random bytes), cipher and
    ``streams``: the most connections it may run on (:meth:`lanes`). Made by
    the notebook kernel, sent to the worker on the control channel."""

    id: bytes
    key: bytes
    cipher: str
    streams: int = 1

    @classmethod
    def new(cls, encrypted: bool = True, streams: int = 1) -> "Ticket":
        return cls(os.urandom(_ID_BYTES), os.urandom(32), default_cipher() if encrypted else "none",
                   max(1, min(MAX_STREAMS, streams)))

    def wire(self) -> dict[str, str | int]:
        """The ticket as JSON for the comm: ``{"id", "key", "cipher", "streams"}`` (bytes in hex)."""
        return {"id": self.id.hex(), "key": self.key.hex(), "cipher": self.cipher, "streams": self.streams}

    @classmethod
    def from_wire(cls, data: dict) -> "Ticket":
        """Inverse of :meth:`wire` (``streams`` 1 where a client of before lanes left it out);
        ValueError naming what is wrong."""
        try:
            ident, key, cipher = bytes.fromhex(data["id"]), bytes.fromhex(data["key"]), data["cipher"]
            streams = data.get("streams", 1)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ValueError("a transfer ticket needs hex id, key and a cipher") from None
        if len(ident) != _ID_BYTES or len(key) != 32 or cipher not in CIPHERS:
            raise ValueError(f"a transfer ticket needs a {_ID_BYTES}-byte id, a 32-byte key and one of {CIPHERS}")
        if type(streams) is not int or not 1 <= streams <= MAX_STREAMS:
            raise ValueError(f"a transfer ticket's streams must be a whole number from 1 to {MAX_STREAMS}")
        return cls(ident, key, cipher, streams)

    def lanes(self, sizes: Sequence[int]) -> int:
        """The connections a transfer of buffers of ``sizes`` bytes runs on: one per
        :data:`LANE_BYTES`, at most :attr:`streams`, at least one. Both ends work it out."""
        return max(1, min(self.streams, sum(sizes) // LANE_BYTES))

    def hello(self, lane: int = 0) -> bytes:
        """What a connection for ``lane`` sends first: the id, the lane and a proof of the key."""
        head = self.id + bytes([lane])
        return head + hmac.new(self.key, _HELLO + head, hashlib.sha256).digest()

    def aead(self):
        """The cipher object, or None for ``"none"``."""
        if self.cipher == "none":
            return None
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

        return (AESGCM if self.cipher == "aes-256-gcm" else ChaCha20Poly1305)(self.key)


HELLO_BYTES = _ID_BYTES + 1 + 32


def check_hello(hello: bytes, lookup: Callable[[bytes], Ticket | None]) -> tuple[Ticket, int]:
    """The ticket a client's hello opens and the lane it asks for; TransferError
    when no transfer has that id or the proof was made with another key."""
    ticket = lookup(hello[:_ID_BYTES]) if len(hello) == HELLO_BYTES else None
    if ticket is None:
        raise TransferError("no such transfer is waiting on this worker (it expired, or belongs to another lease)")
    lane = hello[_ID_BYTES]
    if not hmac.compare_digest(ticket.hello(lane), hello):
        raise TransferError("the transfer's key does not match: refused (a key of another lease or transfer?)")
    return ticket, lane


def allocate(size: int) -> memoryview:
    """A writable, zeroed buffer of ``size`` bytes for a receiver to fill
    (anonymous memory for big ones, in transparent huge pages where the
    kernel offers them).

    Fresh memory is what holds a receiver below the wire: the
    kernel zeroes each page it hands out, and in 4 KiB pages it also takes a
    fault per page. Huge pages (2 MiB) take 512 times fewer faults, and
    copying into them misses the TLB less, so they beat even a pre-touched
    buffer of small pages. That is what NumPy asks for its own large arrays
    (``madvise(MADV_HUGEPAGE)``, NumPy 1.16 on). Where the kernel has none
    (``never``, not Linux) the small pages are mapped up front
    (``MAP_POPULATE``), several times cheaper than a fault each.
    """
    if size < _MMAP_FROM:
        return memoryview(bytearray(size))
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if _huge_pages():
        region = mmap.mmap(-1, size, flags=flags)
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
            return memoryview(region)
        except OSError:
            region.close()
    return memoryview(mmap.mmap(-1, size, flags=flags | getattr(mmap, "MAP_POPULATE", 0)))


@functools.cache
def _huge_pages() -> bool:
    """Whether madvise can ask for transparent huge pages here: the kernel's
    mode (/sys/kernel/mm/transparent_hugepage/enabled) is ``always`` or
    ``madvise``, and Python has MADV_HUGEPAGE."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as enabled:
            mode = enabled.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return False
    return mode in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


def _nonce(counter: int) -> bytes:
    return b"\0\0\0\0" + counter.to_bytes(8, "big")


def _aad(ticket: Ticket, counter: int) -> bytes:
    return ticket.id + counter.to_bytes(8, "big")


def _chunks(sizes: Sequence[int]):
    """``(buffer index, start, length)`` of each chunk, in wire order."""
    for index, size in enumerate(sizes):
        for start in range(0, size, CHUNK):
            yield index, start, min(CHUNK, size - start)


def send_buffers(socks: socket.socket | Sequence[socket.socket], ticket: Ticket, buffers: Sequence,
                 progress: Callable[[int], None] | None = None) -> None:
    """Send ``buffers`` (anything with the buffer protocol) as chunks, on the
    lanes ``socks`` (one socket: one lane). ``progress(bytes)`` is called on
    this thread as chunks go. OSError when a connection breaks;
    KeyboardInterrupt passes through (every lane is shut down first; the
    caller closes)."""
    views = [_bytes_view(b) for b in buffers]
    chunks = list(_chunks([v.nbytes for v in views]))
    aead = ticket.aead()

    def lane(sock: socket.socket, number: int, lanes: int, moved: Callable[[int], None]) -> None:
        scratch = memoryview(bytearray(CHUNK + TAG)) if aead is not None else None
        for counter in range(number, len(chunks), lanes):
            index, start, length = chunks[counter]
            piece = views[index][start:start + length]
            if aead is None:
                sock.sendall(piece)
            else:
                out = scratch[:length + TAG]
                aead.encrypt_into(_nonce(counter), piece, _aad(ticket, counter), out)
                sock.sendall(out)
            moved(length)

    _on_lanes(socks, lane, progress)


def _bytes_view(buffer) -> memoryview:
    """A flat byte view of ``buffer`` (a PickleBuffer's raw() is already one; bytes too)."""
    view = memoryview(buffer)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def recv_buffers(socks: socket.socket | Sequence[socket.socket], ticket: Ticket, sizes: Sequence[int],
                 progress: Callable[[int], None] | None = None) -> list[memoryview]:
    """Receive buffers of ``sizes`` bytes into fresh ones (:func:`allocate`),
    on the lanes ``socks`` (as :func:`send_buffers` sent them), and return
    them once every chunk has arrived and verified.

    Raises TransferError naming the chunk when one fails its integrity check
    (tampered with or corrupted) or the sender stops early; the partly
    filled buffers are dropped, so nothing has changed for the caller.
    """
    out = [allocate(size) for size in sizes]
    chunks = list(_chunks(sizes))
    aead = ticket.aead()

    def lane(sock: socket.socket, number: int, lanes: int, moved: Callable[[int], None]) -> None:
        scratch = memoryview(bytearray(CHUNK + TAG)) if aead is not None else None
        for counter in range(number, len(chunks), lanes):
            index, start, length = chunks[counter]
            target = out[index][start:start + length]
            if aead is None:
                recv_exactly(sock, target)
            else:
                sealed = scratch[:length + TAG]
                recv_exactly(sock, sealed)
                try:
                    aead.decrypt_into(_nonce(counter), sealed, _aad(ticket, counter), target)
                except Exception:  # cryptography's InvalidTag: the chunk was altered on the way
                    raise TransferError(f"chunk {counter + 1} of {len(chunks)} failed its integrity check (tampered "
                                        "with or corrupted on the way): the transfer was dropped and nothing "
                                        "changed") from None
            moved(length)

    _on_lanes(socks, lane, progress)
    return out


def _on_lanes(socks: socket.socket | Sequence[socket.socket], lane: Callable, progress: Callable[[int], None] | None
              ) -> None:
    """Run ``lane(sock, number, lanes, moved)`` for each of ``socks``: the first on
    this thread, the others on threads of their own, whose bytes ``moved`` are
    handed to ``progress`` on this thread. The first failure (an interrupt of
    this thread included) shuts every lane down, so none is left blocked, and
    is raised once all have stopped."""
    socks = [socks] if isinstance(socks, socket.socket) else list(socks)
    tally = _Tally(progress)
    failed: list[BaseException] = []  # in the order they came (list.append is atomic)

    def run(number: int, moved: Callable[[int], None]) -> None:
        try:
            lane(socks[number], number, len(socks), moved)
        except BaseException as exc:
            failed.append(exc)
            _shut(socks)

    others = [threading.Thread(target=run, args=(number, tally.add), daemon=True,
                               name=f"gpupool-dataplane-lane-{number}") for number in range(1, len(socks))]
    for other in others:
        other.start()
    run(0, tally.here)
    for other in others:
        other.join()
    if failed:  # the user's interrupt first, whatever it made the other lanes fail with
        raise next((exc for exc in failed if isinstance(exc, KeyboardInterrupt)), failed[0])
    tally.here(0)


def close_all(socks: Sequence[socket.socket]) -> None:
    """Close every one of a transfer's lanes."""
    for sock in socks:
        sock.close()


class _Tally:
    """Bytes moved by every lane, handed to ``progress`` on the first lane's thread (the cell's)."""

    def __init__(self, progress: Callable[[int], None] | None) -> None:
        self.progress, self._others, self._lock = progress, 0, threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._others += nbytes

    def here(self, nbytes: int) -> None:
        with self._lock:
            nbytes, self._others = nbytes + self._others, 0
        if self.progress is not None and nbytes:
            self.progress(nbytes)


def _shut(socks: Sequence[socket.socket]) -> None:
    """Stop every lane: a lane blocked in a send or receive returns at once."""
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def recv_exactly(sock: socket.socket, into: memoryview) -> None:
    """Fill ``into`` from ``sock`` with ``recv_into``; TransferError when the
    peer closes first."""
    got, size = 0, into.nbytes
    while got < size:
        n = sock.recv_into(into[got:])
        if n == 0:
            raise TransferError(f"the connection closed {size - got} bytes early: the transfer was dropped and "
                                "nothing changed")
        got += n


def send_status(sock: socket.socket, error: str | None) -> None:
    """One status: ok (``error`` None) or refused with its reason."""
    if error is None:
        sock.sendall(b"\x01")
    else:
        reason = error.encode()[:65535]
        sock.sendall(b"\x00" + struct.pack(">H", len(reason)) + reason)


def recv_status(sock: socket.socket) -> str | None:
    """Inverse of :func:`send_status`: None for ok, else the reason."""
    head = bytearray(1)
    recv_exactly(sock, memoryview(head))
    if head[0] == 1:
        return None
    size = bytearray(2)
    recv_exactly(sock, memoryview(size))
    reason = bytearray(struct.unpack(">H", size)[0])
    recv_exactly(sock, memoryview(reason))
    return reason.decode(errors="replace")


def connect(address: tuple[str, int], ticket: Ticket, timeout: float, lanes: int = 1) -> list[socket.socket]:
    """The ``lanes`` data connections of a transfer to the worker at
    ``address`` (ip, transfer_port), each past its hello for ``ticket``;
    ``timeout`` seconds a stall may last. OSError when it cannot be reached;
    TransferError when a hello fails or the worker refuses the ticket (with
    its reason). None is left open on failure."""
    socks: list[socket.socket] = []
    try:
        for lane in range(lanes):
            socks.append(_connect_lane(address, ticket, timeout, lane))
    except BaseException:
        close_all(socks)
        raise
    return socks


def _connect_lane(address: tuple[str, int], ticket: Ticket, timeout: float, lane: int) -> socket.socket:
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(ticket.hello(lane))
        refused = recv_status(sock)
    except OSError as exc:
        sock.close()
        raise TransferError(f"the data connection failed ({exc}); nothing changed") from None
    except BaseException:
        sock.close()
        raise
    if refused:
        sock.close()
        raise TransferError(f"the worker refused the transfer: {refused}")
    return sock


class Progress:
    """A one-line progress report for transfers that last over ``after``
    seconds: ``gpupool: pulling 512.0 MiB of 1.0 GiB, 900.0 MiB/s, 1 s left``,
    rewritten in place (carriage return) at most every ``every`` seconds on
    ``out`` (default: sys.stdout, the running cell's output). Call as
    ``progress(n)`` with the bytes just moved, :meth:`done` at the end (or
    when the transfer stops early): the line clears itself.

    A carriage return moves back to the line's start and what follows
    overwrites it, in a terminal as in Jupyter's output area, without
    clearing what is longer: each line is padded to the longest written yet,
    so no tail of an earlier one stays (``0 s leftft``), and :meth:`done`
    blanks it, so that what the cell prints next takes its place.
    """

    def __init__(self, verb: str, total: int, out=None, after: float = 1.0, every: float = 0.25) -> None:
        self.verb, self.total, self.out, self.after, self.every = verb, total, out, after, every
        self.moved, self.start, self.shown, self.width = 0, time.monotonic(), 0.0, 0

    def __call__(self, nbytes: int) -> None:
        self.moved += nbytes
        now = time.monotonic()
        if now - self.start >= self.after and now - self.shown >= self.every:
            self.shown = now
            text = self.line(now)
            self.width = max(self.width, len(text))
            self._write(text.ljust(self.width) + "\r")

    def line(self, now: float) -> str:
        from .units import format_bytes

        elapsed = max(now - self.start, 1e-9)
        rate = self.moved / elapsed
        left = (self.total - self.moved) / rate if rate else 0.0
        return (f"gpupool: {self.verb} {format_bytes(self.moved)} of {format_bytes(self.total)}, "
                f"{format_bytes(int(rate))}/s, {left:.0f} s left")

    def done(self) -> None:
        """Blank the line (only if one was shown); the cursor stays at its start."""
        if self.shown:
            self._write(" " * self.width + "\r")
            self.shown = 0.0

    def _write(self, text: str) -> None:
        out = self.out or sys.stdout
        out.write(text)
        out.flush()
