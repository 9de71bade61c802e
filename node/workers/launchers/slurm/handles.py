"""How the agent watches, parks and stops a worker that runs in Slurm: the
worker code's process and cgroup contracts (:class:`~...process.WorkerProcess`,
:class:`~....cgroups.LeaseCgroup`) over the worker's job or step.

The kernel runs on the agent's node (its job's), so its process is watched
there through psutil, with no Slurm call per heartbeat (docs/launchers.md,
"Liveness"). Once it is gone, Slurm is asked why
(:meth:`.launcher.SlurmLauncher.ended`), and the worker counts as exited
when the words are known, so the service ends the lease with them. Slurm's
own cgroup holds the job's processes, its ``--cpus-per-task`` and ``--mem``;
a kill is ``scancel``; a park is Slurm's: ``scontrol suspend`` of a lease
job (its GPUs stay held in Slurm), SIGSTOP of a slice's step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Iterable

import psutil

from ....cgroups import CgroupError, LeaseCgroup
from ...process import AdoptedProcess, kill_all, running
from . import tasks
from .commands import SlurmError
from .launcher import END_LINE_WAIT_S, SlurmLauncher
from .record import SlurmWorkerRecord

#: Seconds between two looks at whether the kernel's process still runs.
WATCH_S = 0.5


class SlurmJobProcess(AdoptedProcess):
    """The kernel of a worker that Slurm started (``record``'s job or step):
    not the agent's child, so watched as an adopted process is (psutil, its
    start time checked), and stopped through Slurm. Its exit code stays
    unknown; :attr:`exit_note` is Slurm's words for its end."""

    def __init__(self, launcher: SlurmLauncher, record: SlurmWorkerRecord, kernel: psutil.Process,
                 log: logging.Logger) -> None:
        super().__init__(kernel, kernel.create_time())
        self.launcher = launcher
        self.record = record
        self.log = log
        self._words: str | None = None
        self._watch = asyncio.get_running_loop().create_task(self._watch_end())

    @property
    def exit_note(self) -> str | None:  # type: ignore[override]
        """Why the worker ended, in Slurm's words; None while it runs."""
        return self._words

    def exited(self) -> bool:
        return self._words is not None

    def wait(self, timeout: float | None = None) -> None:
        if self._words is None:
            super().wait(timeout)

    def kill_group(self, contained: bool) -> None:
        """Nothing: Slurm's cgroup holds what the kernel started (:meth:`SlurmJobGroup.kill`)."""

    def kill(self, children: Iterable[psutil.Process], timeout: float) -> list[int]:
        self._watch.cancel()
        return kill_all([self.proc, *children], timeout)

    async def shutdown(self, manager: Any, grace: float) -> None:
        """Ask the kernel to exit, then end its job or step in Slurm (its
        share job too once no slice is left in it): ``scancel``, waited for."""
        try:
            await super().shutdown(manager, grace)
        finally:
            self._watch.cancel()
            await self.launcher.stop(self.record)

    async def _watch_end(self) -> None:
        """Wait until the kernel's process is gone, then learn from Slurm why."""
        while running(self.proc):
            await asyncio.sleep(WATCH_S)
        deadline = time.monotonic() + END_LINE_WAIT_S
        words = None
        while words is None and time.monotonic() < deadline:
            try:
                words = await self.launcher.ended(self.record)
            except SlurmError as exc:
                self.log.warning("could not ask Slurm how job %s ended: %s", self.record.ident, exc)
            if words is None:  # Slurm still lists it running (COMPLETING): ask again
                await asyncio.sleep(WATCH_S)
        self._words = words or (f"the worker's Slurm job {self.record.ident} ended (its kernel exited; Slurm "
                                "said nothing of why)")


