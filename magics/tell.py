"""What the ``%gpu`` magics tell the front ends listening on ``gpupool.status``
(:mod:`gpupool.magics.events`): an event for what a cell says anyway, the new
state, a waited-for lease's progress. Nothing outside the gpupool kernel."""

from __future__ import annotations

import time
from typing import Any

from gpupool.leasewait import WAITING_FOR_ROOM
from gpupool.wire.leases import Lease

from .events import Events, lease_state, progress_phase


class Tell:
    """``tell(kind, message, **extra)`` sends event ``kind`` (none when
    empty) and then the state, which the kernel's ``Events.snapshot`` reads;
    ``events`` is the gpupool kernel's, None in any other IPython (then
    nothing is sent)."""

    def __init__(self, events: Events | None) -> None:
        self.events = events

    def __call__(self, kind: str | None = None, message: str = "", **extra: Any) -> None:
        if self.events is None:
            return
        if kind:
            self.events.emit(kind, message, **extra)
        self.events.changed()

    def progress(self, lease: Lease, was_queued: bool, *, started: float) -> None:
        """A waited-for ``lease``: its queued/starting state, and "admitted"
        once it leaves the queue (``started``: monotonic seconds the wait began)."""
        if self.events is None:
            return
        if was_queued and lease.state not in WAITING_FOR_ROOM:
            self.events.emit("admitted", f"{lease.id} left the queue after {time.monotonic() - started:.0f}s; "
                                         f"starting on {lease.node or 'the pool'}")
        self.events.changed(lease_state(progress_phase(lease), lease))
