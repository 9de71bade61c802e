"""The worker launcher contract: how a node starts the worker of a lease (cold)
or one kept ahead of any lease (warm), and finds its workers again after a
restart (adopt, sweep).

:class:`~..manager.WorkerManager` makes one launcher per node, of the class
``c.AgentWorkers.worker_launcher`` names (:mod:`.factory`), and calls only
:meth:`WorkerLauncher.cold`, :meth:`WorkerLauncher.warm`, once at start
(through :mod:`..recovery`) :meth:`WorkerLauncher.adopt` per record and
:meth:`WorkerLauncher.sweep`, then :meth:`WorkerLauncher.prepare`, and once
at the end :meth:`WorkerLauncher.close`. The stock one, ``local``
(:class:`~.local.LocalLauncher`), starts an ipykernel process on the agent's
host; ``slurm`` and ``kubernetes`` run Slurm jobs and pods. This is the seam
where another launcher plugs in: its :class:`~..handle.Worker` carries a
:class:`~..process.WorkerProcess` and a :class:`~...cgroups.LeaseCgroup` of
its own kind, which the rest of the worker code watches, parks and stops
without asking which kind it is.
"""

from __future__ import annotations

import asyncio
import logging
import os
from abc import ABC, abstractmethod
from queue import Empty
from typing import Any

from gpupool.errors import GPUPoolError, Reason

from ...activity import watch_iopub
from ...cgroups import Containment
from ..accounts import WorkerAccounts
from ..handle import Worker
from ..kernel import KernelManagers
from ..records import WorkerRecord
from ..spec import WorkerLaunch, WorkerSpec, WorkerStartError
from ..stopping import Reaper, quietly


