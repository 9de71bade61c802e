"""Share jobs: the whole GPUs gpupool holds in Slurm for its slices.

A share job is a batch job of ``--gres=gpu:1`` (plus the CPUs and memory its
slices' steps divide) whose script only waits; each slice's worker runs in
it as a step (:func:`~.request.slice_step`). Slurm sees the GPU as taken for
as long as a share job holds it, so no batch job gets it meanwhile; gpupool's
enforcement divides it among the slices, as on a local node. A share job is
found again by its name (:func:`~.request.share_name`, the node's) and its
comment (:data:`~.request.SHARE_COMMENT`), and is cancelled once its last
step is gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from .commands import SlurmCommands, SlurmError
from .request import SHARE_COMMENT, JobSettings, share_job, share_name
from .state import SlurmJob

#: Seconds between two looks at a job that is waiting to start.
POLL_S = 0.25


class ShareJobs:
    """The share jobs of one node: submitted through ``commands`` as
    ``settings`` says, each with ``cpus`` CPUs and ``memory`` bytes for its
    steps, its output under ``log_dir``; ``start_timeout`` seconds for Slurm
    to start one."""

    def __init__(self, commands: SlurmCommands, settings: JobSettings, cpus: int, memory: int, log_dir: Path,
                 start_timeout: float, log: logging.Logger) -> None:
        self.commands = commands
        self.settings = settings
        self.cpus = cpus
        self.memory = memory
        self.log_dir = log_dir
        self.start_timeout = start_timeout
        self.log = log
        self._lock = asyncio.Lock()

    async def running(self) -> list[SlurmJob]:
        """The node's share jobs that run now (found by name and comment)."""
        found = []
        for job_id in await self.commands.find(share_name(self.settings)):
            job = await self.commands.job(job_id)
            if job is not None and job.running and job.comment == SHARE_COMMENT:
                found.append(job)
        return found

    async def for_gpu(self, index: int | None, env: dict[str, str]) -> SlurmJob:
        """A running share job on device ``index`` (None: any), started when
        none holds it. Slurm picks the device of a new one: the job returned
        may hold another than ``index`` (docs/launchers.md, "Which GPU").
        SlurmError when Slurm does not start it within ``start_timeout``."""
        async with self._lock:
            for job in await self.running():
                if index is None or index in job.gpus:
                    return job
            log_path = self.log_dir / f"share-{time.time_ns()}.log"
            submission = share_job(self.settings, self.cpus, self.memory, str(log_path), str(self.log_dir))
            job_id = await self.commands.submit(submission, env)
            self.log.info("submitted share job %s (one GPU for slices) on %s", job_id, self.settings.node)
            return await wait_running(self.commands, job_id, self.start_timeout)

    async def release_if_empty(self, job_id: int) -> bool:
        """Cancel share job ``job_id`` when no step runs in it; True when it did."""
        async with self._lock:
            if await self.commands.steps(job_id):
                return False
            await self.commands.cancel(job_id)
            self.log.info("cancelled share job %s: its last slice is gone", job_id)
            return True


async def wait_running(commands: SlurmCommands, job_id: int, timeout: float) -> SlurmJob:
    """Wait until job ``job_id`` runs; returns it. When it ends first, or
    still waits after ``timeout`` seconds (then it is cancelled), SlurmError
    in words: Slurm's state and reason (Resources, Priority, QOSMaxGRESPerUser...)."""
    deadline = time.monotonic() + timeout
    job = None
    while time.monotonic() < deadline:
        job = await commands.job(job_id)
        if job is None:
            raise SlurmError(f"Slurm forgot job {job_id} before it started")
        if job.running:
            return job
        if job.ended:
            raise SlurmError(f"Slurm job {job_id} ended before it started: {job.state}"
                             + (f" ({job.reason})" if job.reason else ""))
        await asyncio.sleep(POLL_S)
    await commands.cancel(job_id)
    state = f"{job.state}, reason {job.reason}" if job is not None and job.reason else (job.state if job else "unknown")
    raise SlurmError(f"Slurm did not start job {job_id} within {timeout:g} s ({state}); it was cancelled "
                     "(c.SlurmLauncher.start_timeout, or free the node's GPUs)")
