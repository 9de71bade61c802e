"""The ``local`` worker launcher: a worker kernel as a process of the
agent's host, cold for a lease (its slice's environment from the start), or
warm (no GPU visible, the preload imported) for the pool.

Each start takes the worker's account, makes its cgroup, forks the kernel
from its interpreter's template (:mod:`.template`; the template's child joins
the cgroup before it runs) or else starts ipykernel through jupyter_client
(the start gate puts it in the cgroup before it runs: :mod:`.gate`),
subscribes to its IOPub and waits until it answers ``kernel_info``. A start
that fails leaves nothing running.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

from ....cgroups import CgroupError, LeaseCgroup
from ....worker_user import NoFreeWorkerUser, WorkerUser
from ...binding import UNBOUND_ENVIRONMENT, prepare, preload_code
from ...handle import Worker, open_log
from ...kernel import history_path, kernel_arguments
from ...process import AdoptedProcess, LocalProcess, WorkerProcess, kill_strays, left_behind
from ...records import WorkerRecord, read_records, stray_workers
from ...spec import WorkerSpec, WorkerStartError, worker_environment
from ...stopping import kill_and_remove, quietly
from ..base import WorkerLauncher
from .adoption import kill_stray_cgroups, recorded_process
from .gate import GatedKernelManager
from .template import Templates, TemplateError, WorkerTemplate


#: Starts of one worker in all when its ports were taken before it bound them.
PORT_TRIES = 3
#: What ZMQ says (in the worker's log) when a port it was given is taken.
PORT_TAKEN = "Address already in use"


class LocalLauncher(WorkerLauncher):
    """The stock launcher (``local``): each worker an ipykernel process of
    this host, forked from its interpreter's template (a
    :class:`~.template.ForkedProcess`) or else this agent's child (a
    :class:`~...process.LocalProcess`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = self.settings
        self.templates = Templates(worker_environment(settings.environ, {}), settings.warm.preload,
                                   settings.extensions, settings.state_dir, self.log) \
            if settings.templates else None

    async def prepare(self) -> None:
        """Start the template of the agent's own interpreter (the default
        environment's), so that the first cold start forks already."""
        if self.templates is not None:
            self.templates.prepare(sys.executable)

    async def close(self) -> None:
        if self.templates is not None:
            await self.templates.close()

    async def adopt(self, record: WorkerRecord, spec: WorkerSpec) -> Worker | None:
        """The host process of ``record`` (one with no ``launcher`` state: a
        local worker's) if it still runs in the cgroup the record names (its
        pid there, with the recorded start time; without a cgroup, its
        connection file on its command line), as an
        :class:`~...process.AdoptedProcess` running as the record's account.
        None when it is gone, its cgroup or connection file is, or another
        launcher wrote the record."""
        if record.launcher is not None:
            self.log.warning("the worker record of lease %s is another launcher's than local (%s)", record.lease_id,
                             str(record.launcher)[:100])
            return None
        cgroup = self.cgroups.find(record.cgroup) if record.cgroup else None
        if record.cgroup and cgroup is None:
            self.log.warning("the cgroup %s of lease %s's worker is gone (c.AgentEnforcement.cgroup_root or "
                             "cgroup_mode changed?)", record.cgroup, record.lease_id)
            return None
        proc = recorded_process(record, cgroup.pids() if cgroup is not None else None)
        if proc is None:
            return None
        try:
            manager = self.kernels.existing(Path(record.connection_file))
        except (OSError, ValueError) as exc:
            self.log.warning("cannot re-adopt the worker of lease %s: its connection file: %s", record.lease_id, exc)
            return None  # it is a stray now, and swept as one
        worker = Worker(spec, manager, AdoptedProcess(proc, record.create_time), Path(record.log_path),
                        self.settings.advertise_ip, cgroup=cgroup)
        worker.user = self.accounts.claim(record.user)
        return worker

    async def sweep(self, kept: list[Worker]) -> None:
        """Kill what an earlier run of the agent started and ``kept`` does
        not hold: every other cgroup of the agent's subtree, then the
        processes in no cgroup (by their command line, and what the cells of
        dead workers without a cgroup left in their process groups)."""
        await kill_stray_cgroups(self.cgroups, {worker.cgroup.name for worker in kept}, self.log)
        keep = {pid for worker in kept for pid in (worker.pid, *worker.helpers)}
        strays = stray_workers(self.settings.workers_dir, keep)
        records, _ = read_records(self.settings.workers_dir)
        for record in records:
            if record.pid not in keep and not record.cgroup:
                strays += left_behind(record.pid, record.create_time)
        await kill_strays(strays, self.log)

    async def cold(self, spec: WorkerSpec) -> Worker:
        """Start the worker of ``spec``, its slice's environment set from
        the start. WorkerStartError."""
        settings = self.settings
        env = worker_environment(settings.environ, settings.enforcement.environment(
            spec.gpus, spec.fraction, spec.memory, spec.lease_id, spec.owner, settings.node))
        worker = await self._launch(spec.lease_id, env, f"lease-{spec.lease_id}", python=spec.python,
                                    user=spec.user)
        worker.spec = spec
        return worker

    async def warm(self) -> Worker:
        """Start one warm worker: no GPU visible, ``warm.preload`` imported.
        Raises WorkerStartError (nothing is left running then)."""
        # Unguessable: no one may find a warm worker's files (or cgroup) by counting.
        name = f"warm-{secrets.token_hex(8)}"
        worker = await self._launch(name, worker_environment(self.settings.environ, UNBOUND_ENVIRONMENT), name)
        preload = self.settings.warm.preload
        try:
            # Without a preload too: the bind then finds its connection open and the first execute done.
            reply = await prepare(worker, preload_code(preload) or "pass", self.settings.start_timeout)
        except Exception as exc:  # noqa: BLE001 - reported as a failed warm start
            reply = {"ename": type(exc).__name__, "evalue": str(exc)}
        if reply.get("status") != "ok":
            await quietly(self.reaper.terminate(worker))
            what = f"preloading {', '.join(preload)}" if preload else "its first execute_request"
            raise WorkerStartError(f"{what} failed: {reply.get('ename')}: {reply.get('evalue')}"
                                   + (" (c.AgentWorkers.preload_modules)" if preload else ""))
        self.log.info("warm worker %s ready: pid %s", name, worker.pid)
        return worker

    async def _launch(self, name: str, env: dict[str, str], cgroup_name: str, python: str | None = None,
                      user: WorkerUser | None = None) -> Worker:
        """Start one ipykernel with ``env`` in a new cgroup ``cgroup_name``,
        its log named after ``name``, and wait until it answers
        ``kernel_info``. ``python``: the environment's interpreter (None: the
        agent's); ``user``: the lease owner's own account (a ``worker_user``
        template), else one of the pool's, else the one worker user. Raises
        WorkerStartError.

        jupyter_client picks a kernel's ports free and the kernel binds them a
        moment later; on a busy node another process can take one in between,
        and the kernel exits with "Address already in use". That start is
        tried again with new ports (:data:`PORT_TRIES` in all)."""
        for _ in range(PORT_TRIES - 1):
            try:
                return await self._launch_once(name, env, cgroup_name, python, user)
            except WorkerStartError as exc:
                if PORT_TAKEN not in str(exc):
                    raise
                self.log.warning("the worker for %s lost a port to another process before binding it; "
                                 "starting it again with new ports", name)
        return await self._launch_once(name, env, cgroup_name, python, user)

    async def _launch_once(self, name: str, env: dict[str, str], cgroup_name: str, python: str | None,
                           user: WorkerUser | None) -> Worker:
        """One try of :meth:`_launch`; on failure nothing it started is left."""
        workers_dir = self.settings.workers_dir
        # A random name: the cgroup and the log name the lease, the key's file does not.
        manager = self.kernels(workers_dir / f"kernel-{secrets.token_hex(16)}.json", GatedKernelManager)
        manager.python = python
        try:
            account = self.accounts.take(user)
        except NoFreeWorkerUser as exc:
            raise WorkerStartError(f"could not start the worker for {name}: {exc}") from None
        manager.owner = (account.uid, account.gid) if account is not None else None
        try:
            cgroup = await asyncio.to_thread(self.cgroups.create, cgroup_name)
        except CgroupError as exc:
            if self.accounts.pooled(user):
                await self.accounts.give_back(account)
            raise WorkerStartError(f"could not make the cgroup of the worker for {name}: {exc}") from None
        if cgroup.confines:  # joined by the start gate, before the kernel runs
            manager.cgroup = cgroup
        log_path = workers_dir / f"{name}.log"
        template = self.templates.ready(python or sys.executable, env) if self.templates is not None else None
        process = await self._fork_kernel(template, manager, name, env, log_path, cgroup, account, user) \
            if template is not None else None
        if process is None:
            await self._start_kernel(manager, name, env, log_path, cgroup, account, user)
            process = LocalProcess(manager.provisioner.process)
        worker = Worker(None, manager, process, log_path, self.settings.advertise_ip, name, cgroup)
        worker.user = account
        await self.ready(worker)
        return worker

    async def _start_kernel(self, manager: GatedKernelManager, name: str, env: dict[str, str], log_path: Path,
                            cgroup: LeaseCgroup, account: WorkerUser | None, user: WorkerUser | None) -> None:
        """Start the kernel process of ``manager`` as ``account`` (taken for
        ``user``); on failure kill what started, remove ``cgroup``, give the
        account back and raise WorkerStartError."""
        as_user: dict[str, Any] = {}
        cwd = self.accounts.workdir(account, user)
        if account is not None:
            as_user = account.popen_kwargs()
            env = {**env, **account.environment(cwd)}
        try:
            # The child keeps its own copy of the descriptor; ours can close.
            # Independent: no ipykernel parent poller, so a worker outlives a
            # crashed agent and the restarted one re-adopts it (recover()).
            with open_log(log_path) as out:
                await manager.start_kernel(env=env, extra_arguments=kernel_arguments(self.settings.extensions,
                                                                           None if account else history_path(log_path)),
                                           stdout=out, stderr=subprocess.STDOUT, cwd=cwd, independent=True,
                                           **as_user)
        except Exception as exc:
            process = getattr(manager.provisioner, "process", None)
            if process is not None:  # launched, then something after it failed
                await asyncio.to_thread(LocalProcess(process).kill, (), 5.0)
            await quietly(asyncio.to_thread(kill_and_remove, cgroup, 5.0))
            await quietly(manager.cleanup_resources())
            await self.accounts.give_back(account)
            raise WorkerStartError(f"could not launch the worker for {name}: {exc}") from None
        if not cgroup.confines:  # no gate to join: its process group and tree, from here on
            cgroup.add(manager.provisioner.process.pid)

    async def _fork_kernel(self, template: WorkerTemplate, manager: GatedKernelManager, name: str,
                           env: dict[str, str], log_path: Path, cgroup: LeaseCgroup, account: WorkerUser | None,
                           user: WorkerUser | None) -> WorkerProcess | None:
        """The kernel of ``manager`` forked from ``template``, in ``cgroup``
        before it runs, as ``account``; None (nothing started) when the
        template could not fork, so the caller boots one. On any other
        failure, what started is killed, ``cgroup`` removed, the account
        given back, and WorkerStartError raised."""
        cwd = self.accounts.workdir(account, user)
        if account is not None:
            env = {**env, **account.environment(cwd)}
        manager.write_connection_file()
        argv = ["-f", manager.connection_file,
                *kernel_arguments(self.settings.extensions, None if account else history_path(log_path))]
        try:
            process = await template.fork(argv, env, cwd, log_path, account)
        except TemplateError as exc:
            self.log.warning("%s; booting the worker for %s instead", exc, name)
            return None
        try:
            await asyncio.to_thread(cgroup.add, process.pid)
            await template.go(process)
        except Exception as exc:
            await quietly(template.drop(process))
            await asyncio.to_thread(process.kill, (), 5.0)
            await quietly(asyncio.to_thread(kill_and_remove, cgroup, 5.0))
            await quietly(manager.cleanup_resources())
            await self.accounts.give_back(account)
            raise WorkerStartError(f"could not start the worker for {name}: {exc}") from None
        return process
