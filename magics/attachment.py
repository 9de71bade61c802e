"""One notebook kernel attached to one lease: run cells, move variables, release.

An :class:`Attachment` owns the lease's worker connection and heartbeat. The
magics hold at most one; everything that talks to the worker goes through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import logging
import sys
import threading
import time
from typing import Any, Callable

from gpupool.api import ServiceClient
from gpupool.errors import GPUPoolError, Reason
from gpupool.heartbeat import beat_interval
from gpupool.leasewait import RESUME_STATES, WAITING_FOR_ROOM, wait_started
from gpupool.schema import LeaseState, parse_time
from gpupool.tables import parked_for, resumed_words
from gpupool.wire.leases import Lease
from gpupool.wire.transfer import TARGET, Fetch, Have, Pull, PullAll, Request, Versions
from gpupool.transfer import load_pulled

from . import dataplane
from .heartbeat import KernelHeartbeat
from .park import Parked, parked_now, parked_words, resume_seconds
from .words import ended_words, say
from .relay import OutputRelay, remote_error
from .summary import as_outputs
from gpupool.remote import RemoteKernel

#: What a wait on a worker that a park to disk ended says (the lease resumed on a new worker).
CELL_CUT_BY_SPILL = ("lease {lease} was parked to disk as this reached its worker, and resumed on a new worker "
                     "on {node} from the state saved then: this cell did not finish on the old worker and what "
                     "it did there is not kept (its output above is all there is); run it again")
#: Seconds a park's time (the service's clock) must precede a cell's sending (this host's) for the
#: cell to count as sent after the park (:class:`CellNotSent`): room for clocks a little apart.
CLOCK_SLACK_S = 1.0
log = logging.getLogger("gpupool.magics")
#: Seconds between asks to resume a frozen lease when the service did not answer.
RESUME_RETRY_S = 5.0
#: Times a cell asks again for a resume the service tried and gave up (the lease back ``parked``: a move
#: that failed, say) before it stops waiting and says why; the lease stays parked.
RESUME_TRIES = 3
#: Seconds a resume asked without a cell (ask_resume) is followed at once before the heartbeat takes over.
FOLLOW_RESUME_S = 120.0


class CellNotSent(GPUPoolError):
    """A forwarded cell was sent to a worker that had already ended: the lease was parked to disk
    before it (its agent stopped, say), so the cell never ran. The gpupool kernel forwards it
    again once the lease resumes (:meth:`Attachment.check_alive`)."""

    def __init__(self, lease_id: str) -> None:
        super().__init__(Reason.worker_unreachable, f"lease {lease_id} was parked to disk before this cell was sent: "
                         "it runs once the lease resumes", 504)


class Attachment:
    """The attached lease: ``lease`` (as last seen), its ``remote`` kernel and
    its heartbeat. Create with :meth:`connect`."""

    def __init__(self, client: ServiceClient, lease: Lease, remote: RemoteKernel, heartbeat: KernelHeartbeat) -> None:
        self.client, self.lease, self.remote, self.heartbeat = client, lease, remote, heartbeat
        # Held by the main thread while it talks to the worker (cells, transfers).
        self.lock = threading.Lock()
        self.parked: Parked | None = None
        self.parking_here = False  # %gpu park asked for this park and says it itself
        self.reconnected = False  # the last resume came back as a new worker (spilled): forwarding starts again
        # The heartbeat thread and the main thread both follow the park.
        self._parking = threading.RLock()
        self._resumed_from: str | None = None  # the ``parked.since`` of the park last resumed from
        # Where the worker runs, in words (set when the gpupool kernel attaches; docs/api.md "Working directory").
        self.workdir: str | None = None
        self.shares_folder = False  # the worker started in the notebook's own folder (the same path here)
        self.worker_cwd: str | None = None  # the worker's folder as its last pull of everything found it
        # The most lanes of one transfer (c.GPUMagics.transfer_streams; 0: by cores), read per transfer.
        self.transfer_streams: Callable[[], int] = lambda: 0
        # Execution counts of the cells forwarded here: the worker's Out[n] and _n of those that showed a result.
        self.counts: list[int] = []

    def follow_parking(self, lease: Lease) -> None:
        """Keep :attr:`parked` as the service says (called on the heartbeat
        thread with each beat's lease): a lease seen ``parking`` or ``parked``
        pauses the worker's liveness checks and is said once; one seen active
        again (resumed by a cell, the service or the JupyterLab extension)
        runs as before, unless it came back as a new worker (spilled), which
        the next :meth:`resume` connects to; a resume that was not this
        kernel's :meth:`resume` (which says its own line) is said too: one
        this kernel asked with :meth:`ask_resume` (a frozen cell's, or the
        JupyterLab extension's when the user came back: a "resumed"
        notification, and the next cell's first line), and the service's own
        when the park was said. A beat that still shows the park this kernel
        has just resumed from is stale and left alone."""
        with self._parking:
            if parked_now(lease):
                if (lease.parked or {}).get("since") == self._resumed_from:
                    return
                first = self.parked is None
                if first:
                    self.parked = Parked(lease)
                else:
                    self.parked.lease = lease
                self.remote.pause_liveness(True)
                if first and not self.parking_here:
                    self.heartbeat.say(parked_words(lease, self.heartbeat.cell_running), kind="parked")
                    self.parked.noticed = True
                if first:  # said by that notice, or by %gpu park's own words
                    self.parked.lost_said = tuple((lease.parked or {}).get("lost") or ())
                self.parking_here = False
            elif self.parked is not None and lease.state is LeaseState.active:
                parked, running = self.parked, self.heartbeat.cell_running
                if lease.connection == self.remote.connection:
                    self._unparked(lease)
                    then = "; the running cell goes on" if running else ""
                elif parked.new_worker is None:  # the next cell connects to it (resume)
                    parked.new_worker, then = lease, "; the next cell connects to its new worker"
                else:
                    parked.new_worker = lease
                    return
                # Said in the frozen cell that goes on, or else atop the next cell and as a notification: a
                # resume asked here (README and docs/api.md promise "resumed" for a click in JupyterLab too),
                # or one the pool did by itself of a park that was said.
                if not parked.resuming and (parked.resume_asked or parked.noticed):
                    # The service's clock: this kernel's counts the wait in line too (a cell that gave up waiting).
                    took = resume_seconds(lease) if not running else None
                    if took is None and parked.resume_asked and not running:
                        took = time.monotonic() - parked.asked_at
                    parked.said_resumed = True
                    self.heartbeat.say(resumed_words(lease, took, parked_for(parked.lease), parked.lease.node) + then
                                       + parked.not_kept(lease), kind="resumed")

    def catch_up(self) -> Lease | None:
        """Ask the service for the lease now and follow it as a beat would: a park, a resume or a
        move that no beat has shown yet (a beat comes every interval, up to 15 s). A lease resuming
        (``starting`` with its park: in place, or moving to another node) counts as parked here, so
        that what needs its worker waits for the resume instead of talking to a worker that is
        frozen or gone (:meth:`.lifecycle.Lifecycle.release`). Returns the lease, None when the
        service cannot be asked (nothing changes)."""
        try:
            lease = self.client.get_lease(self.lease.id)
        except GPUPoolError:
            return None
        resuming = lease.state is LeaseState.starting and lease.parked is not None
        with self._parking:
            if parked_now(lease):
                self.follow_parking(lease)
            elif resuming:
                old = lease.parked.get("moving_from")
                seen = dataclasses.replace(lease, node=old) if old else lease  # where it was parked
                if self.parked is None:
                    self.parked = Parked(seen, noticed=True)
                    self.remote.pause_liveness(True)
                else:
                    self.parked.lease = seen
        return lease

    def park_that_interrupted(self, timeout: float) -> Lease | None:
        """A cell on the worker ended in a KeyboardInterrupt this kernel did not send: wait (at
        most ``timeout`` seconds; Ctrl-C stops it) for the service to show the park that
        interrupted it, and follow it, leaving its notice to the caller (the cell says it). Its
        node's agent stopping (``c.AgentParking.park_on_stop``) interrupts the cell, saves the
        worker to disk, and only then tells the service. Returns the ``parked`` lease, or None:
        none came (still active, ended, a park noticed already) or the service did not answer."""
        with self._parking:
            if self.parked is not None:
                return None
            self.parking_here = True  # whichever thread sees the park first, the cell says it
        deadline, state, lease = time.monotonic() + timeout, LeaseState.active.value, None
        try:
            while time.monotonic() < deadline:
                lease = self.client.get_lease(self.lease.id, wait=max(0.1, deadline - time.monotonic()), state=state)
                if lease.state is not LeaseState.parking:
                    break
                state = lease.state.value
        except (GPUPoolError, KeyboardInterrupt):
            lease = None
        with self._parking:
            if lease is None or lease.state is not LeaseState.parked:
                self.parking_here = False
                return None
            self.follow_parking(lease)
            if self.parked is None:
                return None
            self.parked.noticed = self.parked.told = True
        return lease

    def _unparked(self, lease: Lease) -> None:
        if self.parked is not None:
            self._resumed_from = (self.parked.lease.parked or {}).get("since")
        self.parked = None
        self.lease = lease
        self.remote.pause_liveness(False)

    def resume(self, start_timeout: float, on_state: Callable[[Lease, bool], None] | None = None,
               on_wait: Callable[[Lease], None] | None = None) -> Lease:
        """Resume the parked lease (``POST /leases/{id}/resume``) and wait
        for it with a progress line (:func:`gpupool.leasewait.wait_started`);
        returns the active lease. ``on_wait(lease)`` is called once, before the
        progress line, when the resume waits in line for room or for its node's agent. Raises GPUPoolError
        ``lease_lost`` when it ended meanwhile, ``start_timeout``, ``worker_unreachable``
        when the resumed worker does not answer (a spilled lease comes back as a new
        worker: this kernel connects to it, and :attr:`reconnected` says so). Interrupted
        (KeyboardInterrupt) or failed once asked, the resume goes on at the service without
        this call: it counts as asked (:meth:`ask_resume`), so that the heartbeat says it
        when it happens (its line, atop the next cell)."""
        with self._parking:
            parked = self.parked
            if parked is not None:
                parked.resuming = True
                # A resume asked before (an interrupted cell, the lab extension) or done already (a new
                # worker): this call does not see it from its start, so the service's clock times it.
                earlier = parked.resume_asked or parked.new_worker is not None
        started = time.monotonic()
        told, asked_at, tries = False, started, 1

        def seen(lease: Lease, was_queued: bool) -> None:
            nonlocal told, asked_at, tries
            if on_wait is not None and not told and lease.state in WAITING_FOR_ROOM \
                    and (lease.queue_position or lease.node_state == "lost"):
                told = True
                on_wait(lease)
            if on_state is not None:
                on_state(lease, was_queued)
            # Parked with no resume asked any more: the service's try failed (its agent away, say) and
            # left it parked. Ask again, as a new cell would, so it resumes once the agent is back.
            if lease.state is LeaseState.parked and not (lease.parked or {}).get("resume_requested") \
                    and time.monotonic() - asked_at >= RESUME_RETRY_S:
                why = (lease.events or [{}])[-1].get("reason") or "no reason given"
                if tries >= RESUME_TRIES:
                    raise GPUPoolError(Reason.park_failed, f"the pool tried to resume {lease.id} {tries} times and "
                                       f"it stayed parked; the last try: {why}. Run a cell to try again, or "
                                       "%gpu release --discard gives it up", 502)
                print(f"gpupool: {why}; asking again", file=sys.stderr, flush=True)
                asked_at, tries = time.monotonic(), tries + 1
                try:
                    self.client.resume(self.lease.id)
                except GPUPoolError as exc:
                    log.warning("could not ask again to resume %s: %s", self.lease.id, exc.message)

        asked, answered = False, None
        try:
            lease = answered = self.client.resume(self.lease.id)
            asked = True
            lease = wait_started(self.client, lease, started, start_timeout, setting="c.GPUMagics.start_timeout",
                                 on_state=seen, waiting=RESUME_STATES, cancels=False)
        except GPUPoolError as exc:
            self._gave_up_waiting(parked, asked, started)
            if exc.code == Reason.lease_failed:
                raise GPUPoolError(Reason.lease_lost, exc.message.replace("the lease could not start: ", ""),
                                   410) from None
            raise
        except BaseException:
            self._gave_up_waiting(parked, asked, started)
            raise
        with self._parking:
            self.reconnected = lease.connection != self.remote.connection
            if self.reconnected:  # spilled: a new worker holds the namespace now
                self.remote.close()
                self.remote = RemoteKernel(lease.connection or {})
            self._unparked(lease)
        if self.reconnected:
            self.remote.wait_ready(30.0)
        if parked is not None and parked.said_resumed:  # the heartbeat said it (atop this cell)
            return lease
        took = resume_seconds(lease) if parked is not None and earlier else None
        # What the park lost that its notice did not say (none, or one given while it was parking) comes now.
        not_kept = parked.not_kept(*(seen for seen in (answered, lease) if seen is not None)) if parked else ""
        say(resumed_words(lease, took if took is not None else time.monotonic() - started,
                          parked_for(parked.lease if parked else None), parked.lease.node if parked else None)
            + not_kept)
        return lease

    def _gave_up_waiting(self, parked: Parked | None, asked: bool, started: float) -> None:
        """:meth:`resume` stopped waiting (interrupted, failed): the resume it ``asked`` (at
        monotonic ``started``) goes on at the service, and the heartbeat is to say it when it comes."""
        with self._parking:
            if parked is None or parked is not self.parked:
                return
            parked.resuming = False
            if asked and not parked.resume_asked:
                parked.resume_asked, parked.asked_at = True, started

    @classmethod
    def connect(cls, client: ServiceClient, lease: Lease, timeout: float = 30.0) -> "Attachment":
        """Connect to an ``active`` lease's worker and start heartbeating.

        Raises GPUPoolError ``worker_unreachable`` if the worker does not answer.
        """
        remote = RemoteKernel(lease.connection or {})
        try:
            remote.wait_ready(timeout)
        except BaseException:
            remote.close()
            raise
        beat = KernelHeartbeat(client, lease.id, beat_interval(lease))
        attachment = cls(client, lease, remote, beat)
        beat.on_lease_seen = attachment.follow_parking
        beat.start()
        return attachment

    @property
    def ended(self) -> Lease | None:
        """The lease as last seen if it ended behind our back, else None."""
        return self.heartbeat.ended

    @property
    def is_parked(self) -> bool:
        """Whether the lease is parked (or parking) and has not ended: its worker waits frozen, or
        it resumed as a new worker this kernel connects to at the next cell (:attr:`new_worker`)."""
        return self.parked is not None and self.ended is None

    @property
    def new_worker(self) -> Lease | None:
        """The lease, active again on a new worker (spilled, or moved to another node) that this
        kernel has not connected to yet; None otherwise."""
        parked = self.parked
        return parked.new_worker if parked is not None else None

    def check_alive(self, sent: float | None = None) -> None:
        """Between polls of a wait on the worker: GPUPoolError ``lease_lost`` when the lease
        ended; :class:`CellNotSent` when it was parked to disk before ``sent`` (epoch seconds the
        wait's cell was sent: its worker had ended by then); ``worker_unreachable`` when it
        resumed on a new worker meanwhile (spilled to disk as a cell reached the old one: that
        worker is gone, its answer never comes); else, while parked, :meth:`ask_resume`."""
        if self.heartbeat.ended is not None:
            raise GPUPoolError(Reason.lease_lost, ended_words(self.heartbeat.ended), 410)
        parked = self.parked
        if sent is not None and parked is not None and _spilled_before(parked.lease, sent - CLOCK_SLACK_S):
            raise CellNotSent(self.lease.id)
        moved_on = self.new_worker
        if moved_on is not None:
            raise GPUPoolError(Reason.worker_unreachable, CELL_CUT_BY_SPILL.format(lease=moved_on.id,
                                                                                   node=moved_on.node), 504)
        self.ask_resume()

    def ask_resume(self) -> None:
        """While parked, ask the service (once per park, again every
        RESUME_RETRY_S after a failure) to resume the lease, without waiting:
        a cell in flight that a park froze (a park racing it, a preemption)
        goes on once it is thawed; a widget's message waits in the frozen
        worker's socket until then. The heartbeat sees an end. Asked in place:
        such a resume never moves the lease (a move loses what cannot be saved
        to disk); :meth:`resume`, for a cell that needs the worker, may."""
        parked = self.parked
        now = time.monotonic()
        if parked is None or parked.new_worker is not None or parked.resume_asked \
                or now - parked.failed_at < RESUME_RETRY_S:
            return
        parked.resume_asked, parked.asked_at = True, now
        try:
            lease = self.client.resume(self.lease.id, in_place=True)  # no cell needs it yet: never moved
        except GPUPoolError as exc:
            parked.resume_asked, parked.failed_at = False, now
            log.warning("could not ask to resume %s: %s", self.lease.id, exc.message)
            return
        threading.Thread(target=self._follow_resume, args=(lease,), name="gpupool-follow-resume", daemon=True).start()

    def _follow_resume(self, lease: Lease) -> None:
        """Long-poll the lease ``ask_resume`` asked to resume until it is active
        (or ended, or FOLLOW_RESUME_S passed), then follow it as a beat would:
        the kernel, the status bar and ``%gpu status`` see the resume at once,
        not at the next beat, which may be 15 s away."""
        deadline = time.monotonic() + FOLLOW_RESUME_S
        while lease.state is not LeaseState.active and not lease.state.ended and self.parked is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                lease = self.client.get_lease(lease.id, wait=min(10.0, left), state=lease.state.value)
            except GPUPoolError:
                return  # the heartbeat sees what happened
        if lease.state is LeaseState.active and not self.heartbeat.stopped:
            self.heartbeat.last = lease
            self.follow_parking(lease)
            if self.heartbeat.on_lease is not None:
                self.heartbeat.on_lease(lease)

    def run_cell(self, code: str, max_output_bytes: int | None = None) -> None:
        """Run ``code`` on the worker with its outputs in the current cell.

        Raises a :class:`~gpupool.magics.relay.RemoteError` subclass when the
        remote cell failed, GPUPoolError ``lease_lost`` when the lease ended
        while the cell ran, KeyboardInterrupt when interrupted.
        """
        relay = OutputRelay(max_output_bytes)
        with self.lock:
            self.check_alive()
            self.heartbeat.running(True)
            try:
                self.remote.execute(code, relay, _ask_stdin, self.check_alive)
            finally:
                self.heartbeat.running(False)
                relay.finish()
        if relay.error is not None:
            raise remote_error(relay.error)

    def push(self, values: dict[str, Any], devices: dict[str, str] | None = None
             ) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """Send ``values`` into the worker's namespace; ``devices`` (name ->
        ``"cuda:0"``) says where the worker puts each one (what a pull
        recorded; a value whose device is missing there stays on the CPU and
        is listed in the errors). Returns ``(items sent, errors by name)``."""
        with self._guarded():
            header, answer = dataplane.push(self._comm_unlocked, self.remote.connection, values, devices or {},
                                            streams=self.transfer_streams())
        errors = {**header["errors"], **answer.get("errors", {})}
        return [i for i in header["items"] if i["name"] in answer.get("loaded", [])], errors

    def pull(self, names: list[str] | None, max_bytes: int | None = None) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, str]]:
        """Fetch ``names`` (None: all user variables) from the worker, within ``max_bytes``
        (None: all); GPU tensors arrive on the CPU. Returns ``(values, items, errors by name)``."""
        request = Pull(names=names, max_bytes=max_bytes) if names is not None else PullAll(max_bytes=max_bytes)
        with self._guarded():
            header, buffers = dataplane.pull(self._comm_unlocked, self.remote.connection, request,
                                             streams=self.transfer_streams())
        if names is None:
            self.worker_cwd = header.get("cwd")
        try:
            return load_pulled(header, buffers)
        except KeyboardInterrupt:
            raise dataplane.TransferInterrupted("unpacking", [i["name"] for i in header.get("items", [])]) from None

    def move_to(self, other: "Attachment") -> tuple[list[dict[str, Any]], dict[str, str]]:
        """Move this worker's variables and modules into ``other``'s worker,
        worker to worker (docs/parking.md, "Moving"): this one offers its
        ``pull_all`` on its data plane, the other takes it from there and
        restores it, the cells' results (``Out[n]``) too. Returns ``(items moved,
        errors by name)``: what could not travel (and why) and what did not
        restore there. GPUPoolError
        ``transfer_failed`` with nothing changed on either side but what the
        other's answer lists; this worker is left as it was."""
        ticket = dataplane.ticket_for(self.remote.connection, self.transfer_streams())
        if ticket is None or not other.remote.connection.get("transfer_port"):
            raise GPUPoolError(Reason.transfer_failed, "a move needs both workers' data planes (their agents give "
                               "them a transfer_port); release and acquire instead", 409)
        with self._guarded():  # counted as running throughout: no idle park meanwhile
            offered, _ = self._comm_unlocked(PullAll(stream=ticket.wire(), stream_all=True, outputs=True))
            header = offered["header"]
            sizes = header.pop("stream")["sizes"]
            source = {"ip": self.remote.connection["ip"], "transfer_port": self.remote.connection["transfer_port"]}
            answer, _ = other._comm(Fetch(source=source, stream={**ticket.wire(), "sizes": sizes}, header=header))
        loaded = set(answer.get("loaded", []))
        items = [item for item in header.get("items", []) if item["name"] in loaded]
        items += [{"name": name, "type": "module", "module": module, "nbytes": 0}
                  for name, module in header.get("modules", {}).items() if name in loaded]
        other.counts = list(self.counts)  # the cells' results went along: a release brings them home from there
        return as_outputs(items, {**header.get("errors", {}), **answer.get("errors", {})})

    def have(self, names: list[str]) -> set[str]:
        """Which of ``names`` the worker's namespace holds (one comm round trip)."""
        answer, _ = self._comm(Have(names=names))
        return set(answer.get("have", []))

    def versions(self) -> dict[str, str]:
        """The worker's Python and key package versions (see gpupool.transfer.package_versions)."""
        answer, _ = self._comm(Versions(), timeout=30)
        return dict(answer.get("versions", {}))

    def request(self, request: Request, timeout: float = 30.0) -> tuple[dict[str, Any], list]:
        """One request of the worker's transfer comm (:mod:`gpupool.wire.transfer`);
        raises GPUPoolError ``transfer_failed`` when the worker answers not ok."""
        return self._comm(request, timeout=timeout)

    def _comm(self, request: Request, buffers: list | None = None,
              timeout: float = 600.0) -> tuple[dict[str, Any], list]:
        """One transfer request, guarded like a cell: it ends as soon as the
        lease is seen ended or the worker stops answering its heartbeat."""
        with self._guarded():
            return self._comm_unlocked(request, buffers, timeout)

    @contextlib.contextmanager
    def _guarded(self):
        """Hold the lock and count as running (no idle reclaim, no parking)
        for one transfer, all its round trips and its stream."""
        with self.lock:
            self.check_alive()
            self.heartbeat.running(True)
            try:
                yield
            finally:
                self.heartbeat.running(False)

    def _comm_unlocked(self, request: Request, buffers: list | None = None,
                       timeout: float = 600.0) -> tuple[dict[str, Any], list]:
        answer, buffers = self.remote.comm_request(TARGET, request.to_json(), buffers, timeout=timeout,
                                                   check=self.check_alive)
        _raise_unless_ok(answer)
        return answer, buffers

    def release(self, reason: str | None = None) -> Lease:
        """Stop heartbeating, close the connection and release the lease."""
        self.heartbeat.stop()
        self.remote.close()
        return self.client.release(self.lease.id, reason=reason)

    def refresh(self) -> Lease:
        """The lease as the service sees it now."""
        self.lease = self.client.get_lease(self.lease.id)
        return self.lease


def _raise_unless_ok(answer: dict[str, Any]) -> None:
    if not answer.get("ok"):
        raise GPUPoolError(Reason.transfer_failed,
                           f"the worker could not complete the transfer: {answer.get('message')}", 502)


def _ask_stdin(request: dict[str, Any]) -> str:
    """Answer the worker's ``input_request`` by asking the notebook user."""
    prompt = request.get("prompt", "")
    return getpass.getpass(prompt) if request.get("password") else input(prompt)


def _spilled_before(lease: Lease, when: float) -> bool:
    """Whether ``lease`` (as a parked one was last seen) was parked to disk before ``when`` (epoch s)."""
    park = lease.parked or {}
    return park.get("tier") == "disk" and bool(park.get("since")) and parse_time(park["since"]).timestamp() < when
