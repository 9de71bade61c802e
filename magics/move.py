"""``%gpu acquire`` while attached: the notebook moves to a new lease of
another size, model or environment. The old worker's variables and modules
go worker to worker (:meth:`.attachment.Attachment.move_to`: node to node,
never through this kernel); what cannot travel is said before the old
worker is released; a move that fails or is interrupted leaves the notebook
on the old lease with everything, and gives the new one back."""

from __future__ import annotations

import time
from dataclasses import replace

from IPython.core.error import UsageError

from gpupool.errors import GPUPoolError
from gpupool.tables import slice_words
from gpupool.wire.leases import Lease, LeaseRequest

from .attach import attach, start_forwarding
from .summary import summarize
from .words import say


def move(magics, request: LeaseRequest) -> None:
    """Move the attached notebook (a parked lease resumes first) to a new
    lease for ``request``. UsageError, with the notebook still on its old
    lease, when ``request`` asks what it holds already, or when the new
    lease or the move fails or is interrupted."""
    old = magics.attached()
    if same_slice(old.lease, request):
        raise UsageError(f"already attached to {old.lease.id} ({slice_words(old.lease)}); ask another size, "
                         "--model or --env to move there, or run %gpu restart for a fresh worker (a lease's "
                         "idle timeout, CPUs and host memory stay as asked: %gpu release, then %gpu acquire)")
    if request.idle_timeout is None and old.lease.idle_timeout is not None:
        request = replace(request, idle_timeout=old.lease.idle_timeout)  # the user's own timeout goes along
    started = time.monotonic()
    say(f"moving {old.lease.id} to a new lease; its variables go worker to worker once that one starts")
    try:
        new = attach(magics, request, forward=False)
    except (GPUPoolError, UsageError) as exc:
        # Only where room or quota refused it does holding two leases for a moment matter.
        hint = (" (a move holds both leases for a moment: where the old one leaves no room, %gpu release then "
                "%gpu acquire)") if getattr(exc, "code", None) in ("pool_full", "quota_exceeded") else ""
        raise UsageError(f"could not move: {getattr(exc, 'message', exc)}; still attached to {old.lease.id}, "
                         f"nothing changed{hint}") from None
    try:
        items, errors = old.move_to(new)
    except BaseException as exc:
        new.release(reason=f"the move from {old.lease.id} did not complete")
        if isinstance(exc, KeyboardInterrupt):
            raise UsageError(f"move interrupted; still attached to {old.lease.id} with all its variables "
                             f"({new.lease.id} was released)") from None
        if isinstance(exc, GPUPoolError):
            raise UsageError(f"could not move {old.lease.id}: {exc.message}; still attached to it with all its "
                             f"variables ({new.lease.id} was released)") from None
        raise
    # Said before the old worker goes: what did not travel is named while it still exists.
    say(f"moved {old.lease.id} to {new.lease.id}: {slice_words(new.lease)}{summarize('moved', items, errors)} "
        f"[{time.monotonic() - started:.1f}s]")
    magics.attachment = new
    if magics.kernel is not None:
        start_forwarding(magics, new)
    old.release(reason=f"moved to {new.lease.id}")
    magics.tell("attached", f"moved to {new.lease.id} on {new.lease.node}")


def same_slice(lease: Lease, request: LeaseRequest) -> bool:
    """Whether ``request`` asks for what ``lease`` holds: its share, and its
    model, memory and environment where the request names them."""
    model = (lease.gpus or [{}])[0].get("name") or ""
    return ((request.fraction, request.gpu_count) == (lease.fraction, lease.gpu_count)
            and (request.model is None or request.model.lower() in model.lower())
            and request.memory in (None, lease.memory)
            and request.env in (None, lease.env))
