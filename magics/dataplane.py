"""The notebook kernel's end of the data plane (:mod:`gpupool.dataplane`).

Push, pull, the locals sent along with a cell, release, park and resume all
come through :func:`push` and :func:`pull`. Each takes ``comm(request,
buffers) -> (answer, buffers)``, one round trip on the worker's transfer comm
(``request``: a :class:`gpupool.wire.transfer.Request`) that raises unless
the answer is ok, so the attachment (which holds its lock around the whole
transfer) and parking (on a connection of its own) share it.

A push of at least :data:`STREAM_MIN` bytes to a worker with a
``transfer_port`` is one comm round trip with the stream inside it: the
``push`` request carries the ticket and the buffers' sizes, its handler on
the worker waits for the stream, unpickles what verified and answers. The
request waits for that answer on a thread of its own while this thread
streams (the worker's ZeroMQ sockets are used by that thread alone
meanwhile). A pull sends a ticket along and the worker decides
(``header["stream"]``). Smaller transfers, and workers of an older agent,
keep everything in the comm message. A transfer of many MiB runs on several
connections at once (lanes: :meth:`gpupool.dataplane.Ticket.lanes`), up to
``streams`` (:func:`gpupool.dataplane.streams_for`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from typing import Any, Callable

from gpupool.dataplane import (Progress, Ticket, TransferError, close_all, connect, recv_buffers, recv_status,
                               send_buffers, streams_for)
from gpupool.errors import GPUPoolError, Reason
from gpupool.remote import CommInterrupted
from gpupool.transfer import dump_values
from gpupool.units import format_bytes
from gpupool.wire.transfer import Pull, Pulling, Push, Request

#: Pushes whose buffers total fewer bytes go in the comm message (one round trip, no connection).
STREAM_MIN = 1 << 20
#: Seconds a data connection may stall before the transfer counts as failed.
STALL_TIMEOUT = 60.0

Comm = Callable[[Request, list | None], tuple[dict[str, Any], list]]


def ticket_for(connection: dict[str, Any], streams: int = 0) -> Ticket | None:
    """A fresh ticket for a worker with a data plane (None: it has none);
    encrypted whenever its control channel is (CurveZMQ); up to
    :func:`streams_for` ``(streams)`` lanes."""
    if not connection.get("transfer_port"):
        return None
    return Ticket.new(encrypted=bool(connection.get("curve_publickey")), streams=streams_for(streams))


class TransferInterrupted(KeyboardInterrupt):
    """A push or pull the user interrupted (Ctrl-C, the notebook's stop
    button), with where it stopped: ``stage`` (``packing``: before a byte
    left; ``asking``: a pull's request, while the worker packed the values;
    ``moving``: ``moved`` of ``total`` bytes on the data plane; ``waiting``:
    every byte moved, the worker's answer awaited; ``unpacking``: every byte
    here, the values being rebuilt), the ``names`` asked for, and
    ``defined``: the names a push defined on the worker anyway (its answer
    came before the interrupt took effect). Still a KeyboardInterrupt."""

    def __init__(self, stage: str, names: list[str], moved: int = 0, total: int = 0,
                 defined: list[str] | None = None) -> None:
        super().__init__(stage)
        self.stage, self.names, self.moved, self.total = stage, names, moved, total
        self.defined = list(defined or [])

    def where(self) -> str:
        """Where it stopped, in words: ``at 266.0 MiB of 1.0 GiB``, ``while packing``..."""
        if self.stage == "moving":
            return f"at {format_bytes(self.moved)} of {format_bytes(self.total)}"
        if self.stage == "waiting":
            return f"after all {format_bytes(self.total)} had gone"
        return {"packing": "while packing the values", "asking": "while the worker packed the values",
                "unpacking": "while unpacking the values"}.get(self.stage, f"while {self.stage}")


class _Count:
    """Counts the bytes moved and passes them on to ``progress`` (a callable or None)."""

    def __init__(self, progress: Callable[[int], None] | None) -> None:
        self.progress, self.moved = progress, 0

    def __call__(self, nbytes: int) -> None:
        self.moved += nbytes
        if self.progress is not None:
            self.progress(nbytes)


def push(comm: Comm, connection: dict[str, Any], values: dict[str, Any], devices: dict[str, str],
         progress: bool | Callable[[int], None] = True, streams: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """Send ``values`` to the worker; returns ``(header, answer)`` (the
    header's items and errors, the worker's ``loaded`` and ``errors``).
    Raises GPUPoolError ``transfer_failed`` when the stream fails (nothing
    changed on the worker), :class:`TransferInterrupted` when interrupted
    (nothing changed on the worker, unless its ``defined`` says otherwise).
    ``progress``: True for a progress line in the cell's output when the
    stream lasts over a second (cleared at the end), False for none, or a
    callable given the bytes of each chunk. ``streams``: as for :func:`streams_for`."""
    names = list(values)
    try:
        header, buffers = dump_values(values)
    except KeyboardInterrupt:
        raise TransferInterrupted("packing", names) from None
    request = Push(header=header, devices=devices)
    sizes = [memoryview(b).nbytes for b in buffers]
    ticket = ticket_for(connection, streams)
    if ticket is None or sum(sizes) < STREAM_MIN:
        try:
            answer, _ = comm(request, buffers)
        except CommInterrupted as exc:  # the worker was interrupted too; its answer says what it did
            got = exc.answer or {}
            raise TransferInterrupted("waiting", names, sum(sizes), sum(sizes),
                                      got.get("loaded") if got.get("ok") else None) from None
        return header, answer
    request = dataclasses.replace(request, stream={**ticket.wire(), "sizes": sizes})
    asked = _Asked(comm, request)
    meter = _meter(progress, "pushing", sum(sizes))
    count = _Count(meter)
    try:
        with _connect(connection, ticket, sizes) as socks:
            send_buffers(socks, ticket, buffers, count)
            recv_status(socks[0])  # the worker's own answer says why, if it refused
    except (OSError, TransferError, GPUPoolError) as exc:
        asked.answer()  # the worker's reason comes first: it knows more
        raise exc if isinstance(exc, GPUPoolError) else _failed(exc) from None
    except KeyboardInterrupt:  # the connection is closed, so the worker stops waiting (or has it all)
        raise _interrupted_push(asked, names, count.moved, sum(sizes)) from None
    finally:
        if isinstance(meter, Progress):
            meter.done()
    try:
        return header, asked.answer()
    except KeyboardInterrupt:
        raise _interrupted_push(asked, names, sum(sizes), sum(sizes)) from None


def _interrupted_push(asked: "_Asked", names: list[str], moved: int, total: int) -> TransferInterrupted:
    """The interrupt of a streamed push, once the worker has answered (it always does: its stream ended)."""
    asked.answer(quiet=True, interruptible=False)
    result = asked.result or {}
    defined = list(result.get("loaded", [])) if result.get("ok") else []
    return TransferInterrupted("moving" if moved < total else "waiting", names, moved, total, defined)


class _Asked(threading.Thread):
    """``comm(request, None)`` on a thread of its own; :meth:`answer` waits for it."""

    def __init__(self, comm: Comm, request: Request) -> None:
        super().__init__(name="gpupool-push", daemon=True)
        self.comm, self.request = comm, request
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        # Not join() or is_alive(): an interrupt inside Thread.join can leave is_alive() False while the
        # thread still runs (CPython gh-90882), and the caller would then share the worker's sockets with it.
        self.finished = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            self.result, _ = self.comm(self.request, None)
        except BaseException as exc:  # handed to the caller's thread
            self.error = exc
        finally:
            self.finished.set()

    def answer(self, quiet: bool = False, interruptible: bool = True) -> dict[str, Any]:
        """The worker's answer; raises what the request raised (unless
        ``quiet``), and KeyboardInterrupt after the answer when interrupted
        while waiting for it (unless not ``interruptible``). An interrupt never
        ends the wait: leaving would share the worker's sockets with the thread."""
        with _interrupts_held() as held:
            self.finished.wait()  # the worker answers soon once the stream ended, either way
        interrupted = bool(held)
        if interrupted and interruptible:
            raise KeyboardInterrupt
        if self.error is not None and not quiet:
            raise self.error
        return self.result or {}


