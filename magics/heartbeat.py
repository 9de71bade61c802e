"""Keeps a lease alive from the notebook kernel, and notices when it ends:
:class:`gpupool.heartbeat.LeaseHeartbeat` (renewal, the ended lease, the
busy rhythm while a cell runs on the worker), with the notebook's notices.

Each beat's answer carries ``idle_deadline`` (when the service parks the
lease, or releases it if it asked ``on_idle: release``, should it stay idle)
and ``idle_warning`` (how long before that the user is warned,
``c.PoolLeases.idle_warning``): once per idle period the thread says a warning
(:func:`idle_warning_text`). The deadline is the service's alone: the park
happens there (docs/parking.md), so the warning, the status bar and the park
keep one clock. Under pressure (others wait for a GPU) the deadline comes
early and ``pressure`` says why; the warning says so too. A preemptible
lease told ``preempt_at`` while a cell runs is said so once; the service
then parks it, freezing the cell, which goes on after the resume. Each
beat's lease goes to ``on_lease_seen`` (the attachment follows its park).
"""

from __future__ import annotations

import logging
import sys
from datetime import datetime, timezone
from typing import Any, Callable

from gpupool.api import ServiceClient
from gpupool.heartbeat import LeaseHeartbeat, preempted_for
from gpupool.schema import LeaseState, parse_time
from gpupool.wire.leases import Lease
from gpupool.units import format_duration

from .notices import stream_of
from .park import parked_now
from .words import ended_words

log = logging.getLogger("gpupool.magics")
#: Seconds after the idle deadline that the beat which sees the park comes (the service's sweep acts then).
DEADLINE_SLACK_S = 1.0
#: Seconds a heartbeat may come late for the idle warning it is timed for.
WARN_SLACK_S = 1.0


def idle_warning_text(lease: Lease, interval: float, now: datetime | None = None) -> str | None:
    """The warning to print now for idle ``lease``, or None when none is due.

    ``interval``: seconds to the next heartbeat. Due once the time left until
    the service's ``idle_deadline`` is at most ``idle_warning + interval``,
    so the warning comes at least ``idle_warning`` seconds early although it
    is only checked at beats. What happens then is the lease's ``on_idle``:
    parked in place (the default), or released with the worker's variables.
    None while a cell runs (no deadline) or when ``idle_warning`` is 0.
    """
    deadline = parse_time(lease.idle_deadline)
    since = parse_time(lease.idle_since)
    if deadline is None or since is None or not lease.idle_warning:
        return None
    now = now or datetime.now(timezone.utc)
    left = (deadline - now).total_seconds()
    if left > lease.idle_warning + interval:
        return None
    if lease.on_idle == "release":
        then = "reclaimed within {left}: released, its worker stopped and its variables lost"  # as its end says
    else:
        then = ("parked within {left}: its GPU goes back to the pool, its worker waits frozen with its variables "
                "and the next cell resumes it")
    why = f" ({lease.pressure})" if lease.pressure else ""
    return (f"lease {lease.id} has been idle {format_duration((now - since).total_seconds())}; it will be "
            f"{then.format(left=format_duration(max(left, 0.0)))}{why} (run a cell to keep it)")


def _output_parent() -> dict[str, Any] | None:
    """The header of the request the calling thread's output belongs to
    (ipykernel's ``OutStream.parent_header``), None outside a kernel."""
    return getattr(sys.stderr, "parent_header", None) or None


