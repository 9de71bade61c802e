"""Getting a worker for the notebook: create a lease, wait for its worker
with progress, connect, start forwarding (in the gpupool kernel); a parked
lease's resume in place; the requests ``%gpu restart`` and ``%%gpu`` make.

:class:`Attacher` hands back attachments and never keeps one: which one the
notebook is attached to, :class:`~.lifecycle.Lifecycle` decides.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from IPython.core.error import UsageError

from gpupool.errors import GPUPoolError
from gpupool.leasewait import START_WAIT_S, cancel
from gpupool.leaseargs import option_words
from gpupool.schema import ENV_KERNEL_NAME, kernel_environment
from gpupool.transfer import package_versions, version_mismatches
from gpupool.units import parse_gpu_amount
from gpupool.wire.leases import LeaseRequest
from gpupool.wire.transfer import Attach

from .attachment import Attachment
from .service import Service
from .tell import Tell
from .wait import QueueWait

if TYPE_CHECKING:  # the gpupool kernel's parts, which import IPython's kernel
    from .cell import ForwardedCell
    from .notices import Notices


class Forwarding:
    """The gpupool kernel's side of an attachment: its forwarded ``cell``
    (:class:`~.cell.ForwardedCell`, which relays the worker's IOPub), its
    ``notices`` (:class:`~.notices.Notices`), its ``shell`` (the execution
    count the worker goes on from); none outside the gpupool kernel."""

    def __init__(self, cell: ForwardedCell, notices: Notices, shell, tell: Tell) -> None:
        self.cell, self.notices, self.shell, self.tell = cell, notices, shell, tell

    def start(self, attachment: Attachment) -> None:
        """Hand the worker's IOPub to the kernel's relay, tell the worker this
        notebook's execution count and folder (:func:`join_notebook`), and send
        notices as events. GPUPoolError when the worker does not answer."""
        attachment.remote.relay_iopub(self.cell.publish)
        attachment.heartbeat.notify = functools.partial(self.notices.notify, beat=attachment.heartbeat)
        attachment.heartbeat.on_lease = lambda lease: self.tell()
        join_notebook(attachment, self.shell.execution_count)


def join_notebook(attachment: Attachment, execution_count: int) -> None:
    """Tell the worker this notebook's ``execution_count`` (so prompts, ``Out[n]`` and tracebacks'
    ``Cell In[n]`` agree), folder and home (``~``), which it takes where it can (op ``attach``);
    ``attachment.workdir`` then says where it runs. GPUPoolError when the worker does not answer."""
    user = attachment.lease.owner
    answer, _ = attachment.request(Attach(execution_count=execution_count, cwd=os.getcwd(),
                                          home=os.path.expanduser("~"), user=user))
    cwd = answer.get("cwd")
    attachment.shares_folder = bool(answer.get("notebook_dir"))
    attachment.workdir = (f"the worker runs in this notebook's folder, {cwd}" if answer.get("notebook_dir") else
                          f"the GPU node cannot enter this notebook's folder {os.getcwd()}, so the worker runs "
                          f"in a scratch folder of yours there, {cwd}: copy the files it needs with %gpu push "
                          "or a shared folder")


class Attacher:
    """Leases to attachments, through the ``service``, waiting with ``wait``;
    ``forwarding`` is the gpupool kernel's (None in any other IPython, where
    cells stay local)."""

    def __init__(self, service: Service, wait: QueueWait, tell: Tell, forwarding: Forwarding | None,
                 streams: Callable[[], int] = lambda: 0) -> None:
        self.service, self.wait, self.tell, self.forwarding = service, wait, tell, forwarding
        self.streams = streams  # c.GPUMagics.transfer_streams, read when a transfer starts

    @property
    def forwards(self) -> bool:
        """Whether an attached notebook's cells run on the worker (the gpupool kernel)."""
        return self.forwarding is not None

    def connect(self, request: LeaseRequest, forward: bool = True) -> Attachment:
        """Create a lease for ``request``, wait for its worker (with progress),
        connect and warn about version mismatches. Cancels the lease on any
        failure or interrupt (UsageError when interrupted; GPUPoolError). The
        lease names the JupyterHub server this kernel runs in, so stopping
        that server releases it. ``forward`` (not for a ``%%gpu`` cell's own
        lease, nor a move's new one until the move is done) starts forwarding."""
        started = time.monotonic()
        client = self.service.client
        try:
            lease = client.create_lease(replace(request, server_name=os.environ.get("JUPYTERHUB_SERVER_NAME")),
                                        start_wait=START_WAIT_S)
        except KeyboardInterrupt:  # before the pool answered: no id to cancel
            raise UsageError("interrupted before the pool answered; this kernel holds no lease (one the pool made "
                             "meanwhile hears no heartbeat and is reclaimed within its heartbeat TTL)") from None
        except GPUPoolError as exc:  # a refused option is named as typed: --idle-timeout, not idle_timeout
            raise option_words(exc) from None
        attachment = None
        try:
            lease = self.wait.started(lease, started)
            attachment = Attachment.connect(client, lease)
            attachment.transfer_streams = self.streams
            if forward:
                self.forward(attachment)
        except BaseException as exc:  # interrupted or failed: never leave the slice held
            if attachment is not None:
                attachment.heartbeat.stop()
                attachment.remote.close()
            cancel(client, lease.id)
            self.tell()
            if isinstance(exc, KeyboardInterrupt):  # the user's own doing: one line, not urllib's traceback
                raise UsageError(f"interrupted; the request {lease.id} was cancelled") from None
            raise
        _warn_versions(attachment)
        if not forward:  # the notebook stays as it was
            self.tell()
        return attachment

    def forward(self, attachment: Attachment) -> None:
        """Forward the notebook's cells to ``attachment``'s worker (in the gpupool kernel)."""
        if self.forwarding is not None:
            self.forwarding.start(attachment)

    def resume(self, attachment: Attachment, on_wait=None) -> Attachment:
        """The lease is parked: resume it in place (with progress) before the
        cell runs; the same worker, its variables as they were. ``on_wait(lease)``:
        called once if the resume waits in line for room. Raises
        GPUPoolError (``lease_lost`` when it ended meanwhile)."""
        parked_on = attachment.parked.lease.node if attachment.parked is not None else None
        lease = self.wait.resumed(attachment, on_wait)
        if attachment.reconnected:  # a new worker (spilled, or moved): forward to it now
            self.forward(attachment)
        moved = f" (moved from {parked_on}, which had no room)" if parked_on and parked_on != lease.node else ""
        self.tell("resumed", f"resumed {lease.id} on {lease.node}{moved}")
        return attachment


def _warn_versions(attachment: Attachment) -> None:
    try:
        mismatches = version_mismatches(package_versions(), attachment.versions())
    except GPUPoolError as exc:
        print(f"gpupool: could not compare package versions with the worker: {exc.message}", file=sys.stderr)
        return
    if mismatches:
        print("gpupool: warning: versions differ, values of these may fail to move between this kernel and "
              "the worker: " + "; ".join(mismatches), file=sys.stderr, flush=True)


def own_lease_request(amount: str) -> LeaseRequest:
    """What ``%%gpu AMOUNT`` asks for while detached; UsageError for a bad amount, or for options."""
    if len(amount.split()) > 1:
        raise UsageError(f"%%gpu takes an amount only (it was given {amount!r}); for options, %gpu acquire AMOUNT "
                         "--memory ... attaches, %%local runs a cell here, and %gpu release detaches")
    try:
        fraction, count = parse_gpu_amount(amount)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return LeaseRequest(fraction=fraction, gpu_count=count, kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"),
                        prefer_env=kernel_env())


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
