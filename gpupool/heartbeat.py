"""Keeps a lease alive from its client, and notices when it ends.

The service reclaims a lease whose client stops heartbeating (its kernel
was killed, its host went away, ``gpupool run`` was killed -9) after
``heartbeat_ttl``; :class:`LeaseHeartbeat` renews it every third of that
(:func:`beat_interval`), and every ``busy_interval`` seconds while work runs
on the worker, so a lease lost mid-run (worker died, node gone, admin
release) is seen within seconds. When a heartbeat answers that the lease has
ended, ``ended`` holds the lease so the client can tell the user in words
(:func:`ended_message`).

The notebook's heartbeat (:class:`gpupool.magics.heartbeat.KernelHeartbeat`)
builds on this one: idle warnings, parking, preemption, node notices.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Callable

from .api import ServiceClient
from .errors import GPUPoolError
from .schema import parse_time
from .units import format_duration
from .wire.leases import Lease

log = logging.getLogger("gpupool.heartbeat")


def ended_message(lease: Lease) -> str:
    """Words for a lease that ended without us asking, e.g. ``lease L-1 was
    reclaimed: idle for 30m (idle timeout 30m)`` or ``lease L-1 failed: ...``."""
    verb = "failed" if lease.state.value == "failed" else f"was {lease.state.value}"
    return f"lease {lease.id} {verb}: {lease.reason or 'no reason given'}"


def beat_interval(lease: Lease) -> float:
    """Seconds between heartbeats of ``lease``: a third of its ``heartbeat_ttl``
    (60 s when unknown), at least 0.5 s and at most 15 s."""
    return max(0.5, min((lease.heartbeat_ttl or 60) / 3, 15.0))



def preempted_for(lease: Lease) -> str:
    """Why a coming preemption comes, for its notice: the service's ``pressure`` words without
    their ``preempted:`` (the preemption is still to come): ``'1 person is waiting for a GPU'``."""
    pressure = lease.pressure or ""
    return pressure.removeprefix("preempted: ") or "others are waiting for a GPU"

class LeaseHeartbeat(threading.Thread):
    """Daemon thread renewing ``lease_id`` every ``interval`` seconds (every
    ``busy_interval`` while :attr:`cell_running`) until :meth:`stop` or until
    the lease is seen ended (then ``ended`` is set and, unless work was
    running, :meth:`say` tells the user).

    A preemptible lease told ``preempt_at`` while work runs is said so once
    (:meth:`preempt_words`); at ``preempt_at`` the service parks it, the work
    frozen where it is, and resumes it when room comes. Subclasses act on
    each renewed lease in :meth:`after_beat` and may shorten the wait in
    :meth:`_wait_seconds`. A failed beat (service down for a moment) is
    tried again at the next one; the user is told once when the service
    stops answering and once when it answers again.
    """

    def __init__(self, client: ServiceClient, lease_id: str, interval: float, busy_interval: float = 2.0) -> None:
        super().__init__(name=f"gpupool-heartbeat-{lease_id}", daemon=True)
        self.client, self.lease_id = client, lease_id
        self.interval, self.busy_interval = interval, min(busy_interval, interval)
        self.ended: Lease | None = None
        self.cell_running = False
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._last_beat = time.monotonic()
        self._retime = False  # work began: wait busy_interval from the last beat, not the idle interval
        self._wait_until = 0.0  # when the thread's wait for the next beat ends (monotonic seconds)
        # The lease as the last beat saw it, and a callable told of each such lease
        # (the gpupool kernel pushes the state to the front end: gpupool.magics.events).
        self.last: Lease | None = None
        self.on_lease: Callable[[Lease], None] | None = None
        self._preempt_told: str | None = None  # the preempt_at the user was told of
        self._down_since: float | None = None  # monotonic time of the first beat the service did not answer
        self._beats = 0  # beats tried so far, under _beaten (recheck_service waits for the next)
        self._beaten = threading.Condition()
        self._now = False  # beat at once, whatever the retimed wait (recheck_service)

    def run(self) -> None:
        wait: float | None = None
        while not self._stopped.is_set():
            wait = self._wait_seconds() if wait is None else wait
            self._wait_until = time.monotonic() + wait
            self._wake.wait(wait)
            self._wake.clear()
            wait = None
            if self._stopped.is_set():
                return
            if self._retime and not self._now:  # work began soon after a beat: the next comes busy_interval after it
                self._retime = False
                left = self._last_beat + self.busy_interval - time.monotonic()
                if left > 0:
                    wait = left
                    continue
            self._last_beat, self._now = time.monotonic(), False
            try:
                lease = self.client.heartbeat(self.lease_id)
            except GPUPoolError as exc:  # service down for a moment: try again next beat
                self._unanswered(exc)
                self._beat_done()
                continue
            self._answered(lease)
            self._beat_done()
            if lease.state.ended:
                self._end(lease)
                return
            if self.after_beat(lease):
                return

    def _beat_done(self) -> None:
        with self._beaten:
            self._beats += 1
            self._beaten.notify_all()

    def recheck_service(self, timeout: float) -> None:
        """While the service is said not to answer: beat now, and wait at most ``timeout`` seconds
        for that beat, so that a notice said next is not already stale (the service back since
        the last beat: its "answers again" then comes instead). Called from another thread."""
        if self._down_since is None or self.stopped:
            return
        with self._beaten:
            beats = self._beats
            self._now = True
            self._wake.set()
            self._beaten.wait_for(lambda: self._beats != beats or self.stopped, timeout)

    def _unanswered(self, exc: GPUPoolError) -> None:
        """A beat the service did not answer: logged and said once per outage, not at every beat
        (:meth:`_answered` says when it answers again)."""
        if self._down_since is not None:
            log.debug("heartbeat for %s failed again: %s", self.lease_id, exc.message)
            return
        self._down_since = time.monotonic()
        log.warning("heartbeat for %s failed: %s (tried again at every beat; said once it answers)",
                    self.lease_id, exc.message)
        ttl = self.last.heartbeat_ttl if self.last is not None else None
        within = f" within its heartbeat TTL ({format_duration(ttl)})" if ttl else ""
        self.say(f"the gpupool service cannot be reached ({exc.message}); the worker runs on, and the pool keeps "
                 f"lease {self.lease_id} if the service answers{within}: said here when it does", kind="service_down")

    def _answered(self, lease: Lease) -> None:
        if self._down_since is None:
            return
        silent = format_duration(time.monotonic() - self._down_since)
        self._down_since = None
        log.warning("heartbeat for %s answered again after %s", self.lease_id, silent)
        kept = "" if lease.state.ended else f": lease {self.lease_id} is kept"  # else the ended notice follows
        self.say(f"the gpupool service answers again (after {silent}){kept}", kind="service_back")

    def after_beat(self, lease: Lease) -> bool:
        """Act on ``lease`` as a beat renewed it (still holding capacity);
        True stops beating (the lease was given back). Here: remember it as
        :attr:`last`, pass it to :attr:`on_lease`, and while work runs see to
        its preemption. An override calls ``super()``."""
        self.last = lease
        if self.on_lease is not None:
            try:
                self.on_lease(lease)
            except Exception:  # the client's view must never stop the heartbeat
                log.warning("could not pass on the lease of %s", self.lease_id, exc_info=True)
        if self.cell_running:
            self._preempt_if_due(lease)
        return False

    def _preempt_if_due(self, lease: Lease) -> None:
        """While work runs: say once that the lease is being preempted."""
        if lease.preempt_at is None or lease.preempt_at == self._preempt_told:
            return
        self._preempt_told = lease.preempt_at
        left = max(0.0, (parse_time(lease.preempt_at) - datetime.now(timezone.utc)).total_seconds())
        self.say(self.preempt_words(lease, left), kind="preempt_notice")

    def preempt_words(self, lease: Lease, left: float) -> str:
        """The notice that ``lease``'s running work is interrupted in ``left`` seconds."""
        return (f"lease {lease.id} is preemptible and {preempted_for(lease)}: in about "
                f"{format_duration(left)} it is parked, the running script frozen where it is (or interrupted "
                "where the node cannot freeze it); it goes on when the pool resumes the lease")

    def _wait_seconds(self) -> float:
        """Seconds until the next beat."""
        return self.busy_interval if self.cell_running else self.interval

    def _end(self, lease: Lease) -> None:
        self.ended = lease
        # stop() comes before our own release, so a stopped thread saw that release.
        # Running work says it itself (it fails with these words).
        if not self._stopped.is_set() and not self.cell_running:
            self.say(self.ended_words(lease), kind="ended")

    def ended_words(self, lease: Lease) -> str:
        """The notice for ``lease``, which ended behind our back: :func:`ended_message`;
        an override may say more (what became of the worker's variables)."""
        return ended_message(lease)

    def say(self, text: str, kind: str = "notice") -> None:
        """Tell the user ``text`` (callable from any thread): ``gpupool: TEXT``
        on stderr; nothing once stopped (the lease was given up here, and a
        notice of it would be stale). ``kind`` names the notice for overrides."""
        if not self.stopped:
            print(f"gpupool: {text}", file=sys.stderr, flush=True)

    def running(self, flag: bool) -> None:
        """Say whether work (a cell, a script) runs on the worker: beats come
        every ``busy_interval`` while it does."""
        self.cell_running = flag
        # Beat at once when work starts after a quiet spell, so a lease lost meanwhile
        # shows quickly; not on every cell, which would cost a request per cell. Work that
        # starts just after a beat has the next one busy_interval after it: the thread is
        # woken to wait that instead of the rest of the idle interval (up to 15 s), which
        # let a worker killed mid-cell read as unreachable rather than as its lease's end.
        if not flag:
            return
        now = time.monotonic()
        self._retime = now - self._last_beat <= self.busy_interval
        # A back-to-back cell finds the thread already waiting no longer than the retimed wait:
        # waking it would only cost a thread switch per cell.
        if not (self._retime and self._wait_until <= self._last_beat + self.busy_interval):
            self._wake.set()

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called (the lease is ours no more)."""
        return self._stopped.is_set()

    def stop(self) -> None:
        """Stop beating (the lease is being released by us)."""
        self._stopped.set()
        self._wake.set()
