"""Workers that outlive their agent, and the agent that finds them again.

Workers are started independent of the agent (no ipykernel parent poller),
so a crashed or killed agent does not take the users' variables with it. A
restarted agent reads the records it left (:mod:`.records`): a worker still
running is re-adopted (an :class:`~.process.AdoptedProcess`) and reported to
the service, which keeps its lease or tells the agent to stop it; every
other process a previous run started (warm workers, workers of no record,
what a dead worker's cells left behind) is killed. With cgroups
(:mod:`..cgroups`) the worker is looked for in the cgroup its record names,
and "every other process" is every other cgroup of the agent's subtree; the
command-line and process-group searches are for processes in no cgroup (an
agent run with ``cgroup_mode = "none"``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..activity import watch_iopub
from ..cgroups import CgroupError, Containment
from .accounts import WorkerAccounts
from .handle import Worker
from .kernel import KernelManagers
from .parkstate import Parked
from .process import AdoptedProcess, kill_all, left_behind
from .records import WorkerRecord, read_records, stray_workers
from .spec import WorkerLaunch, WorkerSpec
from .stopping import kill_and_remove, remove_files, worker_files

if TYPE_CHECKING:
    from .launchers import WorkerLauncher

#: Seconds a worker left by an earlier run of the agent gets to answer on its
#: control channel (which answers while a cell runs) before it is stopped.
ADOPT_TIMEOUT_S = 10.0


class Recovery:
    """Takes over what an earlier run of the agent left under
    ``settings.workers_dir`` and in ``cgroups``."""

    def __init__(self, settings: WorkerLaunch, accounts: WorkerAccounts, cgroups: Containment,
                 kernels: KernelManagers, log: logging.Logger, launcher: WorkerLauncher | None = None) -> None:
        self.settings = settings
        self.launcher = launcher  # re-adopts the workers whose record has its state (record.launcher)
        self.workers_dir = settings.workers_dir
        self.accounts = accounts
        self.cgroups = cgroups
        self.kernels = kernels
        self.log = log

    async def recover(self) -> list[Worker]:
        """Re-adopt the lease workers that still run and answer; kill and
        remove everything else an earlier run left. Returns the workers
        re-adopted (see :meth:`~.manager.WorkerManager.recover`)."""
        records, problems = read_records(self.workers_dir)
        for problem in problems:
            self.log.warning("ignoring %s", problem)
        adopted = [worker for worker in [await self._adopt(record) for record in records] if worker is not None]
        await self._kill_stray_cgroups({worker.cgroup.name for worker in adopted})
        await self._kill_stray_processes(records, {pid for worker in adopted for pid in (worker.pid, *worker.helpers)})
        files = {path for worker in adopted for path in worker_files(worker, self.workers_dir)}
        for path in self.workers_dir.iterdir():
            if path.is_file() and path not in files:
                remove_files(path)
        await self.accounts.give_back_free()  # what the killed workers' accounts left
        return adopted

    async def _kill_stray_processes(self, records: list[WorkerRecord], keep: set[int]) -> None:
        """Kill the processes in no cgroup that an earlier run started and
        that are not in ``keep``: by their command line, and what the cells
        of dead workers without a cgroup left in their process groups."""
        strays = stray_workers(self.workers_dir, keep)
        for record in records:
            if record.pid not in keep and not record.cgroup:
                strays += left_behind(record.pid, record.create_time)
        if strays:
            self.log.warning("stopping %d process(es) an earlier run of the agent left: pids %s", len(strays),
                             ", ".join(str(p.pid) for p in strays))
            survivors = await asyncio.to_thread(kill_all, strays)
            if survivors:
                self.log.error("processes %s survived SIGKILL", survivors)

    async def _kill_stray_cgroups(self, keep: set[str]) -> None:
        """Kill and remove every cgroup of the agent's subtree not in ``keep``."""
        for name in self.cgroups.names():
            if name in keep or (cgroup := self.cgroups.find(name)) is None:
                continue
            pids = sorted(cgroup.pids())
            if pids:
                self.log.warning("killing cgroup %s an earlier run of the agent left: pids %s", name,
                                 ", ".join(map(str, pids)))
            try:
                await asyncio.to_thread(kill_and_remove, cgroup, 10.0)
            except CgroupError as exc:
                self.log.error("%s", exc)

    async def _adopt(self, record: WorkerRecord) -> Worker | None:
        """Re-adopt the worker of ``record``, or None (gone, or it does not answer: then it is stopped)."""
        try:
            spec = WorkerSpec(record.lease_id, record.owner, record.gpus, record.fraction, record.memory)
        except ValueError as exc:
            self.log.warning("ignoring the worker record of %r: %s", record.lease_id, exc)
            return None
        worker = await self._find(record, spec)
        if worker is None:
            return None
        if record.parked is not None:
            return await self._keep_parked(worker, record)
        return await self._reconnect(worker, record)

    async def _find(self, record: WorkerRecord, spec: WorkerSpec) -> Worker | None:
        """The worker of ``record`` if it still runs: through its launcher (a
        record with launcher state), else its process in its cgroup; None when gone."""
        if record.launcher is not None:
            worker = await self.launcher.adopt(record, spec) if self.launcher is not None else None
            if worker is None:
                self.log.warning("the worker of lease %s ended while the agent was away (its launcher found it "
                                 "no more)", record.lease_id)
            return worker
        cgroup = self.cgroups.find(record.cgroup) if record.cgroup else None
        if record.cgroup and cgroup is None:
            self.log.warning("the cgroup %s of lease %s's worker is gone (c.NodeAgent.cgroup_root or cgroup_mode "
                             "changed?)", record.cgroup, record.lease_id)
            return None
        proc = record.process(cgroup.pids() if cgroup is not None else None)
        if proc is None:
            self.log.warning("the worker (pid %s) of lease %s ended while the agent was away", record.pid,
                             record.lease_id)
            return None
        try:
            manager = self.kernels.existing(Path(record.connection_file))
        except (OSError, ValueError) as exc:
            self.log.warning("cannot re-adopt the worker of lease %s: its connection file: %s", record.lease_id, exc)
            return None  # it is a stray now, and stopped as one
        worker = Worker(spec, manager, AdoptedProcess(proc, record.create_time), Path(record.log_path),
                        self.settings.advertise_ip, cgroup=cgroup)
        worker.user = self.accounts.claim(record.user)
        return worker

    async def _keep_parked(self, worker: Worker, record: WorkerRecord) -> Worker | None:
        """Re-adopt a worker parked in memory as it is: frozen (it answers
        nothing until its resume thaws it), its GPU state where its
        checkpointer left it. None (it is stopped) for a record that cannot be read."""
        try:
            worker.parked = Parked.from_json(record.parked)
        except ValueError as exc:
            self.log.warning("cannot re-adopt the parked worker of lease %s: %s", record.lease_id, exc)
            return None
        if not worker.cgroup.frozen():  # the agent died between a thaw and its record: parked it is
            try:
                await asyncio.to_thread(worker.cgroup.freeze, 10.0)
            except CgroupError as exc:
                self.log.warning("the parked worker of lease %s cannot be frozen again (%s); stopping it",
                                 record.lease_id, exc)
                return None
        context = self.kernels.context
        watcher = asyncio.ensure_future(watch_iopub(worker, worker.manager.get_connection_info(), context, self.log))
        worker.watcher = asyncio.gather(watcher, _track_running_cell(worker, self.log))
        self.log.info("re-adopted the parked worker (pid %s) of lease %s of %s, frozen (parked in memory with %s)",
                      record.pid, record.lease_id, record.owner, worker.parked.checkpointer)
        return worker

    async def _reconnect(self, worker: Worker, record: WorkerRecord) -> Worker | None:
        """Watch the re-adopted ``worker``'s IOPub and check that it answers;
        None (the watch stopped) when it does not."""
        context = self.kernels.context
        watcher = asyncio.ensure_future(watch_iopub(worker, worker.manager.get_connection_info(), context, self.log))
        try:
            await _control_kernel_info(worker, ADOPT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - timed out, refused: not a usable worker
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            self.log.warning("the worker (pid %s) of lease %s did not answer after the agent restarted (%s); "
                             "stopping it", record.pid, record.lease_id, str(exc) or type(exc).__name__)
            return None
        worker.watcher = asyncio.gather(watcher, _track_running_cell(worker, self.log))
        self.log.info("re-adopted the worker (pid %s) of lease %s of %s", record.pid, record.lease_id, record.owner)
        return worker


async def _control_kernel_info(worker: Worker, timeout: float) -> None:
    """Ask the worker for ``kernel_info`` on its control channel (answered
    even while a cell runs); TimeoutError after ``timeout`` seconds."""
    client = worker.manager.client()
    client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
    msg = client.session.msg("kernel_info_request")

    async def answer() -> None:
        while (await client.control_channel.get_msg())["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
            pass

    try:
        client.control_channel.send(msg)
        await asyncio.wait_for(answer(), timeout)
    finally:
        client.stop_channels()


async def _track_running_cell(worker: Worker, log: logging.Logger) -> None:
    """Learn whether a re-adopted worker is running a cell: its shell channel
    answers ``kernel_info`` only once no cell runs. Until the answer, the
    worker counts as busy (never reclaimed for idleness); the running cell's
    own end, seen on IOPub, then counts as the end of the last cell."""
    client = worker.manager.client()
    client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)

    def status(msg_id: str, state: str) -> dict[str, Any]:
        return {"msg_type": "status", "parent_header": {"msg_id": msg_id, "msg_type": "kernel_info_request"},
                "content": {"execution_state": state}}

    msg_id = client.kernel_info()
    worker.activity.on_message(status(msg_id, "busy"))
    worker.activity.mark_ready()
    try:
        while (await client.get_shell_msg())["parent_header"].get("msg_id") != msg_id:
            pass
    except Exception as exc:  # noqa: BLE001 - its death is noticed by poll()
        log.debug("no kernel_info answer from the worker of %s: %s", worker.name, exc)
    finally:
        worker.activity.on_message(status(msg_id, "idle"))
        client.stop_channels()
