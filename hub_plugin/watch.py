"""In-process notification of lease changes, for long polls.

``GET /leases/{id}?wait=S&state=X`` waits on :meth:`LeaseWatch.changed`,
and :mod:`.leases` calls :meth:`LeaseWatch.notify` after every commit that
changed a lease, so the poll answers as soon as the state leaves X. It is
only a wake-up: the handler always re-reads the lease from the store, so a
missed or spurious wake-up costs one query, never a wrong answer.
"""

from __future__ import annotations

import asyncio
from typing import Iterable


class LeaseWatch:
    """Per-lease wake-ups. Waiters live on the event loop; :meth:`notify` may
    be called from any thread (the store's writer thread calls it after each
    commit) and wakes them on the loop."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    def close(self) -> None:
        """At shutdown: wake every waiter, and let no one wait again, so long
        polls answer with the lease as it is instead of a dropped connection."""
        self.closed = True
        self.notify(list(self._waiters))

    def future(self, lease_id: str) -> asyncio.Future[None]:
        """A future resolved at the next change of ``lease_id``. Take it
        *before* reading the lease, so a change in between is not missed."""
        self._loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = self._loop.create_future()
        self._waiters.setdefault(lease_id, set()).add(fut)
        fut.add_done_callback(lambda f: self._forget(lease_id, f))
        return fut

    def notify(self, lease_ids: Iterable[str]) -> None:
        """Wake everyone waiting on any of ``lease_ids`` (from any thread)."""
        lease_ids = set(lease_ids)
        loop = self._loop
        if not lease_ids or loop is None:
            return  # nobody has ever waited
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._wake(lease_ids)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, lease_ids)

    def _wake(self, lease_ids: set[str]) -> None:
        for lease_id in lease_ids:
            for fut in list(self._waiters.get(lease_id, ())):
                if not fut.done():
                    fut.set_result(None)

    async def changed(self, fut: asyncio.Future[None], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``fut``; True if it fired."""
        if self.closed:
            fut.cancel()
            return True
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            fut.cancel()

    def _forget(self, lease_id: str, fut: asyncio.Future[None]) -> None:
        waiters = self._waiters.get(lease_id)
        if waiters is not None:
            waiters.discard(fut)
            if not waiters:
                del self._waiters[lease_id]
