"""Getting a worker for the notebook: create a lease, wait for its worker
with progress, connect, start forwarding (in the gpupool kernel); a parked
lease's resume in place; a ``%%gpu`` cell's own lease.

Functions of :class:`~gpupool.magics.magics.GPUMagics` ``magics`` (its
client, kernel, settings and attachment); every failure cancels the lease.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import replace

from IPython.core.error import UsageError

from gpupool.errors import GPUPoolError
from gpupool.leasewait import START_WAIT_S, WAITING_FOR_ROOM, cancel, wait_started
from gpupool.schema import ENV_KERNEL_NAME, kernel_environment
from gpupool.wire.leases import LeaseRequest
from gpupool.wire.transfer import Attach
from gpupool.transfer import package_versions, version_mismatches
from gpupool.units import parse_gpu_amount

from .attachment import Attachment
from .dataplane import TransferInterrupted
from .summary import summarize
from .words import pull_interrupted, push_interrupted, say


def attach(magics, request: LeaseRequest, forward: bool = True) -> Attachment:
    """Create a lease for ``request``, wait for its worker (with progress),
    connect and warn about version mismatches. Cancels the lease on any
    failure or interrupt. The lease names the JupyterHub server this kernel
    runs in, so stopping that server releases it. In the gpupool kernel,
    ``forward`` (not for a ``%%gpu`` cell's own lease) starts forwarding."""
    started = time.monotonic()
    try:
        lease = magics.client.create_lease(replace(request, server_name=os.environ.get("JUPYTERHUB_SERVER_NAME")),
                                           start_wait=START_WAIT_S)
    except KeyboardInterrupt:  # before the pool answered: no id to cancel
        raise UsageError("interrupted before the pool answered; this kernel holds no lease (one the pool made "
                         "meanwhile hears no heartbeat and is reclaimed within its heartbeat TTL)") from None
    attachment = None
    try:
        lease = _wait_started(magics, lease, started)
        attachment = Attachment.connect(magics.client, lease)
        if magics.kernel is not None and forward:
            start_forwarding(magics, attachment)
    except BaseException as exc:  # interrupted or failed: never leave the slice held
        if attachment is not None:
            attachment.heartbeat.stop()
            attachment.remote.close()
        cancel(magics.client, lease.id)
        magics.tell()
        if isinstance(exc, KeyboardInterrupt):  # the user's own doing: one line, not urllib's traceback
            raise UsageError(f"interrupted; the request {lease.id} was cancelled") from None
        raise
    _warn_versions(attachment)
    if not forward:  # a %%gpu cell's own lease: the notebook stays detached
        magics.tell()
    return attachment


def start_forwarding(magics, attachment: Attachment) -> None:
    """Hand the worker's IOPub to the kernel's relay, tell the worker this
    notebook's execution count and folder, and send notices as events."""
    attachment.remote.relay_iopub(magics.kernel.cell.publish)
    attachment.heartbeat.notify = functools.partial(magics.kernel.notices.notify, beat=attachment.heartbeat)
    attachment.heartbeat.on_lease = lambda lease: magics.tell()
    user = attachment.lease.owner
    answer, _ = attachment.request(Attach(execution_count=magics.shell.execution_count, cwd=os.getcwd(), user=user))
    cwd = answer.get("cwd")
    attachment.workdir = (f"the worker runs in this notebook's folder, {cwd}" if answer.get("notebook_dir") else
                          f"the GPU node cannot enter this notebook's folder {os.getcwd()}, so the worker runs "
                          f"in a scratch folder of yours there, {cwd}: copy the files it needs with %gpu push "
                          "or a shared folder")


def _warn_versions(attachment: Attachment) -> None:
    try:
        mismatches = version_mismatches(package_versions(), attachment.versions())
    except GPUPoolError as exc:
        print(f"gpupool: could not compare package versions with the worker: {exc.message}", file=sys.stderr)
        return
    if mismatches:
        print("gpupool: warning: versions differ, values of these may fail to move between this kernel and "
              "the worker: " + "; ".join(mismatches), file=sys.stderr, flush=True)


def _wait_started(magics, lease, started: float):
    """:func:`gpupool.leasewait.wait_started` with the magics' start timeout
    (c.GPUMagics.start_timeout) and the kernel's progress events."""
    return wait_started(magics.client, lease, started, magics.start_timeout, setting="c.GPUMagics.start_timeout",
                        on_state=functools.partial(_tell_progress, magics, started=started))


def _tell_progress(magics, lease, was_queued: bool, *, started: float) -> None:
    """A waited-for ``lease``: its queued/starting state, and "admitted"
    once it leaves the queue (gpupool kernel only; gpupool.magics.events)."""
    events = getattr(magics.kernel, "events", None)
    if events is None:
        return
    from .events import lease_state, progress_phase

    if was_queued and lease.state not in WAITING_FOR_ROOM:
        events.emit("admitted", f"{lease.id} left the queue after {time.monotonic() - started:.0f}s; "
                                f"starting on {lease.node or 'the pool'}")
    events.changed(lease_state(progress_phase(lease), lease))


def resume(magics) -> Attachment:
    """The lease is parked: resume it in place (with progress) before the
    cell runs; the same worker, its variables as they were. Raises
    GPUPoolError (``lease_lost`` when it ended meanwhile)."""
    attachment = magics.attachment
    started = time.monotonic()
    lease = attachment.resume(magics.start_timeout, on_state=functools.partial(_tell_progress, magics,
                                                                               started=started))
    if attachment.reconnected and magics.kernel is not None:  # a new worker (spilled): forward to it now
        start_forwarding(magics, attachment)
    magics.tell("resumed", f"resumed {lease.id} on {lease.node}")
    return attachment


def run_on_own_lease(magics, amount: str, cell: str) -> None:
    """``%%gpu AMOUNT`` while detached: run ``cell`` on a lease of its own,
    then bring its variables back and release it. Raises UsageError."""
    try:
        fraction, count = parse_gpu_amount(amount)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    request = LeaseRequest(fraction=fraction, gpu_count=count, kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"),
                           prefer_env=kernel_env())
    try:
        attachment = attach(magics, request, forward=False)
    except GPUPoolError as exc:
        raise UsageError(exc.message) from None
    try:
        send_along(magics.variables, attachment, cell)
        attachment.run_cell(cell, magics.max_output_bytes)
    except GPUPoolError as exc:
        raise UsageError(exc.message) from None
    finally:
        _bring_back_and_release(magics, attachment, "%%gpu cell finished")


def send_along(variables, attachment: Attachment, cell: str) -> None:
    """Send the local names ``cell`` reads that the worker lacks
    (:meth:`.variables.Variables.follow`) before it runs there; an interrupt
    is one UsageError line saying the cell did not run and what was sent."""
    try:
        variables.follow(attachment, cell)
    except TransferInterrupted as exc:
        raise UsageError(f"the cell did not run: sending along {', '.join(exc.names)}: "
                         f"{push_interrupted(exc)}") from None
    except KeyboardInterrupt:
        raise UsageError("interrupted before the cell ran on the worker; nothing was sent") from None


def _bring_back_and_release(magics, attachment: Attachment, reason: str) -> None:
    note, stopped = "", None
    try:
        if attachment.ended is None:
            values, items, errors = attachment.pull(None, max_bytes=magics.release_state_cap)
            magics.variables.take(values, items)
            note = summarize("brought back", items, errors)
    except TransferInterrupted as exc:  # the cell's own lease goes anyway: say that its variables stayed there
        stopped = exc
    finally:
        lease = attachment.release(reason=reason)
    if stopped is not None:
        raise UsageError(f"released {lease.id}; its variables did not come back: {pull_interrupted(stopped)}")
    say(f"released {lease.id}{note}")


def same_size(old) -> LeaseRequest:
    """A request for a slice like lease ``old`` (``%gpu restart``), in its
    environment where a node still offers it."""
    return LeaseRequest(fraction=old.fraction, gpu_count=old.gpu_count, memory=old.memory,
                        idle_timeout=old.idle_timeout, kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"),
                        prefer_env=old.env or kernel_env(), lease_class=old.lease_class,
                        preemptible=old.preemptible or None, on_idle=old.on_idle,
                        # the same ask, not its result: a default share gets the default again
                        cpus=old.requested_cpus, host_memory=old.requested_host_memory)


def kernel_env() -> str | None:
    """The worker environment this kernel prefers: its kernelspec's name
    (GPUPOOL_KERNEL_NAME, set by the kernel provisioner; :func:`gpupool.schema.kernel_environment`)."""
    return kernel_environment(os.environ.get(ENV_KERNEL_NAME))
