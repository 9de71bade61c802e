"""The notebook's attachment, from acquire to release: the one place it is
set and cleared.

:class:`Lifecycle` holds at most one :class:`~.attachment.Attachment` and
does what changes it: ``%gpu acquire`` (attach, or move while attached),
``%gpu release``, ``%gpu restart``, ``%gpu park`` and the resume of a
parked lease before a cell, the drop of a lease that ended behind the
user's back, the release at exit; and a ``%%gpu`` cell's lease of its own,
which the notebook never holds.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Any, Iterator

from IPython.core.error import UsageError

from gpupool.errors import GPUPoolError, Reason
from gpupool.schema import LeaseState
from gpupool.tables import held_seconds, host_words, memory_words, released_words, share_words, slice_words
from gpupool.units import format_duration
from gpupool.wire.leases import LeaseRequest

from . import move
from .attach import Attacher, join_notebook, same_size
from .attachment import Attachment
from .classes import class_note
from .dataplane import TransferInterrupted
from .park import parked_words
from .service import Service
from .tell import Tell
from .transfers import Transfers
from .wait import QueueWait
from .words import CELL_DID_NOT_RUN, ended_words, pull_interrupted, release_interrupted, say

log = logging.getLogger("gpupool.magics")


class Lifecycle:
    """Owns the notebook's attachment (:attr:`attachment`). Gets workers
    with ``attacher``, brings variables back with ``transfers``, waits for a
    park with ``wait``, releases through ``service`` and tells the front ends
    with ``tell``. Every method that fails raises UsageError (or
    GPUPoolError, which ``%gpu`` turns into one) with words for the user."""

    def __init__(self, service: Service, attacher: Attacher, wait: QueueWait, transfers: Transfers,
                 tell: Tell) -> None:
        self.service, self.attacher, self.wait, self.transfers, self.tell = service, attacher, wait, transfers, tell
        self._attachment: Attachment | None = None

    @property
    def attachment(self) -> Attachment | None:
        """The notebook's attachment as it is (parked or ended too), None while detached."""
        return self._attachment

    def attached(self, releasing: bool = False) -> Attachment:
        """The live attachment, resuming a parked lease first; UsageError when
        not attached or when the lease ended (the attachment is dropped).
        ``releasing``: for ``%gpu release``, which says before a wait in line for
        room why it waits and what else there is, and, interrupted, that nothing
        was released."""
        attachment = self._attachment
        if attachment is None:
            raise UsageError("not attached to a GPU; run %gpu acquire 0.5 first")
        if attachment.is_parked:
            try:
                return self.attacher.resume(attachment, on_wait=_release_waits if releasing else None)
            except GPUPoolError as exc:
                if exc.code in (Reason.lease_lost, Reason.invalid_state):  # it ended meanwhile
                    self.drop()
                raise UsageError(f"could not resume the parked lease: {exc.message}") from None
            except KeyboardInterrupt:
                if releasing:
                    raise UsageError(release_not_waited(attachment, _withdraw_resume(attachment))) from None
                raise UsageError(f"interrupted while waiting for {attachment.lease.id} to resume; the "
                                 "resume goes on and the next cell runs on it (%gpu release --discard gives the "
                                 "lease up now, without its variables)") from None
        ended = attachment.ended
        if ended is not None:
            self.drop()
            raise UsageError(ended_words(ended, CELL_DID_NOT_RUN))
        return attachment

    @contextlib.contextmanager
    def on_worker(self) -> Iterator[Attachment]:
        """The live attachment (:meth:`attached`) for one use of its worker:
        a GPUPoolError inside becomes UsageError, and a lost lease is dropped."""
        attachment = self.attached()
        try:
            yield attachment
        except GPUPoolError as exc:
            if exc.code == Reason.lease_lost:
                self.drop()
            raise UsageError(exc.message) from None

    def acquire(self, request: LeaseRequest) -> None:
        """``%gpu acquire``: attach to a new lease for ``request``, or, while
        attached, move there with the variables."""
        if self._attachment is not None and self._attachment.ended is None:
            self._move(request)
            return
        self.drop()
        started = time.monotonic()
        self._attachment = attachment = self.attacher.connect(request)
        lease = attachment.lease
        where = ("Cells now run on the worker; %gpu release detaches." if self.attacher.forwards else
                 "This kernel is not the gpupool kernel, so cells stay here: start one with %%gpu to run it "
                 "on the worker (the Python 3 (gpupool) kernel runs every cell there).")
        say(f"attached {lease.id}: {slice_words(lease)}, {memory_words(lease)}{host_words(lease)}; "
            f"idle timeout {format_duration(lease.idle_timeout)}{class_note(lease)} "
            f"[{time.monotonic() - started:.1f}s]. {where}")
        if attachment.workdir:
            say(attachment.workdir)
        self.tell("attached", f"attached {lease.id}: {share_words(lease)} on {lease.node}")

    def _move(self, request: LeaseRequest) -> None:
        """Move the attached notebook (a parked lease resumes first) to a new
        lease for ``request`` (:mod:`.move`); on any failure it stays on its old one,
        parked again where it was parked (its GPU back in the pool, as before)."""
        was_parked = self._attachment.is_parked  # acquire() calls this only while attached
        request = move.target(self._attachment.lease, request)  # refused for what it asks: nothing resumed
        old = self.attached()
        started = time.monotonic()
        try:
            new = self.attacher.connect(request, forward=False)
        except (GPUPoolError, UsageError) as exc:
            if was_parked:
                try:
                    self.park()
                except UsageError as again:
                    raise UsageError(f"could not move: {getattr(exc, 'message', exc)}; {old.lease.id} was resumed "
                                     f"for the move and stays active: {again}") from None
            raise move.not_started(exc, old.lease.id, parked_again=was_parked) from None
        # Said once the pool gave the new lease, not before: a refused move moves nothing.
        say(f"moving {old.lease.id} to {new.lease.id}; its variables go worker to worker")
        # Said before the old worker goes: what did not travel is named while it still exists.
        say(move.carry(old, new, started))
        self._attachment = new
        self.attacher.forward(new)
        old.release(reason=f"moved to {new.lease.id}")
        self.tell("attached", f"moved to {new.lease.id} on {new.lease.node}")

    def release(self, discard: bool) -> None:
        """``%gpu release``: bring the worker's variables back unless
        ``discard``, then release; detached from then on, whatever the service answers.
        A park, resume or move the heartbeat has not shown yet is asked for first
        (:meth:`.attachment.Attachment.catch_up`): a lease that moves to another node is
        followed there (its variables come home from the new worker), or, with ``discard``,
        released at once, saying its state is gone."""
        if self._attachment is not None and self._attachment.ended is None:
            self._attachment.catch_up()
        if discard and self._attachment is not None and self._attachment.parked is not None:
            self._release_parked()
            return
        moving = _moving(self._attachment).get("moving_from")
        if moving:
            say(f"{self._attachment.lease.id} is moving from {moving} to another node (its state goes to a new worker "
                f"there): %gpu release waits for it, then brings its variables home; %gpu release --discard gives it "
                f"up now, without them")
        # A parked lease resumes first: its variables come home from the worker.
        attachment = self.attached(releasing=not discard)
        note = ""
        if not discard:
            try:
                note = self.transfers.bring_back(attachment)
            except GPUPoolError as exc:  # the worker died or is unreachable: the slice is still freed
                note = f"; the worker's variables could not come back: {exc.message}"
            except TransferInterrupted as exc:  # stopped before anything changed: still attached, as before
                raise UsageError(release_interrupted(exc, attachment.lease.id)) from None
        self._attachment = None
        try:
            lease = attachment.release(reason="%gpu release")
        except KeyboardInterrupt:  # finish what was asked (release is idempotent), then stop
            lease = attachment.client.release(attachment.lease.id, reason="%gpu release")
        say(f"{released_words(lease)}{note}{service_caveat(lease, '%gpu release')}")
        self.tell("released", f"released {lease.id} after {format_duration(held_seconds(lease))}")

    def _release_parked(self) -> None:
        """``%gpu release --discard`` of a parked (or resuming, or moving) lease: nothing to bring
        back, no resume waited for."""
        attachment, self._attachment = self._attachment, None
        move = _moving(attachment)
        moving = move.get("moving_from")
        # Its resume in line for room (the service's place): said, since that is why it was given up without them.
        waiting = attachment.parked is not None and bool(attachment.parked.lease.queue_position)
        try:
            lease = attachment.release(reason="%gpu release --discard")
        finally:
            self.tell()  # detached here, whatever the service answered
        left = (f"its state on {moving}'s disk is deleted" if move.get("tier") == "disk" else
                f"its worker on {moving}, which held its state, is ended")
        gone = (f"; it was moving from {moving} to {lease.node}: its variables were discarded ({left}, nothing of "
                f"it stays on {lease.node})") if moving else \
            "; its variables were discarded" + (" (frozen with its worker, they could come home only after its "
                                                "resume, which was still waiting for room)" if waiting else "")
        say(f"{released_words(lease)}{gone}{service_caveat(lease, '%gpu release --discard')}")
        self.tell("released", f"released {lease.id} (it was parked)")

    def restart(self) -> None:
        """``%gpu restart``: release the lease without its variables (the
        worker may be stuck) and attach to a fresh one of the same size."""
        if self._attachment is None:
            raise UsageError("not attached to a GPU; run %gpu acquire 0.5 first")
        old = self._attachment.lease
        self.drop()
        try:
            self.service.client.release(old.id, reason="%gpu restart")
        except GPUPoolError as exc:  # already ended (parked, reclaimed): a new slice is what was asked for
            print(f"gpupool: {old.id}: {exc.message}", file=sys.stderr)
        self._attachment = self.attacher.connect(same_size(old))
        say(f"restarted: released {old.id} (its variables are lost), attached {self._attachment.lease.id}")
        self.tell("attached", f"restarted: attached {self._attachment.lease.id}")

    def park(self) -> None:
        """``%gpu park``: give the GPU back now, keeping everything: the worker
        waits frozen on its node with its variables; the next cell resumes it."""
        if self._attachment is not None and self._attachment.is_parked and self._attachment.new_worker is None:
            say(f"{self._attachment.lease.id} is parked already; the next cell resumes it")
            return
        attachment = self.attached()
        attachment.parking_here = True
        try:
            lease = self.wait.parked(self.service.client.park(attachment.lease.id))
        except GPUPoolError as exc:
            attachment.parking_here = False
            raise UsageError(f"could not park {attachment.lease.id}: {exc.message}") from None
        if lease.state is not LeaseState.parked:
            attachment.parking_here = False
            raise UsageError(f"{lease.id} is {lease.state.value}: {lease.reason or 'not parked'}")
        attachment.parking_here = True  # whichever thread sees the park first, this says it
        attachment.follow_parking(lease)
        if attachment.parked is not None:
            attachment.parked.told = True
        say(parked_words(lease, running=False))
        self.tell("parked", f"parked {lease.id}")

    def run_on_own_lease(self, request: LeaseRequest, cell: str, max_output_bytes: int, execution_count: int) -> None:
        """``%%gpu AMOUNT`` while detached: run ``cell`` (this notebook's cell ``execution_count``) on a
        lease of its own for ``request``, in the notebook's folder where the worker can enter it (its
        output cut after ``max_output_bytes``), then bring its variables back and release it. Raises
        UsageError."""
        try:
            attachment = self.attacher.connect(request, forward=False)
        except GPUPoolError as exc:
            raise UsageError(exc.message) from None
        try:
            join_notebook(attachment, execution_count)
            self.transfers.send_along(attachment, cell)
            attachment.run_cell(cell, max_output_bytes)
        except GPUPoolError as exc:
            raise UsageError(exc.message) from None
        finally:
            self._bring_back_and_release(attachment, "%%gpu cell finished")

    def _bring_back_and_release(self, attachment: Attachment, reason: str) -> None:
        note, stopped = "", None
        try:
            if attachment.ended is None:
                note = self.transfers.bring_back(attachment)
        except TransferInterrupted as exc:  # the cell's own lease goes anyway: say that its variables stayed there
            stopped = exc
        finally:
            lease = attachment.release(reason=reason)
        if stopped is not None:
            raise UsageError(f"released {lease.id}; its variables did not come back: {pull_interrupted(stopped)}")
        say(f"released {lease.id}{note}")

    def drop(self) -> None:
        """Forget the attachment without releasing (the lease has ended)."""
        if self._attachment is not None:
            self._attachment.heartbeat.stop()
            self._attachment.remote.close()
            self._attachment = None
            self.tell()

    def close(self, reason: str) -> None:
        """Release the lease without its variables, best effort (the kernel
        exits or the extension is unloaded); the service's heartbeat TTL is the backstop."""
        attachment, self._attachment = self._attachment, None
        if attachment is not None:
            try:
                attachment.release(reason=reason)
            except Exception:  # best effort at exit
                pass


