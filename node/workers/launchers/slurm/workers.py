"""``c.AgentWorkers.worker_launcher = "slurm"``: every lease's worker is a Slurm
job on the agent's node (whole GPUs: a job of its own; a slice: a step of the
share job that holds its GPU), started by :class:`.launcher.SlurmLauncher`,
watched and stopped through :mod:`.handles`, re-adopted after an agent restart
(:meth:`SlurmWorkers.adopt`) or cancelled when no record keeps it
(:meth:`SlurmWorkers.sweep`). What it does not do (warm workers, accounts): docs/launchers.md."""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from traitlets import TraitError

from gpupool.errors import GPUPoolError, Reason

from ...handle import Worker, tail_lines
from ...kernel import history_path
from ...process import kill_strays
from ...records import WorkerRecord, stray_workers
from ...spec import WorkerSpec, WorkerStartError, worker_environment
from ...stopping import quietly
from ..base import WorkerLauncher
from .commands import SlurmError
from .handles import SlurmJobGroup, SlurmJobProcess, kernel_process, launched_with
from .launcher import SlurmLauncher, kernel_command
from .record import SlurmWorkerRecord
from .request import is_slice, job_environment
from .state import parse_pairs

#: Seconds to wait for the kernel's process to show in its job once Slurm runs it.
KERNEL_PID_WAIT_S = 10.0


