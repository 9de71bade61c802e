"""What the agent asks Slurm for, for one lease's worker (pure: settings and
a lease in, command lines out): a lease job of its own (:func:`lease_job`)
for whole GPUs, or a slice step (:func:`slice_step`) in a share job
(:func:`share_job`) that holds one GPU. Why these two shapes, the jobs' names
and why none is requeued: docs/launchers.md, "Whole GPUs and slices".
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..resources import LeaseResources

#: sbatch/srun options the launcher sets itself: not allowed in ``extra_args``.
RESERVED_OPTIONS = ("--gres", "--gpus", "--job-name", "-J", "--comment", "--nodelist", "-w", "--nodes", "-N",
                    "--ntasks", "-n", "--cpus-per-task", "-c", "--mem", "--output", "-o", "--error", "-e",
                    "--export", "--parsable", "--chdir", "-D", "--jobid", "--wrap", "--array", "-a",
                    "--partition", "-p", "--account", "-A", "--qos", "-q", "--time", "-t")
#: The comment of a lease job: ``COMMENT_PREFIX + lease id``.
COMMENT_PREFIX = "gpupool:lease="
#: The comment of a share job.
SHARE_COMMENT = "gpupool:share"
#: Variables Slurm sets in a job from the GRES it grants: never passed from the agent.
GRANTED_BY_SLURM = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ROCR_VISIBLE_DEVICES",
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
# Slurm's time formats (sbatch(1), --time): minutes, minutes:seconds, hours:minutes:seconds,
# days-hours, days-hours:minutes, days-hours:minutes:seconds; or unlimited.
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$")
_UNLIMITED = ("UNLIMITED", "INFINITE")


@dataclass(frozen=True)
class JobSettings:
    """The site's settings for every job of one node (from
    :class:`~.launcher.SlurmLauncher`): ``node`` (Slurm's name of the
    agent's node), ``partition``, ``account``, ``qos``, ``time_limit``
    (Slurm's format; empty: the partition's default), ``extra_args`` (more
    sbatch options), ``name_prefix`` (of job names), ``slice_gres`` (``gpu``
    or ``shard``) and ``shards_per_gpu``."""

    node: str
    partition: str = ""
    account: str = ""
    qos: str = ""
    time_limit: str = ""
    extra_args: tuple[str, ...] = ()
    name_prefix: str = "gpupool-"
    slice_gres: str = "gpu"
    shards_per_gpu: int = 8

    def __post_init__(self) -> None:
        if not self.node:
            raise ValueError("the Slurm node name is empty (c.SlurmLauncher.node)")
        check_time_limit(self.time_limit)
        check_extra_args(self.extra_args)
        if self.slice_gres not in ("gpu", "shard"):
            raise ValueError(f"slice_gres must be 'gpu' or 'shard', not {self.slice_gres!r}")
        if self.shards_per_gpu < 1:
            raise ValueError("shards_per_gpu must be at least 1")


@dataclass(frozen=True)
class Submission:
    """One ``sbatch`` call: ``args`` (options, no script) and the batch
    ``script`` it reads on its stdin."""

    args: tuple[str, ...]
    script: str

    def command(self, sbatch: str = "sbatch") -> list[str]:
        return [sbatch, "--parsable", *self.args]


def check_time_limit(value: str) -> str:
    """``value`` if it is Slurm's time format (or empty); ValueError naming the formats."""
    if value and value.upper() not in _UNLIMITED and not _TIME.match(value):
        raise ValueError(f"time limit {value!r} is not in Slurm's format: minutes, 'HH:MM:SS', 'D-HH:MM:SS' or "
                         "'UNLIMITED' (c.SlurmLauncher.time_limit)")
    return value


def check_extra_args(args: Sequence[str]) -> tuple[str, ...]:
    """``args`` as a tuple if each is one long option (``--name[=value]``)
    the launcher does not set itself; ValueError naming the first that is not."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if not arg.startswith("--") or name == "--":
            raise ValueError(f"extra sbatch argument {arg!r} must be one long option such as '--constraint=a100' "
                             "(c.SlurmLauncher.extra_args)")
        if name in RESERVED_OPTIONS:
            raise ValueError(f"extra sbatch argument {arg!r} is set by gpupool itself or by a setting of its own "
                             "(c.SlurmLauncher.partition, account, qos, time_limit; c.SlurmLauncher.extra_args)")
    return tuple(args)


def job_name(settings: JobSettings, lease_id: str) -> str:
    """The Slurm job name of ``lease_id``'s job (and of its step)."""
    return f"{settings.name_prefix}{lease_id}"


def share_name(settings: JobSettings) -> str:
    """The job name of the node's share jobs (one whole GPU each)."""
    return f"{settings.name_prefix}share-{settings.node}"


def is_slice(lease: LeaseResources) -> bool:
    """True for a share of one GPU (fraction below 1)."""
    return len(lease.gpus) == 1 and lease.fraction < 1.0


def gres(lease: LeaseResources, settings: JobSettings) -> str:
    """The GRES ``lease`` holds in Slurm: ``gpu:N`` for N whole GPUs (a
    slice's share job holds ``gpu:1``), ``shard:K`` for a slice when
    ``slice_gres`` is ``shard``: K = fraction × shards per GPU, rounded up."""
    if is_slice(lease) and settings.slice_gres == "shard":
        return f"shard:{max(1, math.ceil(lease.fraction * settings.shards_per_gpu - 1e-9))}"
    return f"gpu:{max(1, len(lease.gpus))}"


def cpus_per_task(cpus: float | None) -> int:
    """Slurm counts whole CPUs: ``cpus`` cores rounded up (None: one)."""
    return max(1, math.ceil(cpus - 1e-9)) if cpus else 1


def mebibytes(size: int) -> int:
    """Bytes as Slurm's memory unit (MiB, its ``M``), rounded up."""
    return max(1, math.ceil(size / 2**20))


def _site_args(settings: JobSettings) -> list[str]:
    args = [f"--nodelist={settings.node}", "--nodes=1"]
    for option, value in (("--partition", settings.partition), ("--account", settings.account),
                          ("--qos", settings.qos), ("--time", settings.time_limit)):
        if value:
            args.append(f"{option}={value}")
    return args


def lease_job(lease: LeaseResources, settings: JobSettings, command: Sequence[str], log_path: str,
              workdir: str) -> Submission:
    """The batch job of a lease (whole GPUs, or a slice with
    ``slice_gres = "shard"``): one task, the lease's CPUs and memory, its
    GRES, its output to ``log_path``, started in ``workdir``; its batch
    script execs ``command`` (the worker) so the kernel is the job's process."""
    args = [f"--job-name={job_name(settings, lease.lease_id)}", f"--comment={COMMENT_PREFIX}{lease.lease_id}",
            *_site_args(settings), "--ntasks=1", f"--cpus-per-task={cpus_per_task(lease.cpus)}",
            f"--gres={gres(lease, settings)}", f"--output={log_path}", f"--chdir={workdir}", "--export=ALL",
            "--no-requeue"]
    if lease.host_memory:
        args.append(f"--mem={mebibytes(lease.host_memory)}M")
    script = batch_script(command, f"the worker of gpupool lease {lease.lease_id}")
    return Submission((*args, *settings.extra_args), script)


def share_job(settings: JobSettings, cpus: int, memory: int, log_path: str, workdir: str) -> Submission:
    """A share job: one whole GPU, ``cpus`` CPUs and ``memory`` bytes held
    for the slices' steps, its batch script waiting until it is cancelled."""
    args = [f"--job-name={share_name(settings)}", f"--comment={SHARE_COMMENT}", *_site_args(settings), "--ntasks=1",
            f"--cpus-per-task={max(1, cpus)}", f"--mem={mebibytes(memory)}M", "--gres=gpu:1", f"--output={log_path}",
            f"--chdir={workdir}", "--export=ALL", "--no-requeue"]
    return Submission((*args, *settings.extra_args), batch_script(["sleep", "infinity"], "a gpupool share job"))


def slice_step(job_id: int, lease: LeaseResources, settings: JobSettings, command: Sequence[str], log_path: str,
               workdir: str, srun: str = "srun") -> list[str]:
    """The ``srun`` command line that runs a slice's worker as a step of the
    share job ``job_id``: one task, the lease's CPUs and memory (a cgroup of
    the step's own), the job's GPU shared (``--overlap``), named after the
    lease. srun stays running for the step's life: the step ends with it."""
    args = [srun, f"--jobid={job_id}", "--overlap", "--ntasks=1", f"--cpus-per-task={cpus_per_task(lease.cpus)}",
            "--gres=gpu:1", f"--job-name={job_name(settings, lease.lease_id)}", f"--output={log_path}",
            "--input=none", f"--chdir={workdir}", "--export=ALL"]
    if lease.host_memory:
        args.append(f"--mem={mebibytes(lease.host_memory)}M")
    return [*args, *command]


def batch_script(command: Sequence[str], what: str) -> str:
    """A POSIX shell batch script that replaces itself with ``command``."""
    return f"#!/bin/sh\n# {what}, submitted by its gpupool agent\nexec {shlex.join(command)}\n"


def job_environment(environ: Mapping[str, str], slurm_conf: str = "") -> dict[str, str]:
    """The environment a job is submitted with (``--export=ALL``): the
    worker's, without what Slurm sets from the GRES it grants
    (:data:`GRANTED_BY_SLURM`) or from the agent's own job, if it runs in
    one (``SLURM_*``); plus ``SLURM_CONF`` when the site names one."""
    env = {name: value for name, value in environ.items()
           if name not in GRANTED_BY_SLURM and not name.startswith("SLURM_")}
    if slurm_conf:
        env["SLURM_CONF"] = slurm_conf
    return env