def _release_waits(lease) -> None:
    """Said once by ``%gpu release`` whose parked lease's resume waits in line for room, or for its
    node's agent: why it waits, and what else the user may do."""
    if lease.node_state == "lost":
        where, waits = f"saved on {lease.node or 'its node'}", "waiting for that node's agent to come back"
    elif (lease.parked or {}).get("tier") == "disk":
        where, waits = f"saved on {lease.node or 'its node'}'s disk", "waiting for room"
    else:
        where, waits = f"frozen on {lease.node or 'its node'}", "waiting for room"
    say(f"%gpu release brings the variables home from {lease.id}'s worker, {where}, which must resume first: "
        f"{waits} (Ctrl-C stops waiting, releasing nothing; %gpu release --discard gives it up now, its "
        "variables lost)")


def _withdraw_resume(attachment: Attachment) -> bool:
    """Withdraw the parked lease's resume that an interrupted ``%gpu release`` asked
    (``POST /leases/{id}/park`` on a parked lease); False when it could not be (placed already,
    under way, or the service did not answer)."""
    try:
        lease = attachment.client.park(attachment.lease.id)
    except GPUPoolError as exc:
        log.warning("could not withdraw the resume of %s: %s", attachment.lease.id, exc.message)
        return False
    return lease.state is LeaseState.parked and not (lease.parked or {}).get("resume_requested")