class SlurmWorkers(WorkerLauncher):
    """The ``slurm`` launcher: lease workers as Slurm jobs (module docstring).
    ``settings.config``: the agent's traitlets config, read for ``c.SlurmLauncher.*``."""

    keeps_warm = False
    accounts_refusal = ("the Slurm launcher runs workers as the agent's account only "
                        "(c.AgentWorkers.worker_user is not supported with worker_launcher = 'slurm')")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slurm = _launcher(self.settings.config, self.log)

    def where(self) -> str:
        return f"Slurm node {self.slurm.node}"

    @classmethod
    def check_settings(cls, config: Any, separate_accounts: bool, log: logging.Logger) -> None:
        """At start: no worker accounts (Slurm runs the jobs as the agent's), ``c.SlurmLauncher.*``
        values that check, and Slurm that answers ``squeue`` for this node (slurmctld up, the
        clients where ``bin_dir`` says): each refused in one line, as systemd then restarts the agent
        until Slurm answers. Before recovery too, whose re-adoption would otherwise find no job."""
        super().check_settings(config, separate_accounts, log)
        try:
            slurm = _launcher(config, log)
        except TraitError as exc:
            raise GPUPoolError(Reason.not_configured, str(exc)) from None
        try:
            slurm.commands.run_blocking("squeue", "--noheader", f"--nodelist={slurm.node}", "--format=%i")
        except SlurmError as exc:
            raise GPUPoolError(Reason.service_unavailable,
                               f"worker_launcher = 'slurm', but Slurm cannot be asked for node {slurm.node}'s jobs: "
                               f"{exc}") from None

    @classmethod
    def host_totals(cls, config: Any, log: logging.Logger) -> tuple[float, int] | None:
        """The Slurm node's ``CPUTot`` and ``RealMemory`` (``scontrol show node``):
        what its jobs may have, not this host's count; None (logged) when Slurm cannot say."""
        slurm = _launcher(config, log)
        try:
            node = parse_pairs(slurm.commands.run_blocking("scontrol", "--oneliner", "show", "node", slurm.node))
            return float(node["CPUTot"]), int(node["RealMemory"]) * 2**20
        except (SlurmError, KeyError, ValueError) as exc:
            log.warning("could not read Slurm node %s's CPUs and memory (%s); offering this host's "
                        "(c.AgentInventory.host_cpus, host_memory)", slurm.node, exc)
            return None

    async def cold(self, spec: WorkerSpec) -> Worker:
        """Start ``spec``'s worker in Slurm and wait until it answers
        ``kernel_info``. WorkerStartError in words (Slurm's, when it refused
        or kept the job pending); nothing is left in Slurm then."""
        self.refuse_accounts(spec)
        settings = self.settings
        manager = self.kernels(settings.workers_dir / f"kernel-{secrets.token_hex(16)}.json")
        manager.write_connection_file()
        log_path = settings.workers_dir / f"lease-{spec.lease_id}.log"
        env = worker_environment(settings.environ, settings.enforcement.environment(
            spec.gpus, spec.fraction, spec.memory, spec.lease_id, spec.owner, settings.node))
        command = kernel_command(spec.python or sys.executable, Path(manager.connection_file), settings.extensions,
                                 history_path(log_path))
        gpu_index = spec.gpus[0].index if is_slice(spec) and spec.gpus else None
        try:
            record = await self.slurm.start(spec, command, Path(manager.connection_file), log_path,
                                            str(self.accounts.workdir(None, None)),
                                            job_environment(env, self.slurm.slurm_conf), gpu_index)
        except SlurmError as exc:
            await quietly(manager.cleanup_resources())
            raise WorkerStartError(f"could not start the worker of lease {spec.lease_id} in Slurm: {exc}") from None
        kernel = await self._kernel(record)
        if kernel is None:
            await quietly(self.slurm.stop(record))
            await quietly(manager.cleanup_resources())
            raise WorkerStartError(f"Slurm runs job {record.ident} of lease {spec.lease_id}, but its kernel did not "
                                   f"show within {KERNEL_PID_WAIT_S:g} s; its output: {_tail(log_path)}")
        if not is_slice(spec) and tuple(g.index for g in spec.gpus) != record.gpus:
            self.log.warning("lease %s was placed on GPU(s) %s; Slurm gave its job %s (docs/launchers.md, "
                             "'Which GPU')", spec.lease_id, ",".join(str(g.index) for g in spec.gpus),
                             ",".join(map(str, record.gpus)), record.job_id)
        worker = self._worker(spec, manager, record, kernel, self.slurm.srun_pids(spec.lease_id))
        await self.ready(worker)  # a failed one is stopped, in Slurm too (SlurmJobProcess.shutdown)
        self.log.info("lease %s: worker in Slurm job %s (pid %s)", spec.lease_id, record.ident, kernel.pid)
        return worker

    def _worker(self, spec: WorkerSpec, manager: Any, record: SlurmWorkerRecord, kernel: psutil.Process,
                helpers: set[int]) -> Worker:
        """The agent's handle on the worker of ``record`` whose kernel is ``kernel``; ``helpers``:
        its processes outside the kernel's tree (a step's srun), which a restarted agent leaves running."""
        worker = Worker(spec, manager, SlurmJobProcess(self.slurm, record, kernel, self.log), Path(record.log_path),
                        self.settings.advertise_ip, spec.lease_id,
                        SlurmJobGroup(f"slurm-{record.ident}", self.slurm, record, kernel, self.cgroups.task_root()))
        worker.launcher_state, worker.helpers = record.to_json(), helpers
        return worker

    async def adopt(self, record: WorkerRecord, spec: WorkerSpec) -> Worker | None:
        """After an agent restart: the worker whose Slurm job (or step) still
        runs or is suspended under the lease's name, with its kernel on this
        node; None when it is gone (its job ended meanwhile)."""
        try:
            slurm_record = SlurmWorkerRecord.from_json(record.launcher)
            found = await self.slurm.adopt(slurm_record)
        except (ValueError, SlurmError) as exc:
            self.log.warning("cannot re-adopt the Slurm worker of lease %s: %s", record.lease_id, exc)
            return None
        kernel = await self._kernel(slurm_record) if found is not None else None
        if kernel is None:
            return None
        try:
            manager = self.kernels.existing(Path(record.connection_file))
        except (OSError, ValueError) as exc:
            self.log.warning("cannot re-adopt the worker of lease %s: its connection file: %s", record.lease_id, exc)
            return None
        # A step's srun, started by the agent before, is found by the kernel command it runs.
        sruns = set() if slurm_record.step_id is None else \
            {proc.pid for proc in launched_with(record.connection_file)} - {kernel.pid}
        worker = self._worker(spec, manager, slurm_record, kernel, sruns)
        if found.state == "SUSPENDED":
            worker.cgroup.frozen_by_slurm()
        self.log.info("lease %s: re-adopted its worker in Slurm job %s (%s)", spec.lease_id, slurm_record.ident,
                      found.state)
        return worker

    async def warm(self) -> Worker:
        raise WorkerStartError("the Slurm launcher keeps no warm workers: a pending job holds nothing "
                               "(c.AgentWorkers.warm_workers = 0)")

    async def sweep(self, kept: list[Worker]) -> None:
        """Before the first start, once recovery re-adopted ``kept``: kill
        the kernels and sruns on this node that no kept worker holds (a
        step's in a kept share job, whose lease ended meanwhile, or whose
        record is gone), then cancel every other job an earlier agent left on
        this node (named with ``c.SlurmLauncher.name_prefix``)."""
        keep = {pid for worker in kept for pid in (worker.pid, *worker.helpers)}
        await kill_strays(stray_workers(self.settings.workers_dir, keep), self.log)
        jobs = {int(worker.launcher_state["job_id"]) for worker in kept if worker.launcher_state}
        left = [job_id for job_id in await self.slurm.left_behind() if job_id not in jobs]
        for job_id in left:
            await self.slurm.commands.cancel(job_id)
        if left:
            self.log.warning("cancelled %d Slurm job(s) an earlier agent left on %s that no live worker of it holds: "
                             "%s", len(left), self.slurm.node, ", ".join(map(str, left)))

    async def _kernel(self, record: SlurmWorkerRecord) -> psutil.Process | None:
        """The kernel's process on this node, once Slurm has started it; None after :data:`KERNEL_PID_WAIT_S`."""
        deadline = time.monotonic() + KERNEL_PID_WAIT_S
        while time.monotonic() < deadline:
            found = kernel_process(await self.slurm.commands.pids(record.job_id, record.step_id),
                                   record.connection_file)
            if found is not None:
                return found
            await asyncio.sleep(0.1)
        return None


def _tail(path: Path) -> str:
    return " | ".join(tail_lines(path, 5)) or "(none)"


def _launcher(config: Any, log: logging.Logger) -> SlurmLauncher:
    """The Slurm side, with ``c.SlurmLauncher.*`` of ``config`` (the agent's; None: defaults)."""
    return SlurmLauncher(config=config, log=log) if config is not None else SlurmLauncher(log=log)