@contextlib.contextmanager
def _interrupts_held():
    """On the main thread, SIGINT only counted (into the yielded list) instead of raising
    KeyboardInterrupt, so a wait that must not be left cannot be, even between statements."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    before = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, before)


def pull(comm: Comm, connection: dict[str, Any], request: Pulling,
         progress: bool | Callable[[int], None] = True, streams: int = 0
         ) -> tuple[dict[str, Any], list]:
    """Ask the worker for ``request`` (a ``Pull`` or ``PullAll``); returns the
    answer's ``(header, buffers)`` for :func:`gpupool.transfer.load_pulled`.
    Errors as for :func:`push` (:class:`TransferInterrupted` while the bytes
    come); the local namespace is not touched here."""
    ticket = ticket_for(connection, streams)
    if ticket is not None:
        request = dataclasses.replace(request, stream=ticket.wire())
    try:
        answer, buffers = comm(request, None)
    except CommInterrupted:
        raise TransferInterrupted("asking", list(request.names) if isinstance(request, Pull) else []) from None
    header = answer["header"]
    if ticket is None or "stream" not in header:
        return header, buffers
    sizes = [int(size) for size in header["stream"]["sizes"]]
    meter = _meter(progress, "pulling", sum(sizes))
    count = _Count(meter)
    names = [item["name"] for item in header.get("items", [])]
    with _connect(connection, ticket, sizes) as socks:
        try:
            return header, recv_buffers(socks, ticket, sizes, count)
        except (OSError, TransferError) as exc:
            raise _failed(exc) from None
        except KeyboardInterrupt:
            raise TransferInterrupted("moving", names, count.moved, sum(sizes)) from None
        finally:
            if isinstance(meter, Progress):
                meter.done()


def _meter(progress, verb: str, total: int):
    if callable(progress):
        return progress
    return Progress(verb, total) if progress else None


@contextlib.contextmanager
def _connect(connection: dict[str, Any], ticket: Ticket, sizes: list[int]):
    """The data connections to the worker for a transfer of ``sizes`` bytes, past their
    hellos, closed after; GPUPoolError when the worker cannot be reached or refuses the ticket."""
    address = (connection["ip"], int(connection["transfer_port"]))
    try:
        socks = connect(address, ticket, STALL_TIMEOUT, ticket.lanes(sizes))
    except TransferError as exc:
        raise _failed(exc) from None
    except OSError as exc:
        raise GPUPoolError(Reason.transfer_failed, f"could not reach the worker's data port {address[0]}:{address[1]} "
                           f"({exc}); the cluster's network policy must allow it (deploy/kubernetes/README.md)",
                           502) from None
    try:
        yield socks
    finally:
        close_all(socks)


def _failed(exc: BaseException) -> GPUPoolError:
    why = str(exc) if isinstance(exc, TransferError) else f"the data connection failed ({exc}); nothing changed"
    return GPUPoolError(Reason.transfer_failed, why, 502)