class SlurmJobGroup(LeaseCgroup):
    """Where a Slurm worker's processes live: its job's (or step's) cgroup,
    Slurm's own. ``kernel``: the kernel's process, whose tree is what the
    agent sees of it on this node (GPU memory is accounted to those pids).
    ``task_root``: the agent's folder in the v1 pids hierarchy
    (:meth:`~....cgroups.Containment.task_root`), where the worker's task
    limit goes when Slurm's cgroup has no pids controller (:mod:`.tasks`)."""

    kind = "slurm"
    confines = True
    freeze_method = ("Slurm: scontrol suspend of the lease's job (its GPUs stay held in Slurm), or SIGSTOP of "
                     "its slice's step (scancel --signal=STOP; proctrack/cgroup freezes the step)")

    def __init__(self, name: str, launcher: SlurmLauncher, record: SlurmWorkerRecord,
                 kernel: psutil.Process, task_root: Path | None = None) -> None:
        super().__init__(name)
        self.launcher = launcher
        self.record = record
        self.kernel = kernel
        self._own_tasks = None if task_root is None else task_root / name
        self._frozen = False

    def add(self, pid: int) -> None:
        """Nothing: Slurm put the kernel in its job's cgroup before it ran."""

    def pids(self) -> set[int]:
        return {proc.pid for proc in self._tree()}

    def _tree(self) -> list[psutil.Process]:
        if not running(self.kernel):
            return []
        try:
            return [self.kernel, *self.kernel.children(recursive=True)]
        except psutil.Error:
            return []

    def kill(self, timeout: float = 10.0) -> list[int]:
        """``scancel`` the job (a slice: its step); Slurm kills every process
        of its cgroup. Returns the kernel-tree pids still alive after ``timeout``."""
        tree = self._tree()
        try:
            self.launcher.commands.cancel_blocking(self.record.job_id, self.record.step_id)
        except SlurmError as exc:
            raise CgroupError(f"could not cancel Slurm job {self.record.ident}: {exc}") from None
        deadline = time.monotonic() + timeout
        alive = [proc for proc in tree if running(proc)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [proc for proc in alive if running(proc)]
        return [proc.pid for proc in alive]

    def remove(self) -> None:
        """Slurm removes its job's cgroup; the agent's task cgroup goes here."""
        tasks.release(self._own_tasks)

    def set_limits(self, cpu: float | None = None, memory: int | None = None, pids: int | None = None) -> None:
        """CPU and memory: nothing, the job was submitted with the lease's
        ``--cpus-per-task`` and ``--mem``, which Slurm's cgroup holds
        (task/cgroup). ``pids``: :func:`.tasks.limit` (CgroupError where it cannot)."""
        if pids is not None:
            tasks.limit(self.kernel, self.record.job_id, self.record.step_id, pids, self._own_tasks)

    @property
    def frozen_keeps_gpu(self) -> str | None:
        """A lease job's GRES stay allocated while Slurm suspends it (measured: a pending
        ``--gres=gpu:1`` job kept waiting), so its park goes to disk, which ends the job; a
        slice's step frees its share of gpupool's share job."""
        if self.record.step_id is not None:
            return None
        return (f"Slurm keeps the GPU of a suspended job, so job {self.record.job_id} ends instead, its GPU back in "
                "Slurm")

    def freeze(self, timeout: float = 10.0) -> None:
        try:
            self._hold(True)
        except SlurmError as exc:
            raise CgroupError(f"Slurm did not suspend job {self.record.ident}: {exc}") from None
        self._frozen = True

    def thaw(self) -> None:
        try:
            self._hold(False)
        except SlurmError as exc:
            if "not suspended" not in str(exc):
                raise CgroupError(f"Slurm did not resume job {self.record.ident}: {exc}") from None
        self._frozen = False

    def _hold(self, stop: bool) -> None:
        """Suspend (``stop``) or resume the lease job; SIGSTOP or SIGCONT a slice's step. SlurmError."""
        record, commands = self.record, self.launcher.commands
        if record.step_id is None:
            commands.run_blocking("scontrol", "suspend" if stop else "resume", str(record.job_id))
        else:
            commands.cancel_blocking(record.job_id, record.step_id, signal="STOP" if stop else "CONT")

    def frozen(self) -> bool:
        return self._frozen

    def frozen_by_slurm(self) -> None:
        """Slurm says the job is suspended (a parked lease's, found after an agent restart)."""
        self._frozen = True


def kernel_process(pids: Iterable[int], connection_file: str) -> psutil.Process | None:
    """Among ``pids`` (a job's or step's, ``scontrol listpids``), the kernel:
    the process whose command line names ``connection_file``; None when none does."""
    for pid in sorted(pids):
        try:
            proc = psutil.Process(pid)
            if connection_file in proc.cmdline():
                return proc
        except psutil.Error:
            continue
    return None


def launched_with(connection_file: str) -> list[psutil.Process]:
    """The live processes of this node whose command line names
    ``connection_file``: a worker's kernel, and a slice's srun (which runs it)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if connection_file in (proc.info["cmdline"] or ()) and running(proc):
                found.append(proc)
        except psutil.Error:
            continue
    return found
