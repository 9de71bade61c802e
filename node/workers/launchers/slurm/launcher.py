"""``SlurmLauncher``: the settings of workers that run as Slurm jobs, and the
Slurm side of a worker's life (start, read, stop, park, re-adopt, the words
of its end).

``c.SlurmLauncher.partition = "gpu"`` and the others below are read from the
agent's config file (a traitlets ``Configurable``). The agent's worker code
reaches it through :mod:`.workers` (``c.AgentWorkers.worker_launcher = "slurm"``).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from traitlets import Enum, Integer, List, Unicode, default, validate
from traitlets.config import LoggingConfigurable

from gpupool.kernelcmd import WORKER_EXTENSION, WORKER_KERNEL_APP
from gpupool.traits import ByteSize, Duration

from ...kernel import kernel_arguments
from ..resources import LeaseResources

from .commands import SlurmCommands, SlurmError
from .record import SlurmWorkerRecord
from .request import (COMMENT_PREFIX, JobSettings, check_extra_args, check_time_limit, is_slice,
                      job_name, lease_job, slice_step)
from .shares import POLL_S, ShareJobs, wait_running
from .state import SRUN_STEP_ABORTED, SlurmJob, SlurmStep, end_line, end_reason, out_of_memory

#: Seconds to wait for slurmstepd's end line in the logs of a job or step Slurm no longer knows
#: (5 s was not enough on a loaded 2-core host; the wait ends once the line is there, or once srun
#: exits saying the worker's task exited by itself).
END_LINE_WAIT_S = 30.0
#: What srun writes when the step's task exits by itself (``srun: error: NODE: task 0: Exited with exit
#: code 3``), not when Slurm ends the step (then ``task 0: Killed`` or ``Terminated``).
SRUN_TASK_EXITED = "Exited with exit code"


class SlurmLauncher(LoggingConfigurable):
    """Workers as Slurm jobs on the agent's node: a lease's whole GPUs as a
    job of its own (``--gres=gpu:N``), a slice as a step of a share job that
    holds its GPU (:mod:`.shares`). All methods run on the agent's event loop."""

    node = Unicode(
        "", help="""This node's name in Slurm (``--nodelist`` of every job). Default: the host's short name,
        as slurmd names its node. ``c.SlurmLauncher.node = "gpu-node-07"``.""",
    ).tag(config=True)

    @default("node")
    def _default_node(self) -> str:
        return socket.gethostname().split(".")[0]

    partition = Unicode(
        "", help="""Slurm partition of the workers' jobs (empty, the default: the cluster's default partition).
        ``c.SlurmLauncher.partition = "gpu"``.""",
    ).tag(config=True)

    account = Unicode(
        "", help="""Slurm account the workers' jobs are charged to (empty, the default: the submitting user's
        default account). ``c.SlurmLauncher.account = "jupyter"``.""",
    ).tag(config=True)

    qos = Unicode(
        "", help="""Slurm QOS of the workers' jobs (empty, the default: the account's default).
        ``c.SlurmLauncher.qos = "interactive"``.""",
    ).tag(config=True)

    time_limit = Unicode(
        "", help="""Time limit of each worker's job, in Slurm's format (minutes, ``HH:MM:SS``,
        ``D-HH:MM:SS`` or ``UNLIMITED``; empty, the default: the partition's). When Slurm ends a job at its
        limit, the lease ends with those words. A slice is a step of a share job, so it gets what is left
        of that job's limit (docs/launchers.md). ``c.SlurmLauncher.time_limit = "7-00:00:00"``.""",
    ).tag(config=True)

    @validate("time_limit")
    def _time_limit_valid(self, proposal: Any) -> str:
        return _checked(check_time_limit, proposal)

    extra_args = List(
        Unicode(), help="""More sbatch options for every worker's job, each one long option (default none); not
        those gpupool sets itself (--gres, --mem, --job-name...). ``c.SlurmLauncher.extra_args =
        ["--constraint=a100", "--reservation=jupyter"]``.""",
    ).tag(config=True)

    @validate("extra_args")
    def _extra_args_valid(self, proposal: Any) -> list[str]:
        return list(_checked(check_extra_args, proposal))

    name_prefix = Unicode(
        "gpupool-", help="""Prefix of the workers' job names; the lease id follows (default ``gpupool-``).
        ``c.SlurmLauncher.name_prefix = "jupyter-gpu-"``.""",
    ).tag(config=True)

    slice_gres = Enum(
        ("gpu", "shard"), default_value="gpu", help="""How a slice holds its GPU in Slurm. ``gpu`` (default): a
        share job holds the whole GPU (``--gres=gpu:1``) and each slice's worker is a step in it, divided by
        gpupool's enforcement; no batch job can get that GPU. ``shard``: each slice is a job of its own with
        ``--gres=shard:K`` (K = fraction x shards_per_gpu); only where Slurm keeps shards and whole-GPU jobs
        apart, which 22.05 does not (docs/launchers.md). ``c.SlurmLauncher.slice_gres = "gpu"``.""",
    ).tag(config=True)

    shards_per_gpu = Integer(
        8, min=1, help="""Shards per GPU in the site's gres.conf (``Name=shard Count=N`` per GPU), for
        ``slice_gres = "shard"`` (default 8). ``c.SlurmLauncher.shards_per_gpu = 8``.""",
    ).tag(config=True)

    share_cpus = Integer(
        0, min=0, help="""CPUs each share job holds for the steps of its slices (0, the default: the node's
        CPUs divided by its GPUs, from scontrol). ``c.SlurmLauncher.share_cpus = 16``.""",
    ).tag(config=True)

    share_memory = ByteSize(
        None, allow_none=True, help="""Memory each share job holds for the steps of its slices, bytes or a
        string like ``"64GiB"`` (None, the default: the node's RealMemory divided by its GPUs).
        ``c.SlurmLauncher.share_memory = "64GiB"``.""",
    ).tag(config=True)

    slurm_conf = Unicode(
        "", help="""The site's slurm.conf for Slurm's commands (SLURM_CONF; empty, the default: Slurm's own
        default or the agent's SLURM_CONF). ``c.SlurmLauncher.slurm_conf = "/etc/slurm/slurm.conf"``.""",
    ).tag(config=True)

    bin_dir = Unicode(
        "", help="""Folder of Slurm's commands (sbatch, srun, scontrol, squeue, scancel; empty, the default:
        PATH). ``c.SlurmLauncher.bin_dir = "/opt/slurm/bin"``.""",
    ).tag(config=True)

    command_timeout = Duration(
        30.0, help="""Seconds (or ``"1m"``) one Slurm command may take before it counts as failed
        (default 30). ``c.SlurmLauncher.command_timeout = "1m"``.""",
    ).tag(config=True)

    start_timeout = Duration(
        60.0, help="""Seconds (or ``"5m"``) Slurm may keep a worker's job pending before its start fails and
        the job is cancelled, with Slurm's reason (default 60). Keep the service's
        ``c.PoolNodes.worker_start_timeout`` (90 s) above it, or the service gives up first and the reason
        is lost. ``c.SlurmLauncher.start_timeout = "5m"``.""",
    ).tag(config=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.commands = SlurmCommands(self.slurm_conf, self.bin_dir, self.command_timeout)
        self._shares: ShareJobs | None = None
        # The srun of each slice this agent started, by lease: reaped when its step ends. A restarted agent
        # has none: init reaps the sruns of the steps it re-adopts.
        self._sruns: dict[str, subprocess.Popen] = {}

    def job_settings(self) -> JobSettings:
        """The pure settings of :mod:`.request`. ValueError for a bad combination."""
        return JobSettings(node=self.node, partition=self.partition, account=self.account, qos=self.qos,
                           time_limit=self.time_limit, extra_args=tuple(self.extra_args), name_prefix=self.name_prefix,
                           slice_gres=self.slice_gres, shards_per_gpu=self.shards_per_gpu)

    async def shares(self, log_dir: Path) -> ShareJobs:
        """The node's share jobs (sized from ``share_cpus``/``share_memory``, else from scontrol's node)."""
        if self._shares is None:
            cpus, memory = self.share_cpus, self.share_memory
            if not cpus or not memory:
                node = await self.commands.node(self.node)
                gpus = max(1, _gpu_count(node.get("Gres", "")))
                cpus = cpus or max(1, int(node.get("CPUTot", "1")) // gpus)
                memory = memory or max(2**20, int(node.get("RealMemory", "1")) * 2**20 // gpus)
            self._shares = ShareJobs(self.commands, self.job_settings(), cpus, memory, log_dir, self.start_timeout,
                                     self.log)
        return self._shares

    # -- start -----------------------------------------------------------------------------------------------

    async def start(self, lease: LeaseResources, command: Sequence[str], connection_file: Path, log_path: Path,
                    workdir: str, env: Mapping[str, str], gpu_index: int | None = None) -> SlurmWorkerRecord:
        """Start ``lease``'s worker (``command``: the kernel's command line,
        which reads ``connection_file``) in Slurm and wait until its job (or
        step) runs; returns its record. ``env``: the worker's environment
        (:func:`~.request.job_environment` leaves out what Slurm sets);
        ``gpu_index``: the device a slice was placed on (its share job's, if
        one holds it). The kernel's own readiness (``kernel_info``) is the
        caller's to wait for. SlurmError in words; nothing is left running then."""
        settings = self.job_settings()
        if is_slice(lease) and settings.slice_gres == "gpu":
            return await self._start_step(lease, settings, command, connection_file, log_path, workdir, env,
                                          gpu_index)
        submission = lease_job(lease, settings, command, str(log_path), workdir)
        job_id = await self.commands.submit(submission, env)
        self.log.info("lease %s: Slurm job %s submitted (%s)", lease.lease_id, job_id,
                      " ".join(a for a in submission.args if a.startswith("--gres")))
        job = await wait_running(self.commands, job_id, self.start_timeout)
        return SlurmWorkerRecord(lease.lease_id, job_id, job.name, str(log_path), str(connection_file), None, job.gpus)

    async def _start_step(self, lease: LeaseResources, settings: JobSettings, command: Sequence[str],
                          connection_file: Path, log_path: Path, workdir: str, env: Mapping[str, str],
                          gpu_index: int | None) -> SlurmWorkerRecord:
        shares = await self.shares(log_path.parent)
        share = await shares.for_gpu(gpu_index, dict(env))
        name = job_name(settings, lease.lease_id)
        srun = self.commands.start_step(slice_step(share.job_id, lease, settings, command, str(log_path), workdir),
                                        env, log_path.with_suffix(".srun.log"))
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            step = next((s for s in await self.commands.steps(share.job_id) if s.name == name), None)
            if step is not None:
                self._sruns[lease.lease_id] = srun
                step_id = int(step.step_id.rpartition(".")[2])
                self.log.info("lease %s: step %s of share job %s (GPU %s)", lease.lease_id, step.step_id,
                              share.job_id, ",".join(map(str, share.gpus)))
                return SlurmWorkerRecord(lease.lease_id, share.job_id, name, str(log_path), str(connection_file),
                                         step_id, share.gpus)
            if srun.poll() is not None:
                break
            await asyncio.sleep(POLL_S)
        srun.kill()
        await asyncio.to_thread(srun.wait)
        await shares.release_if_empty(share.job_id)
        said = _tail(log_path.with_suffix(".srun.log"))
        raise SlurmError(f"Slurm did not start the step of lease {lease.lease_id} in share job {share.job_id}"
                         + (f": {said}" if said else f" within {self.start_timeout:g} s"))

    # -- while it runs ---------------------------------------------------------------------------------------

    async def read(self, record: SlurmWorkerRecord) -> SlurmJob | SlurmStep | None:
        """The worker's job (or step) as Slurm knows it now; None when Slurm
        does not know it, or knows another job under its id (its name differs)."""
        if record.step_id is not None:
            step = await self.commands.step(record.job_id, record.step_id)
            return step if step is not None and step.name == record.name else None
        job = await self.commands.job(record.job_id)
        return job if job is not None and job.name == record.name else None

    async def adopt(self, record: SlurmWorkerRecord) -> SlurmJob | SlurmStep | None:
        """After an agent restart: the worker's job or step if it still runs
        (or is suspended) under the recorded name; None when it ended or is
        not the lease's (same id, another name; for a job, another comment)."""
        found = await self.read(record)
        if isinstance(found, SlurmJob):
            if found.comment != f"{COMMENT_PREFIX}{record.lease_id}" or found.state not in ("RUNNING", "SUSPENDED"):
                return None
        elif found is not None and found.state not in ("RUNNING", "SUSPENDED"):
            return None
        return found

    async def ended(self, record: SlurmWorkerRecord) -> str | None:
        """None while the worker's job (or step) runs; else why Slurm ended
        it, in words (:func:`~.state.end_reason`, from its state and its log)."""
        found = await self.read(record)
        if isinstance(found, SlurmJob) and not found.ended:
            return None
        if isinstance(found, SlurmStep):
            return None
        job = found if isinstance(found, SlurmJob) else None
        output = self._output(record)
        deadline = time.monotonic() + END_LINE_WAIT_S
        # A step slurmctld no longer lists may not have its slurmstepd line in a log yet (a busy host;
        # slurmstepd may write it after srun exits): wait for it up to the deadline, unless its srun
        # exited with the worker's task (code 0, or saying it exited) and Slurm did not abort the step,
        # or slurmstepd said it killed a task for memory: then no line comes.
        srun = self._sruns.get(record.lease_id)
        while job is None and end_line(output) is None and not out_of_memory(output) \
                and time.monotonic() < deadline:
            if srun is not None and srun.poll() is not None and not _aborted(output, srun.returncode):
                output = self._output(record)  # what srun wrote before it exited
                break
            await asyncio.sleep(POLL_S)
            output = self._output(record)
        return end_reason(record.ident, job, output)

    def srun_pids(self, lease_id: str) -> set[int]:
        """The pid of the srun this launcher started for ``lease_id``'s step (empty: none, a lease job)."""
        srun = self._sruns.get(lease_id)
        return {srun.pid} if srun is not None else set()

    @staticmethod
    def _output(record: SlurmWorkerRecord) -> str:
        """What the worker's job or step and its srun wrote: slurmstepd's end line may be in either."""
        return _read(record.log_path) + "\n" + _read(str(Path(record.log_path).with_suffix(".srun.log")))

    async def left_behind(self) -> list[int]:
        """Ids of the jobs on this node named with :attr:`name_prefix` (lease
        and share jobs of an agent of this node), in any state Slurm still lists."""
        out = await self.commands.run("squeue", "--noheader", f"--nodelist={self.node}", "--format=%i|%j")
        return sorted(int(ident) for ident, _, name in (line.partition("|") for line in out.split())
                      if ident.isdigit() and name.startswith(self.name_prefix))

    # -- park and stop ---------------------------------------------------------------------------------------

    async def park(self, record: SlurmWorkerRecord) -> None:
        """Stop the worker's processes where they are: a lease job is
        suspended (``scontrol suspend``: its GPUs and memory stay held in
        Slurm, its CPUs go to other jobs); a slice's step gets SIGSTOP
        (``scancel --signal=STOP``; proctrack/cgroup freezes its cgroup)."""
        if record.step_id is None:
            await self.commands.suspend(record.job_id)
        else:
            await self.commands.cancel(record.job_id, record.step_id, signal="STOP")

    async def unpark(self, record: SlurmWorkerRecord) -> None:
        """Undo :meth:`park`."""
        if record.step_id is None:
            await self.commands.resume(record.job_id)
        else:
            await self.commands.cancel(record.job_id, record.step_id, signal="CONT")

    async def stop(self, record: SlurmWorkerRecord, log_dir: Path | None = None) -> None:
        """``scancel`` the worker's job (or step; its share job too once no
        other step runs in it) and wait until Slurm says it ended. Slurm kills
        every process of it (its cgroup); SlurmError when that takes longer
        than ``command_timeout``."""
        await self.commands.cancel(record.job_id, record.step_id)
        deadline = time.monotonic() + self.command_timeout
        while time.monotonic() < deadline:
            found = await self.read(record)
            if found is None or (isinstance(found, SlurmJob) and found.ended):  # COMPLETING: processes remain
                break
            await asyncio.sleep(POLL_S)
        else:
            raise SlurmError(f"Slurm did not end job {record.ident} within {self.command_timeout:g} s")
        if record.step_id is not None:
            srun = self._sruns.pop(record.lease_id, None)
            if srun is not None:  # it exits with its step
                await asyncio.to_thread(srun.wait, self.command_timeout)
            shares = await self.shares(log_dir or Path(record.log_path).parent)
            await shares.release_if_empty(record.job_id)


def kernel_command(python: str, connection_file: Path, extensions: Sequence[str] = (WORKER_EXTENSION,),
                   history: Path | None = None) -> list[str]:
    """The command line of a worker kernel that reads ``connection_file``
    (written by the agent before the job starts, as batchspawner writes a
    server's settings): gpupool's worker application with the options a
    local worker gets (:func:`~...kernel.kernel_arguments`)."""
    return [python, "-m", WORKER_KERNEL_APP, "-f", str(connection_file), *kernel_arguments(extensions, history)]


def _gpu_count(gres: str) -> int:
    """GPUs in a node's ``Gres=gpu:2,shard:16`` (or ``gpu:a100:2(S:0-1)``)."""
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            return int(parts[-1])
    return 0


def _checked(check: Any, proposal: Any) -> Any:
    from traitlets import TraitError

    try:
        return check(proposal["value"])
    except ValueError as exc:
        raise TraitError(str(exc)) from None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _tail(path: Path, lines: int = 3) -> str:
    return " ".join(_read(str(path)).strip().splitlines()[-lines:])


def _aborted(output: str, returncode: int) -> bool:
    """Whether Slurm ended the step whose srun exited with ``returncode``
    after writing ``output``: it aborted the step, or the task neither exited
    with code 0 nor said it exited (then slurmstepd's end line is to come)."""
    if SRUN_STEP_ABORTED in output:
        return True
    return returncode != 0 and SRUN_TASK_EXITED not in output
