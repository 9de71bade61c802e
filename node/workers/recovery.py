"""Workers that outlive their agent, and the agent that finds them again.

Workers are started independent of the agent (no ipykernel parent poller),
so a crashed or killed agent does not take the users' variables with it. A
restarted agent reads the records it left (:mod:`.records`) and asks its
launcher for each record's worker (:meth:`~.launchers.base.WorkerLauncher.adopt`:
the local launcher's host process in its cgroup, a Slurm job, a pod). A
worker still running that answers is re-adopted and reported to the
service, which keeps its lease or tells the agent to stop it; the launcher
then ends everything else a previous run started
(:meth:`~.launchers.base.WorkerLauncher.sweep`: warm workers, workers of no
record or that did not answer, what a dead worker's cells left behind), and
the files no re-adopted worker holds are removed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ..activity import watch_iopub
from ..cgroups import CgroupError
from .accounts import WorkerAccounts
from .handle import Worker
from .kernel import KernelManagers
from .parkstate import ParkedInMemory
from .records import WorkerRecord, read_records
from .spec import WorkerLaunch, WorkerSpec
from .stopping import remove_files, worker_files

if TYPE_CHECKING:
    from .launchers import WorkerLauncher

#: Seconds a worker left by an earlier run of the agent gets to answer on its
#: control channel (which answers while a cell runs) before it is stopped.
ADOPT_TIMEOUT_S = 10.0


class Recovery:
    """Takes over what an earlier run of the agent left under
    ``settings.workers_dir``, through ``launcher``."""

    def __init__(self, settings: WorkerLaunch, accounts: WorkerAccounts, kernels: KernelManagers,
                 log: logging.Logger, launcher: WorkerLauncher) -> None:
        self.settings = settings
        self.launcher = launcher
        self.workers_dir = settings.workers_dir
        self.accounts = accounts
        self.kernels = kernels
        self.log = log

    async def recover(self) -> list[Worker]:
        """Re-adopt the lease workers that still run and answer; end
        everything else an earlier run left (the launcher's sweep) and remove
        its files. Returns the workers re-adopted (see
        :meth:`~.manager.WorkerManager.recover`)."""
        records, problems = read_records(self.workers_dir)
        for problem in problems:
            self.log.warning("ignoring %s", problem)
        adopted = [worker for worker in [await self._adopt(record) for record in records] if worker is not None]
        await self.launcher.sweep(adopted)
        files = {path for worker in adopted for path in worker_files(worker, self.workers_dir)}
        for path in self.workers_dir.iterdir():
            if path.is_file() and path not in files:
                remove_files(path)
        await self.accounts.give_back_free()  # what the killed workers' accounts left
        return adopted

    async def _adopt(self, record: WorkerRecord) -> Worker | None:
        """Re-adopt the worker of ``record``, or None (gone, or it does not
        answer: then the launcher's sweep ends it)."""
        try:
            spec = WorkerSpec(record.lease_id, record.owner, record.gpus, record.fraction, record.memory)
        except ValueError as exc:
            self.log.warning("ignoring the worker record of %r: %s", record.lease_id, exc)
            return None
        worker = await self.launcher.adopt(record, spec)
        if worker is None:
            self.log.warning("the worker (pid %s) of lease %s ended while the agent was away (its launcher found "
                             "it no more)", record.pid, record.lease_id)
            return None
        if record.parked is not None:
            return await self._keep_parked(worker, record)
        return await self._reconnect(worker, record)

    async def _keep_parked(self, worker: Worker, record: WorkerRecord) -> Worker | None:
        """Re-adopt a worker parked in memory as it is: frozen (it answers
        nothing until its resume thaws it), its GPU state where its
        checkpointer left it. None (it is stopped) for a record that cannot be read."""
        try:
            worker.parked = ParkedInMemory.from_json(record.parked)
        except ValueError as exc:
            self.log.warning("cannot re-adopt the parked worker of lease %s: %s", record.lease_id, exc)
            return None
        # Thawed but not offered: the agent died between a thaw and its record, so parked it is. An
        # offered one was thawed for a move, its state readable: the move, or a spill, takes it.
        if not worker.parked.offered and not worker.cgroup.frozen():
            try:
                await asyncio.to_thread(worker.cgroup.freeze, 10.0)
            except CgroupError as exc:
                self.log.warning("the parked worker of lease %s cannot be frozen again (%s); stopping it",
                                 record.lease_id, exc)
                return None
        context = self.kernels.context
        watcher = asyncio.ensure_future(watch_iopub(worker, worker.manager.get_connection_info(), context, self.log))
        worker.watcher = asyncio.gather(watcher, _track_running_cell(worker, self.log))
        self.log.info("re-adopted the parked worker (pid %s) of lease %s of %s, %s (parked in memory with %s)",
                      record.pid, record.lease_id, record.owner,
                      "thawed, offered for a move" if worker.parked.offered else "frozen", worker.parked.checkpointer)
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
