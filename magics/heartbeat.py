"""Keeps a lease alive from the notebook kernel, and notices when it ends.

The service reclaims a lease whose client stops heartbeating (its kernel
was killed, its host went away) after ``heartbeat_ttl``; this thread renews
it every third of that, and every ``busy_interval`` seconds while a cell
runs on the worker, so a lease lost mid-cell (worker died, node gone, admin
release) ends that cell within seconds. When a heartbeat answers that the
lease has ended, ``ended`` holds the lease so the client can tell the user
in words.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from gpupool.api import ServiceClient
from gpupool.errors import GPUPoolError
from gpupool.schema import Lease

log = logging.getLogger("gpupool.magics")


class Heartbeat(threading.Thread):
    """Daemon thread renewing ``lease_id`` every ``interval`` seconds (every
    ``busy_interval`` while :attr:`cell_running`) until :meth:`stop` or until
    the lease is seen ended (then ``ended`` is set)."""

    def __init__(self, client: ServiceClient, lease_id: str, interval: float, busy_interval: float = 2.0) -> None:
        super().__init__(name=f"gpupool-heartbeat-{lease_id}", daemon=True)
        self.client, self.lease_id = client, lease_id
        self.interval, self.busy_interval = interval, min(busy_interval, interval)
        self.ended: Lease | None = None
        self.cell_running = False
        # Called with the lease after each beat while no cell runs; True means the
        # lease was given back (parked) and beating stops.
        self.on_beat: Callable[[Lease], bool] | None = None
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._last_beat = time.monotonic()

    def run(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait(self.busy_interval if self.cell_running else self.interval)
            self._wake.clear()
            if self._stopped.is_set():
                return
            self._last_beat = time.monotonic()
            try:
                lease = self.client.heartbeat(self.lease_id)
            except GPUPoolError as exc:  # service down for a moment: try again next beat
                log.warning("heartbeat for %s failed: %s", self.lease_id, exc.message)
                continue
            if lease.state.ended:
                self.ended = lease
                return
            if self.on_beat is not None and not self.cell_running and self._beat_hook(lease):
                return

    def _beat_hook(self, lease: Lease) -> bool:
        try:
            return bool(self.on_beat(lease))
        except Exception:  # a failed park must not stop the heartbeat; the service's reclaim is the fallback
            log.warning("idle check for %s failed", self.lease_id, exc_info=True)
            return False

    def running(self, flag: bool) -> None:
        """Say whether a cell is running on the worker (beats faster while one is)."""
        self.cell_running = flag
        # Beat at once when a cell starts after a quiet spell, so a lease lost meanwhile
        # shows quickly; not on every cell, which would cost a request per cell.
        if flag and time.monotonic() - self._last_beat > self.busy_interval:
            self._wake.set()

    def stop(self) -> None:
        """Stop beating (the lease is being released by us)."""
        self._stopped.set()
        self._wake.set()
