"""Waiting for the service to move a lease: out of the queue and started,
resumed, parked; each for at most ``c.GPUMagics.start_timeout``, its
progress told to the front ends (:class:`~.tell.Tell`)."""

from __future__ import annotations

import functools
import time
from typing import Callable

from gpupool.leasewait import POLL_SECONDS, wait_started
from gpupool.schema import LeaseState
from gpupool.wire.leases import Lease

from .attachment import Attachment
from .service import Service
from .tell import Tell


class QueueWait:
    """The magics' waits. ``timeout`` gives the seconds each may last
    (``c.GPUMagics.start_timeout``, read at each wait: ``%config`` may change
    it between cells)."""

    def __init__(self, service: Service, tell: Tell, timeout: Callable[[], float]) -> None:
        self.service, self.tell, self.timeout = service, tell, timeout

    def started(self, lease: Lease, started: float) -> Lease:
        """:func:`gpupool.leasewait.wait_started` for a new ``lease``, asked
        at monotonic ``started``: the active lease; its errors."""
        return wait_started(self.service.client, lease, started, self.timeout(), setting="c.GPUMagics.start_timeout",
                            on_state=functools.partial(self.tell.progress, started=started))

    def resumed(self, attachment: Attachment, on_wait: Callable[[Lease], None] | None = None) -> Lease:
        """:meth:`Attachment.resume` of the parked ``attachment`` (``on_wait``: as there): the
        active lease; its errors."""
        started = time.monotonic()
        return attachment.resume(self.timeout(), on_state=functools.partial(self.tell.progress, started=started),
                                 on_wait=on_wait)

    def parked(self, lease: Lease) -> Lease:
        """``lease``, asked to park, followed while ``parking``: as last seen
        (parked, or still parking after the timeout). GPUPoolError when the
        service cannot be asked."""
        deadline = time.monotonic() + self.timeout()
        while lease.state is LeaseState.parking and time.monotonic() < deadline:
            lease = self.service.client.get_lease(lease.id, wait=POLL_SECONDS, state="parking")
        return lease
