"""``%gpu acquire`` while attached: the notebook moves to a new lease of
another size, model or environment. The old worker's variables and modules
go worker to worker (:meth:`.attachment.Attachment.move_to`: node to node,
never through this kernel); what cannot travel is said before the old
worker is released; a move that fails or is interrupted leaves the notebook
on the old lease with everything, and gives the new one back.

The words and checks of a move; :meth:`.lifecycle.Lifecycle.acquire` does it.
"""

from __future__ import annotations

import time
from dataclasses import replace

from IPython.core.error import UsageError

from gpupool.errors import GPUPoolError
from gpupool.tables import slice_words
from gpupool.wire.leases import Lease, LeaseRequest

from .attachment import Attachment
from .summary import summarize


def target(lease: Lease, request: LeaseRequest) -> LeaseRequest:
    """What a move from ``lease`` asks for: ``request``, with the lease's
    idle timeout when the request names none, ``replaces`` the lease (so the
    quota does not count the lease it moves from, held for a moment with the
    new one). UsageError when ``request`` asks what ``lease`` holds already."""
    if same_slice(lease, request):
        raise UsageError(f"already attached to {lease.id} ({slice_words(lease)}); ask another size, "
                         "--model or --env to move there, or run %gpu restart for a fresh worker (a lease's "
                         "idle timeout, CPUs and host memory stay as asked: %gpu release, then %gpu acquire)")
    if request.idle_timeout is None and lease.idle_timeout is not None:
        request = replace(request, idle_timeout=lease.idle_timeout)  # the user's own timeout goes along
    return replace(request, replaces=lease.id)


def not_started(exc: Exception, old_id: str, parked_again: bool = False) -> UsageError:
    """The error for a move whose new lease could not be had (``exc``: a GPUPoolError or UsageError);
    ``parked_again``: the old lease, parked, was resumed for the move and is parked again."""
    # Only where the pool had no room does holding two leases for a moment matter: the old lease's
    # room may be what the new one needs. Not for a quota: the move's ``replaces`` keeps the old lease
    # out of max_gpus already, and a release gives back no GPU-hours.
    hint = (" (a move holds both leases for a moment: where the old one leaves no room, %gpu release then "
            "%gpu acquire)") if getattr(exc, "code", None) == "pool_full" else ""
    state = ", parked again as it was" if parked_again else ", nothing changed"
    return UsageError(f"could not move: {getattr(exc, 'message', exc)}; still attached to {old_id}{state}{hint}")


def carry(old: Attachment, new: Attachment, started: float) -> str:
    """Move ``old``'s variables into ``new``'s worker; returns the line that
    says what moved (``started``: monotonic seconds the move began). On
    failure or interrupt ``new`` is released and UsageError says the
    notebook is still on ``old``."""
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
    return (f"moved {old.lease.id} to {new.lease.id}: {slice_words(new.lease)}{summarize('moved', items, errors)} "
            f"[{time.monotonic() - started:.1f}s]")


def same_slice(lease: Lease, request: LeaseRequest) -> bool:
    """Whether ``request`` asks for what ``lease`` holds: its share, and its
    model, memory and environment where the request names them."""
    model = (lease.gpus or [{}])[0].get("name") or ""
    return ((request.fraction, request.gpu_count) == (lease.fraction, lease.gpu_count)
            and (request.model is None or request.model.lower() in model.lower())
            and request.memory in (None, lease.memory)
            and request.env in (None, lease.env))
