"""Park and resume: an idle lease gives its GPU back without losing state.

The service reclaims a lease at its ``idle_deadline`` (the lease JSON's: after
``idle_timeout`` without a running cell, or earlier under pressure). Just
before that (``ahead`` seconds plus one heartbeat interval), the
heartbeat thread parks it: over a connection of its own (ZeroMQ sockets are
not thread-safe, and the main thread's may be in use by a ``%%local`` cell's
magics) it pulls the worker's variables into the local namespace, exactly as
``%gpu release`` would, and releases the lease with the reason "parked after
idle". The next routed cell re-acquires a slice of the same size and pushes
those variables back before it runs (see :func:`gpupool.magics.attach.resume`).

While others wait for a GPU the service brings ``idle_deadline`` forward
(``c.GPUPool.pressure_grace``) and says why in ``pressure``; the same rule
then parks it earlier, with those words as its reason ("parked early: 3
people are waiting for a GPU"). A preemptible lease told ``preempt_at`` has
its running cell interrupted then (:func:`gpupool.heartbeat.preempt_due`) and parks once idle.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from gpupool.errors import GPUPoolError, Reason
from gpupool.schema import parse_time
from gpupool.wire.leases import Lease
from gpupool.transfer import load_pulled

from . import dataplane
from gpupool.remote import RemoteKernel

log = logging.getLogger("gpupool.magics")
PARK_REASON = "parked after idle"


@dataclass
class Parked:
    """What parking did: the lease as released, the names brought back (to be
    pushed on resume), their transfer items, what could not come, why it
    was parked (:func:`park_reason`), and whether the user was told."""

    lease: Lease
    names: list[str] = field(default_factory=list)
    items: list[dict[str, Any]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    why: str = PARK_REASON
    told: bool = False  # the user was told already (a cell here said the notice)


def park_reason(lease: Lease) -> str:
    """``"parked after idle"``, or the service's words when pressure brought the deadline forward."""
    return lease.pressure or PARK_REASON


def seconds_to_reclaim(lease: Lease, now: datetime | None = None) -> float | None:
    """Seconds until the service would reclaim ``lease`` for idleness (may
    be negative): to its ``idle_deadline``, which the service computes (the
    idle rule lives there: ``idle_since + idle_timeout``, early under
    pressure); None while it sets none (a cell runs, the worker has not
    reported idle, the lease is not active)."""
    deadline = parse_time(lease.idle_deadline)
    if deadline is None:
        return None
    return (deadline - (now or datetime.now(timezone.utc))).total_seconds()


def idle_span(lease: Lease) -> float | None:
    """Seconds from going idle to the deadline: the idle timeout, or the
    shorter span pressure left (what :func:`park_lead` scales by)."""
    since, deadline = parse_time(lease.idle_since), parse_time(lease.idle_deadline)
    if since is None or deadline is None:
        return lease.idle_timeout
    return max(0.0, (deadline - since).total_seconds())


#: The shortest idle timeout the client can still park before (seconds): a
#: heartbeat and a pull of the variables must fit in it.
MIN_IDLE_TIMEOUT = 3.0


def park_lead(ahead: float, idle_timeout: float | None) -> float:
    """Seconds before the reclaim at which to park: ``ahead``, but at most a
    third of a short idle timeout (a 6 s timeout parks after about 4 s idle)."""
    return min(ahead, idle_timeout / 3) if idle_timeout else ahead


def park_due(lease: Lease, ahead: float, interval: float, now: datetime | None = None) -> bool:
    """Whether to park now: the next heartbeat (``interval`` s away) would
    come later than :func:`park_lead` seconds before the reclaim."""
    left = seconds_to_reclaim(lease, now)
    return left is not None and left <= park_lead(ahead, idle_span(lease)) + interval


def park(lease: Lease, max_bytes: int | None, take: Callable[[dict[str, Any], list[dict[str, Any]]], None],
         release: Callable[[str, str], Lease], target: str, timeout: float = 600.0, why: str = PARK_REASON) -> Parked:
    """Pull all of ``lease``'s worker variables over a new connection, hand
    them to ``take(values, items)``, then ``release(lease_id, why)``.

    Raises GPUPoolError when the worker cannot be reached or the pull fails;
    the lease is then left alone (the service's reclaim is the fallback).
    """
    remote = RemoteKernel(lease.connection or {})

    def comm(request: dict[str, Any], buffers: list | None) -> tuple[dict[str, Any], list]:
        answer, got = remote.comm_request(target, request, buffers, timeout=timeout)
        if not answer.get("ok"):
            raise GPUPoolError(Reason.transfer_failed, f"parking could not pull the variables: {answer.get('message')}",
                               502)
        return answer, got

    try:
        remote.wait_ready(30.0)
        # No progress line: this runs on the heartbeat thread, outside any cell.
        header, buffers = dataplane.pull(comm, remote.connection, {"op": "pull_all", "max_bytes": max_bytes},
                                         progress=False)
    finally:
        remote.close()
    values, items, errors = load_pulled(header, buffers)
    take(values, items)
    ended = release(lease.id, why)
    return Parked(lease=ended, names=sorted(values), items=items, errors=errors, why=why)
