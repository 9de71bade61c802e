"""Store work off the event loop, taking turns between callers: every SQL
statement runs in a thread of :class:`StoreWork` (writes on one, reads on a
few), and waiting calls are taken round-robin per caller, so one user's flood
delays another's call by about one call. Callers ``await work.read(fn, *args)``
/ ``await work.write(fn, *args)`` with a plain ``fn`` that opens its own
session (docs/code.md, "Store work off the event loop").
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, Callable, TypeVar

T = TypeVar("T")

#: Who the store work of the current request is for (a user or node name); set by the base handler.
CALLER: ContextVar[str] = ContextVar("gpupool_store_caller", default="service")

#: Reader threads. A few are enough: reads are short, and SQLite serves them from one file.
READERS = 4


class FairQueue:
    """Blocking calls run on ``threads`` threads of their own, at most that
    many at once and at most ``per_caller`` (default: all) of one caller's;
    waiting ones are taken round-robin between callers (FIFO for one caller).
    Lives on the event loop thread (not thread-safe itself).
    """

    def __init__(self, threads: int, name: str, per_caller: int | None = None) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._free = threads
        self._per_caller = per_caller or threads
        # caller -> their waiting calls; dict order is the order turns go round.
        self._waiting: dict[str, deque[tuple[Callable[[], Any], asyncio.Future]]] = {}
        self._running: dict[str, int] = {}

    def waiting(self) -> int:
        """How many calls wait for a thread."""
        return sum(len(calls) for calls in self._waiting.values())

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on one of the threads, in ``CALLER``'s turn; its result or exception."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._waiting.setdefault(CALLER.get(), deque()).append((functools.partial(fn, *args), fut))
        self._dispatch(loop)
        return await fut

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        while self._free:
            # The first caller in turn with room (fewer than ``per_caller`` of theirs running).
            caller = next((c for c in self._waiting if self._running.get(c, 0) < self._per_caller), None)
            if caller is None:
                return
            calls = self._waiting.pop(caller)
            call, fut = calls.popleft()
            if calls:
                self._waiting[caller] = calls  # back of the line
            if fut.cancelled():  # its caller gave up (shutdown): do not start it
                continue
            self._free -= 1
            self._running[caller] = self._running.get(caller, 0) + 1
            job = loop.run_in_executor(self._pool, call)
            job.add_done_callback(functools.partial(self._done, loop, caller, fut))

    def _done(self, loop: asyncio.AbstractEventLoop, caller: str, fut: asyncio.Future, job: asyncio.Future) -> None:
        self._free += 1
        self._running[caller] -= 1
        if not self._running[caller]:
            del self._running[caller]
        if not fut.cancelled():
            if job.exception() is not None:
                fut.set_exception(job.exception())
            else:
                fut.set_result(job.result())
        self._dispatch(loop)

    def close(self) -> None:
        """Wait for running calls to end; start no new ones."""
        self._pool.shutdown(wait=True, cancel_futures=True)


class StoreWork:
    """The service's store threads: :meth:`write` on one writer, :meth:`read` on
    :data:`READERS` readers, callers taking turns (docs/code.md, "Store work
    off the event loop")."""

    def __init__(self, readers: int = READERS) -> None:
        self._writer = FairQueue(1, "gpupool-store-write")
        # One reader per caller at a time: however many calls one user has waiting,
        # the other readers stay free for everyone else.
        self._readers = FairQueue(readers, "gpupool-store-read", per_caller=1)

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` (which writes to the store) on the writer thread."""
        return await self._writer.run(fn, *args)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` (which only reads the store) on a reader thread."""
        return await self._readers.run(fn, *args)

    def waiting(self) -> dict[str, int]:
        """Calls waiting for a thread: ``{"write": n, "read": m}``."""
        return {"write": self._writer.waiting(), "read": self._readers.waiting()}

    def close(self) -> None:
        self._writer.close()
        self._readers.close()
