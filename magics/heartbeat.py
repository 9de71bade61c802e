"""Keeps a lease alive from the notebook kernel, and notices when it ends.

The service reclaims a lease whose client stops heartbeating (its kernel
was killed, its host went away) after ``heartbeat_ttl``; this thread renews
it every third of that. When a heartbeat answers that the lease has ended
(idle reclaim, admin release, worker death), ``ended`` holds the lease so the
client can tell the user in words at the next cell, or end a running cell.
"""

from __future__ import annotations

import logging
import threading

from gpupool.api import ServiceClient
from gpupool.errors import GPUPoolError
from gpupool.schema import Lease

log = logging.getLogger("gpupool.magics")


class Heartbeat(threading.Thread):
    """Daemon thread renewing ``lease_id`` every ``interval`` seconds until
    :meth:`stop` or until the lease is seen ended (then ``ended`` is set)."""

    def __init__(self, client: ServiceClient, lease_id: str, interval: float) -> None:
        super().__init__(name=f"gpupool-heartbeat-{lease_id}", daemon=True)
        self.client, self.lease_id, self.interval = client, lease_id, interval
        self.ended: Lease | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                lease = self.client.heartbeat(self.lease_id)
            except GPUPoolError as exc:  # service down for a moment: try again next beat
                log.warning("heartbeat for %s failed: %s", self.lease_id, exc.message)
                continue
            if lease.state.ended:
                self.ended = lease
                return

    def stop(self) -> None:
        """Stop beating (the lease is being released by us)."""
        self._stop_event.set()