def release_not_waited(attachment: Attachment, withdrawn: bool) -> str:
    """What an interrupted ``%gpu release`` of a parked lease says: nothing was released, the lease is
    parked with its variables; its resume was ``withdrawn``, or else (under way already) what comes
    of it: it resumes when room comes and holds its GPU until parked again."""
    parked = attachment.parked.lease if attachment.parked is not None else attachment.lease
    node = (parked.parked or {}).get("moving_from") or parked.node or "its node"
    said = f"interrupted: {attachment.lease.id} was not released; it stays parked on {node} with its variables"
    if withdrawn:
        return f"{said}, its resume withdrawn (the next cell asks it again)"
    return (f"{said}. Its resume is under way, though: it resumes and holds its GPU until it is idle long enough to "
            "be parked again (%gpu park parks it at once then; %gpu release --discard gives it up now, its variables "
            "lost)")


def _moving(attachment: Attachment | None) -> dict[str, Any]:
    """The service's ``parked`` object of a lease that is resuming (``moving_from``: the node its
    state is on when it moves; ``tier``: ``memory``, its old worker, or ``disk``, a spill), as last
    seen by :meth:`.attachment.Attachment.catch_up`; empty when it is not resuming."""
    seen = attachment.parked.lease if attachment is not None and attachment.parked is not None else None
    if seen is None or seen.state is not LeaseState.starting:
        return {}
    return seen.parked or {}


def service_caveat(lease, asked: str) -> str:
    """``"; the pool says: WORDS"`` for what the service added to the reason
    ``asked`` of a release (its reason reads ``"released by its owner: ASKED;
    WORDS"``: e.g. its worker was not confirmed stopped, its node being
    lost), or its whole reason when the lease had ended otherwise; "" when
    it added nothing."""
    reason = lease.reason or ""
    marker = f"{asked}; "
    if marker in reason:
        return f"; the pool says: {reason.split(marker, 1)[1]}"
    if not reason or reason.endswith(asked):
        return ""
    return f"; the pool says: {reason}"
