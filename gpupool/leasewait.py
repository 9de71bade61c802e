"""Waiting for a new lease's worker, with a progress line: shared by
``%gpu acquire`` (gpupool.magics.wait) and ``gpupool run``.

    gpupool: L-7 queued: 2nd in line, about 5m... 12s
    gpupool: L-7 starting on node-1... 14s
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from .api import ServiceClient
from .errors import GPUPoolError, Reason
from . import leaseclasses
from .heartbeat import ended_message
from .schema import LeaseState
from .units import format_duration
from .wire.leases import Lease

#: Seconds of each long poll while a lease is queued or starting.
POLL_SECONDS = 2.0
#: Seconds ``POST /leases`` may wait for the new worker before answering (``start_wait``): a warm
#: worker (tens of ms) or one forked from its template (a few hundred) comes back ``active`` in the
#: answer itself, without a long poll after it; a slower start shows its progress line after this.
START_WAIT_S = 0.5
#: What a new lease's wait waits through, and a parked lease's resume (docs/parking.md).
START_STATES = (LeaseState.queued, LeaseState.starting)
RESUME_STATES = (LeaseState.parking, LeaseState.parked, LeaseState.starting)
#: The states in which a lease waits for room (the start timeout counts from leaving them).
WAITING_FOR_ROOM = (LeaseState.queued, LeaseState.parking, LeaseState.parked)


def progress_words(lease: Lease) -> str:
    """``'queued: 2nd in line, about 5m'``, ``'queued (batch): 1st in line'``, ``'starting on node-1'``,
    ``'parked on node-1, waiting for room there: 1st in line'``, ``'parked on node-1, whose agent is away
    (...)'``, ``'moving to node-2 from node-1 (...)'`` (from its memory), ``'moving to node-2 from node-1's
    disk (...)'``."""
    if lease.state is LeaseState.parking:
        return f"parking on {lease.node or 'its node'} (the resume follows)"
    if lease.state in (LeaseState.queued, LeaseState.parked):
        if lease.state is LeaseState.parked and lease.node_state == "lost":
            return (f"parked on {lease.node or 'its node'}, whose agent is away (stopped, or no heartbeat): waiting "
                    "for it to come back")
        if lease.state is LeaseState.parked:
            elsewhere = " or on another node" if (lease.parked or {}).get("may_move") else ""
            text = f"parked on {lease.node or 'its node'}, waiting for room there{elsewhere}"
        else:
            text = "queued" if lease.lease_class == leaseclasses.default().name else f"queued ({lease.lease_class})"
        if lease.queue_position:
            text += f": {_ordinal(lease.queue_position)} in line"
            if lease.queue_estimate_s is not None:
                text += f", about {format_duration(lease.queue_estimate_s)}"
        return text
    old = (lease.parked or {}).get("moving_from") if lease.state is LeaseState.starting else None
    if old and (lease.parked or {}).get("tier") == "memory":
        return f"moving to {lease.node} from {old} (a new worker there takes its state, worker to worker)"
    if old:
        return f"moving to {lease.node} from {old}'s disk (a new worker loads its state there)"
    return f"{lease.state.value} on {lease.node or 'the pool'}"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def wait_started(client: ServiceClient, lease: Lease, started: float, start_timeout: float, *,
                 setting: str = "", on_state: Callable[[Lease, bool], None] | None = None,
                 stream: TextIO | None = None, rewrite: bool = True,
                 waiting: tuple[LeaseState, ...] = START_STATES, cancels: bool = True) -> Lease:
    """Long-poll ``lease`` until it leaves the ``waiting`` states (a new
    lease's ``queued`` and ``starting``; :data:`RESUME_STATES` for a resume), keeping
    one progress line (``\\r``-rewritten, blanked at the end) on ``stream``
    (default: stdout); returns the ``active`` lease. Without ``rewrite`` (a
    log, not a terminal) a line is printed each time the words change instead.

    ``started``: ``time.monotonic()`` of the request (the line counts from
    it); ``start_timeout``: seconds a lease may stay ``starting`` once out of
    the queue (the service itself ends a queued request's wait); ``setting``:
    words naming what sets that timeout, for the error. ``on_state(lease,
    was_queued)`` is called with each lease seen while waiting, and once more
    after leaving the queue. Raises GPUPoolError ``start_timeout`` when it
    runs out, ``lease_failed`` when the lease ends instead of starting (the
    service's words: pool full after the wait, quota, ...), and what
    :class:`ServiceClient` raises. The caller cancels the lease on failure
    (``cancels``: the words say so; a resume is not cancelled).
    """
    stream = stream or sys.stdout
    since = started
    queued = False
    shown = 0  # length of the progress line, blanked when it is done
    said = ""  # without rewrite: the words last printed
    while lease.state in waiting:
        if lease.state in WAITING_FOR_ROOM:
            since = time.monotonic()  # the start timeout counts from leaving the queue (the service ends waits)
        if on_state is not None:
            on_state(lease, queued)
        queued = lease.state in WAITING_FOR_ROOM
        if time.monotonic() - since > start_timeout:
            raise GPUPoolError(Reason.start_timeout, f"no worker started within {start_timeout:.0f}s"
                               f"{f' ({setting})' if setting else ''}; "
                               + ("the request was cancelled" if cancels else "it waits on, and the next cell waits "
                                  "for it again"), 504)
        words = f"gpupool: {lease.id} {progress_words(lease)}"
        if rewrite:
            line = f"{words}... {time.monotonic() - started:.0f}s"
            print(f"\r{line:<{shown}}", end="", flush=True, file=stream)
            shown = max(shown, len(line))
        elif words != said:
            print(words, flush=True, file=stream)
            said = words
        lease = client.get_lease(lease.id, wait=POLL_SECONDS, state=lease.state.value)
    if shown:  # front ends that overwrite after "\r" character by character keep no tail of it
        print("\r" + " " * shown + "\r", end="", flush=True, file=stream)
    if queued and on_state is not None:
        on_state(lease, queued)
    if lease.state is not LeaseState.active:
        raise GPUPoolError(Reason.lease_failed, f"the lease could not start: {ended_message(lease)}", 502)
    return lease


def cancel(client: ServiceClient, lease_id: str, reason: str = "acquire cancelled") -> None:
    """Release ``lease_id`` whose acquire (or run) did not finish; a failure
    is said on stderr, never raised (the service's reclaim is the fallback)."""
    try:
        client.release(lease_id, reason=reason)
    except GPUPoolError as exc:
        print(f"gpupool: could not cancel {lease_id}: {exc.message}", file=sys.stderr)