class KernelHeartbeat(LeaseHeartbeat):
    """The notebook kernel's heartbeat (:class:`gpupool.heartbeat.LeaseHeartbeat`)
    with idle warnings, the park followed, preemption and node notices.

    Create it on the kernel's main thread during a cell: its notices go under
    that cell, and later under each cell that ran on the worker
    (:meth:`running`), like output of the cell itself.
    """

    def __init__(self, client: ServiceClient, lease_id: str, interval: float, busy_interval: float = 2.0) -> None:
        super().__init__(client, lease_id, interval, busy_interval)
        # Called with the lease after each beat, a cell running or not (the attachment follows its park).
        self.on_lease_seen: Callable[[Lease], None] | None = None
        self._parent = _output_parent()
        self._warned_for: str | None = None  # idle_since of the idle period already warned about
        self.notify: Callable[[str, str], None] | None = None
        self._next_wait: float | None = None  # seconds to the next beat when the idle deadline is nearer
        self._node_lost = False  # the lease's node is lost, as last seen
        self._node_lost_said = False  # told the user so (not for a lease parked there)

    def after_beat(self, lease: Lease) -> bool:
        """Node notices, the park followed (``on_lease_seen``), then while a
        cell runs the preemption notice, else the idle warning. Beats go on
        while the lease is parked: its worker waits for this kernel."""
        self._tell_node_state(lease)
        self._seen(lease)
        super().after_beat(lease)  # while a cell runs: its preemption notice
        if self.cell_running or parked_now(lease):
            self._next_wait = None
            return False
        self._warn_if_idle(lease)
        self._next_wait = self._until_due(lease)
        return False

    def _seen(self, lease: Lease) -> None:
        if self.on_lease_seen is None or self.stopped:
            return
        try:
            self.on_lease_seen(lease)
        except Exception:  # following the park must never stop the heartbeat
            log.warning("could not follow the park of %s", self.lease_id, exc_info=True)

    def ended_words(self, lease: Lease) -> str:
        return ended_words(lease)

    def warning_stale(self) -> bool:
        """Whether an idle warning this heartbeat said is stale by now: the
        lease ended, is no longer active (parking, parked, releasing), or its
        idle deadline passed (the service parks or releases it then, and the
        next beat may not have seen it yet)."""
        lease = self.last
        if self.ended is not None or (lease is not None and lease.state is not LeaseState.active):
            return True
        deadline = parse_time(lease.idle_deadline) if lease is not None else None
        return deadline is not None and deadline <= datetime.now(timezone.utc)

    def _wait_seconds(self) -> float:
        """The regular interval, shortened so that the beat that warns comes
        in time whatever the idle timeout."""
        if self.cell_running:
            return self.busy_interval
        return self.interval if self._next_wait is None else max(0.05, min(self.interval, self._next_wait))

    def _until_due(self, lease: Lease) -> float | None:
        """Seconds until the warning is due, or else until the idle deadline
        (the beat after it sees the park); ``busy_interval`` while the service
        still sees the worker busy though no cell runs here (its agent reports
        every few seconds: the next beat brings the deadline for the status
        bar's countdown, not one a whole interval later); None without a deadline."""
        deadline = parse_time(lease.idle_deadline)
        if deadline is None:
            busy = (lease.worker or {}).get("execution_state") == "busy"
            return self.busy_interval if busy and lease.state is LeaseState.active else None
        left = (deadline - datetime.now(timezone.utc)).total_seconds()
        warn = left - (lease.idle_warning or 0.0)
        if warn > 0 and lease.idle_since != self._warned_for:
            return warn
        # The service parks at its next sweep after the deadline: beat a moment after it, then, while the
        # lease stays active past it (its agent not answering the park, say), at the busy rhythm, not at once.
        return left + DEADLINE_SLACK_S if left > 0 else self.busy_interval

    def preempt_words(self, lease: Lease, left: float) -> str:
        return (f"lease {lease.id} is preemptible and {preempted_for(lease)}: in about "
                f"{format_duration(left)} it is parked, the running cell frozen where it is (or interrupted "
                "where the node cannot freeze a running cell); it goes on when the pool resumes the lease")

    def _tell_node_state(self, lease: Lease) -> None:
        """Say once when the lease's node is lost, and once when it is back; not for a lease
        parked there (its park's notice says what waits, the next cell's wait that its agent is away)."""
        lost = lease.node_state == "lost"
        if lost == self._node_lost:
            return
        self._node_lost = lost
        if lease.state in (LeaseState.parking, LeaseState.parked):
            self._node_lost_said = False
            return
        said, self._node_lost_said = self._node_lost_said, lost
        if lost:
            self.say(f"the pool lost contact with node {lease.node} (no heartbeat from its agent): lease "
                     f"{lease.id} is kept and its worker's variables wait there, but cells on it may not "
                     "answer until the node is back; %gpu release --discard gives it up", kind="node_lost")
        elif said:
            self.say(f"node {lease.node} is back: lease {lease.id} works again", kind="node_back")

    def _warn_if_idle(self, lease: Lease) -> None:
        if lease.idle_since is None or lease.idle_since == self._warned_for:
            return
        # The beat is timed to come when the warning is due (_until_due): a second of slack, not a whole
        # interval, or a long interval would warn as soon as a short idle period starts.
        text = idle_warning_text(lease, min(self.interval, WARN_SLACK_S))
        if text is not None:
            self._warned_for = lease.idle_since
            self.say(text, kind="idle_warning")

    def say(self, text: str, kind: str = "notice") -> None:
        """Tell the user ``text`` (callable from any thread): through
        ``notify(kind, text)`` when set (the gpupool kernel says it at the top
        of the next cell and sends it as an event), else printed as
        ``gpupool: TEXT`` to the kernel's stderr (stdout for news:
        :func:`.notices.stream_of`), under the last cell that ran on the worker.
        Nothing once stopped: the lease was given up here, and a notice of it
        would be stale."""
        if self.stopped:
            return
        if self.notify is not None:
            self.notify(kind, text)
            return
        stream = getattr(sys, stream_of(kind))
        pin = getattr(stream, "set_thread_parent", None) if self._parent else None
        # ipykernel 7 routes other threads' output by a context variable; pin ours
        # to that cell (OutStream.set_thread_parent).
        token = pin(self._parent) if pin else None
        try:
            print(f"gpupool: {text}", file=stream, flush=True)
        finally:
            if token is not None:
                stream.reset_thread_parent(token)

    def running(self, flag: bool) -> None:
        """Say whether a cell is running on the worker (beats faster while one
        is). Call on the kernel's main thread: notices go under that cell."""
        if flag:
            self._parent = _output_parent() or self._parent
        super().running(flag)
