"""The service's background tasks (worker starts, releases): run on the
event loop, their failures logged, cancelled together at shutdown."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Coroutine

log = logging.getLogger("gpupool.service.leases")


class Background:
    """The tasks started with :meth:`spawn` and not yet done."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` in the background; its failure is logged, not lost. On the loop only."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def spawn_after(self, seconds: float, make: Callable[[], Coroutine[Any, Any, Any]]) -> asyncio.Task:
        """Run the coroutine ``make()`` gives ``seconds`` from now, in the background (a task that
        sleeps first: cancelled with the others at shutdown). On the loop only."""
        async def later() -> None:
            await asyncio.sleep(seconds)
            await make()

        return self.spawn(later())

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background lease task failed", exc_info=task.exception())

    async def cancel(self) -> None:
        """Cancel every task and wait until they have ended."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