class WorkerLauncher(ABC):
    """Starts the workers of one node as ``settings`` says, as the accounts
    of ``accounts``, in cgroups of ``cgroups``, with kernel managers of
    ``kernels``; ``reaper`` stops what a failed start left. A subclass that
    overrides ``__init__`` takes the same arguments and calls ``super()``.

    Both methods run on the agent's event loop, concurrently for different
    workers, and return a :class:`~..handle.Worker` that answered
    ``kernel_info`` (its ``activity`` marked ready, its IOPub watched). Both
    raise :class:`~..spec.WorkerStartError`, with words for the service's
    report, when the worker does not come up; nothing they started is left
    running then.
    """

    #: Whether :meth:`warm` can start workers ahead of any lease (False: the agent keeps no warm pool).
    keeps_warm = True
    #: Why this launcher cannot run workers as other accounts (``c.AgentWorkers.worker_user``); None: it can.
    accounts_refusal: str | None = None

    def __init__(self, settings: WorkerLaunch, accounts: WorkerAccounts, cgroups: Containment,
                 kernels: KernelManagers, reaper: Reaper, log: logging.Logger) -> None:
        self.settings = settings
        self.accounts = accounts
        self.cgroups = cgroups
        self.kernels = kernels
        self.reaper = reaper
        self.log = log

    def where(self) -> str:
        """Where this launcher runs workers, in a few words for the agent's start log beside its
        name (``Slurm node gpu-07``); empty (the default): on the agent's host."""
        return ""

    @abstractmethod
    async def cold(self, spec: WorkerSpec) -> Worker:
        """Start the worker of ``spec`` (its ``spec`` set), its slice's
        environment (``settings.enforcement``) set from the start."""

    @abstractmethod
    async def warm(self) -> Worker:
        """Start one warm worker (``spec`` None): no GPU visible,
        ``settings.warm.preload`` imported; :mod:`..binding` binds it to a
        lease later."""

    @classmethod
    def check_settings(cls, config: Any, separate_accounts: bool, log: logging.Logger) -> None:
        """Called once as the agent starts, before it makes anything (state folder, cgroups), with
        the agent's traitlets ``config``; ``separate_accounts``: workers are to run as other accounts
        (``c.AgentWorkers.worker_user`` or ``worker_users`` set). Raises GPUPoolError, in one line that
        names the setting, for settings this launcher can never work with, or when what it starts
        workers in cannot be asked at all (the agent then refuses to start, exit 1, instead of
        registering and failing every lease). Default: worker accounts where :attr:`accounts_refusal`
        says this launcher has none; subclasses add their own checks."""
        if separate_accounts and cls.accounts_refusal is not None:
            raise GPUPoolError(Reason.not_configured, cls.accounts_refusal + "; drop --worker-user")

    def refuse_accounts(self, spec: WorkerSpec) -> None:
        """WorkerStartError when ``spec`` (or the agent's settings) asks for a worker account
        this launcher cannot run workers as (refused at start already: :meth:`check_settings`)."""
        if self.accounts_refusal is not None and (spec.user is not None or self.accounts.others):
            raise WorkerStartError(self.accounts_refusal)

    @classmethod
    def host_totals(cls, config: Any, log: logging.Logger) -> tuple[float, int] | None:
        """``(cores, bytes)`` the node has for workers where the launcher
        knows better than this host's own count (``config``: the agent's);
        None (the default): this host's."""
        return None

    @abstractmethod
    async def adopt(self, record: WorkerRecord, spec: WorkerSpec) -> Worker | None:
        """After an agent restart: the worker of ``record`` (``spec``: its
        slice) if it still runs and is the lease's, else None.

        Called by :mod:`..recovery` once per record an earlier run left,
        before :meth:`sweep` and any start. The record's ``launcher`` is the
        state the launcher put in ``Worker.launcher_state`` (None: the
        ``local`` launcher's); a record of another kind is not this
        launcher's worker: None. The worker returned has no IOPub watch yet
        (recovery checks that it answers and watches it); one that does not
        answer is dropped, and :meth:`sweep` ends it. Logs why it returns
        None where that is not plain (its job or pod ended); raises nothing
        for a worker that is gone or a record it cannot read."""

    @abstractmethod
    async def sweep(self, kept: list[Worker]) -> None:
        """Called once, as the agent starts, after :mod:`..recovery`
        re-adopted ``kept``, before the files of the others are removed
        and :meth:`prepare`: end what an earlier run of the agent started that
        ``kept`` does not hold (warm workers, workers of no record, or that
        did not answer, what dead workers' cells left). Logs what it ended and
        what it could not; raises nothing."""

    async def prepare(self) -> None:
        """Called once as the agent starts, after :meth:`sweep`: start what
        makes later starts fast (default: nothing)."""

    async def close(self) -> None:
        """Called once as the agent stops, after every worker was stopped:
        end what :meth:`prepare` started (default: nothing). Workers a
        launcher started must not depend on it."""

    async def ready(self, worker: Worker) -> None:
        """Watch ``worker``'s IOPub and wait until it answers ``kernel_info``
        and the watch's subscription is confirmed (``settings.start_timeout``
        for both); else stop it and raise WorkerStartError with the reason."""
        manager = worker.manager
        # Subscribed before the kernel_info round trip, and confirmed (ipykernel's
        # iopub_welcome) before the worker is handed out, so the first cell's
        # status messages cannot be missed.
        subscribed = asyncio.Event()
        worker.watcher = asyncio.create_task(
            watch_iopub(worker, manager.get_connection_info(), self.kernels.context, self.log, ready=subscribed))
        try:
            await asyncio.wait_for(_answered(worker, subscribed), self.settings.start_timeout)
        except Exception as exc:
            reason = _start_failure(exc, worker, self.settings.start_timeout)
            await quietly(self.reaper.terminate(worker))
            raise WorkerStartError(reason) from None
        if manager.owner is not None:
            # Read: take the key back from the worker user, whom every worker shares.
            os.chown(manager.connection_file, os.getuid(), os.getgid())
        worker.activity.mark_ready()


#: Seconds between two looks at whether a starting worker died.
START_POLL_S = 0.1


async def _answered(worker: Worker, subscribed: asyncio.Event) -> None:
    """Once ``worker`` answered one ``kernel_info`` and ``subscribed`` is
    set. Not jupyter_client's ``wait_for_ready``: that also waits until its
    own client's IOPub gets a message, 0.2 s a try, which is most of a
    forked worker's start. RuntimeError when the worker dies first."""
    client = worker.manager.client()
    client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    try:
        msg_id = client.kernel_info()  # queued by ZeroMQ until the kernel has bound its shell socket
        while True:
            try:
                reply = await client.get_shell_msg(timeout=START_POLL_S)
            except Empty:
                if worker.process.exited():
                    raise RuntimeError("it exited") from None
                continue
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        while not subscribed.is_set():
            if worker.process.exited():
                raise RuntimeError("it exited")
            try:
                await asyncio.wait_for(subscribed.wait(), START_POLL_S)
            except asyncio.TimeoutError:
                continue
    finally:
        client.stop_channels()


def _start_failure(exc: BaseException, worker: Worker, timeout: float) -> str:
    code = worker.process.poll()
    if code is not None:
        why = f"it exited with code {code}"
    elif isinstance(exc, asyncio.TimeoutError):
        why = f"it did not answer kernel_info within {timeout:g} s (c.AgentWorkers.worker_start_timeout)"
    else:
        why = f"{exc or type(exc).__name__}"
    tail = worker.log_tail()
    return f"the worker for {worker.name} did not start: {why}" + (f"; its output ends with:\n{tail}" if tail else "")
