"""The warm pool: workers started ahead of any lease, so that a lease attaches
in milliseconds instead of waiting for a kernel to boot. Each is handed out
once and stopped after its lease; those that waited past ``max_age`` are
replaced (docs/code.md, "Workers").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Awaitable, Callable, Generic, TypeVar

W = TypeVar("W")

#: Longest wait, in seconds, before retrying after warm starts kept failing.
MAX_BACKOFF_S = 60.0


class WarmPool(Generic[W]):
    """Keeps ``size`` unbound workers ready.

    ``launch()``: starts one unbound worker and returns it once it answers, or
    raises (the error is logged and retried with a doubling back-off from 1 s
    up to :data:`MAX_BACKOFF_S`). ``discard(worker)``: stops one; errors are
    logged. ``alive(worker)``: False once its process exited. ``max_age``:
    seconds a worker may wait in the pool. ``refill_delay``: seconds between
    handing a worker out and starting its replacement, so that booting a
    kernel does not compete for the CPU with the attach that just happened
    (bench/REPORT.md, "Attach latency", measures both). ``clock``: monotonic seconds (the time seam for tests).

    Call :meth:`start` on the agent's event loop, :meth:`take` from it, and
    :meth:`close` once, when the agent stops.
    """

    def __init__(self, size: int, max_age: float, *, launch: Callable[[], Awaitable[W]],
                 discard: Callable[[W], Awaitable[object]], alive: Callable[[W], bool],
                 refill_delay: float = 0.5, log: logging.Logger | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if size < 0:
            raise ValueError(f"the warm pool size must be 0 or more, got {size}")
        if max_age <= 0:
            raise ValueError(f"the warm workers' maximum age must be positive, got {max_age}")
        self.size, self.max_age, self.refill_delay = size, max_age, refill_delay
        self._launch, self._discard, self._alive = launch, discard, alive
        self.log = log or logging.getLogger("gpupool.agent")
        self._clock = clock
        self._ready: deque[tuple[W, float]] = deque()  # (worker, when it became ready), oldest first
        self._launching: set[asyncio.Task] = set()
        self._discarding: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._failures = 0
        self._retry_at = 0.0
        self._loop_task: asyncio.Task | None = None
        self._closing = False

    # -- queries ----------------------------------------------------------------

    @property
    def ready(self) -> list[W]:
        """The workers waiting in the pool now, oldest first."""
        return [worker for worker, _ in self._ready]

    @property
    def check_interval(self) -> float:
        """Seconds between two checks for dead or too old workers: a quarter of
        ``max_age``, between 0.1 s and 30 s."""
        return min(30.0, max(0.1, self.max_age / 4))

    # -- life cycle -------------------------------------------------------------

    def start(self) -> None:
        """Start filling the pool, and keep it filled, in the background."""
        if self.size and self._loop_task is None and not self._closing:
            self._loop_task = asyncio.create_task(self._maintain())

    def take(self) -> W | None:
        """A ready worker, removed from the pool for good; None when none is
        ready (the caller then starts one itself). Dead or too old workers met
        on the way are discarded. A replacement starts in the background."""
        while self._ready:
            worker, since = self._ready.popleft()
            if self._alive(worker) and self._clock() - since < self.max_age:
                self._retry_at = max(self._retry_at, self._clock() + self.refill_delay)
                self._wake.set()
                return worker
            self._throw_away(worker, "it died" if not self._alive(worker) else "it waited too long")
        self._wake.set()
        return None

    async def close(self) -> None:
        """Stop filling and stop every warm worker, including those still
        starting (they are waited for, then stopped)."""
        self._closing = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await asyncio.gather(*self._launching, return_exceptions=True)
        while self._ready:
            self._throw_away(self._ready.popleft()[0], None)
        await asyncio.gather(*self._discarding, return_exceptions=True)

    # -- inside -----------------------------------------------------------------

    async def _maintain(self) -> None:
        while not self._closing:
            self._recycle()
            self._fill()
            self._wake.clear()
            # asyncio.wait, not wait_for: wait_for can swallow a cancellation
            # that arrives as the event is set (Python 3.11), and this loop
            # must end when the agent's loop shuts down.
            waiter = asyncio.ensure_future(self._wake.wait())
            timeout = self.check_interval
            if self._retry_at > self._clock():  # a refill or retry is due before the next check
                timeout = min(timeout, max(0.01, self._retry_at - self._clock()))
            try:
                await asyncio.wait({waiter}, timeout=timeout)
            finally:
                waiter.cancel()

    def _recycle(self) -> None:
        now = self._clock()
        keep: deque[tuple[W, float]] = deque()
        for worker, since in self._ready:
            if not self._alive(worker):
                self._throw_away(worker, "it died")
            elif now - since >= self.max_age:
                self._throw_away(worker, f"it waited {now - since:.0f}s, longer than {self.max_age:g}s")
            else:
                keep.append((worker, since))
        self._ready = keep

    def _fill(self) -> None:
        if self._clock() < self._retry_at:
            return
        # One start at a time: parallel kernel starts compete for the CPU that
        # the node's leased workers are using.
        if not self._launching and len(self._ready) < self.size:
            task = asyncio.create_task(self._launch_one())
            self._launching.add(task)
            task.add_done_callback(self._launching.discard)

    async def _launch_one(self) -> None:
        try:
            worker = await self._launch()
        except Exception as exc:  # noqa: BLE001 - logged; leases fall back to cold starts
            self._failures += 1
            delay = min(MAX_BACKOFF_S, 2.0 ** (self._failures - 1))
            self._retry_at = self._clock() + delay
            self.log.warning("could not start a warm worker (%s); retrying in %.0fs, leases start cold meanwhile",
                             exc, delay)
            return
        finally:
            # Out of the launching set before the filler wakes, so it can start the next one.
            self._launching.discard(asyncio.current_task())
            self._wake.set()
        self._failures = 0
        if self._closing:
            self._throw_away(worker, None)
        else:
            self._ready.append((worker, self._clock()))

    def _throw_away(self, worker: W, why: str | None) -> None:
        if why:
            self.log.info("recycling a warm worker: %s", why)
        task = asyncio.create_task(self._discard_quietly(worker))
        self._discarding.add(task)
        task.add_done_callback(self._discarding.discard)

    async def _discard_quietly(self, worker: W) -> None:
        try:
            await self._discard(worker)
        except Exception as exc:  # noqa: BLE001 - one stuck worker must not stop the pool
            self.log.error("could not stop a warm worker: %s", exc)
