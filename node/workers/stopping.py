"""How a worker's processes end: stopped by the agent (release, agent stop,
a failed start), or noticed dead and reaped. Either way its whole cgroup
(without one: its process group and tree) is killed, so no process outlives
its lease."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from ..cgroups import CgroupError, LeaseCgroup
from ..host_limits import out_of_memory
from .accounts import WorkerAccounts
from .handle import Worker
from .kernel import history_path
from .records import record_path
from .spec import WorkerLaunch, WorkerStopError


class Reaper:
    """Stops and reaps the workers of one node (``settings.stop_timeout``,
    files under ``settings.workers_dir``); pool accounts go back to
    ``accounts`` once a worker's processes are gone."""

    def __init__(self, settings: WorkerLaunch, accounts: WorkerAccounts, log: logging.Logger) -> None:
        self.stop_timeout = settings.stop_timeout
        self.workers_dir = settings.workers_dir
        self.accounts = accounts
        self.log = log

    async def terminate(self, worker: Worker) -> int | None:
        """Stop ``worker`` and verify that its processes are gone; returns
        its exit code (negative: killed by that signal). Graceful first,
        then its cgroup and what is left are killed; its files are removed.
        WorkerStopError when a process survives SIGKILL."""
        worker.stopping = True
        if worker.watcher is not None:
            worker.watcher.cancel()
            await asyncio.gather(worker.watcher, return_exceptions=True)
        if worker.bind_client is not None:  # a warm worker that was never bound
            worker.bind_client.stop_channels()
            worker.bind_client = None
        children = worker.descendants()
        try:
            await worker.process.shutdown(worker.manager, self.stop_timeout)
        except Exception as exc:
            self.log.warning("worker %s did not shut down cleanly (%s); killing it",
                             worker.name, exc or type(exc).__name__)
        try:
            # The cgroup first: a daemon that left the process tree goes too.
            survivors = await asyncio.to_thread(worker.cgroup.kill, 10.0)
        except CgroupError as exc:
            self.log.error("could not kill the cgroup of worker %s: %s", worker.name, exc)
            survivors = []
        survivors += await asyncio.to_thread(worker.process.kill, children, 10.0)
        try:
            await asyncio.to_thread(worker.cgroup.remove)
        except CgroupError as exc:
            self.log.error("%s", exc)
        worker.exit_code, worker.ended = worker.process.returncode, True
        remove_files(*worker_files(worker, self.workers_dir))
        if survivors:
            raise WorkerStopError(f"processes {sorted(set(survivors))} of the worker {worker.name} survived SIGKILL")
        await self.accounts.give_back(worker.user)
        return worker.exit_code

    def reap(self, worker: Worker) -> None:
        """Reap ``worker``, whose process exited by itself: kill its cgroup
        (without one: its process group) on the spot, so processes it started
        do not keep GPU memory, and learn its exit code and, when its memory
        limit ended it, why (:func:`..host_limits.out_of_memory`). Blocking, briefly."""
        contained = worker.cgroup.confines
        if contained:
            try:
                worker.cgroup.kill(timeout=0.0)  # what its cells started goes with it; waited for at stop
            except CgroupError as exc:
                self.log.error("could not kill what the dead worker of lease %s left: %s", worker.name, exc)
        worker.process.kill_group(contained)
        worker.exit_code, worker.ended = worker.process.wait(), True
        worker.death = out_of_memory(worker.cgroup, worker.spec.host_memory, worker.exit_code)
        if worker.watcher is not None:
            worker.watcher.cancel()
        self.log.warning("the worker (pid %s) of lease %s died with exit code %s%s; its last output:\n%s",
                         worker.pid, worker.spec.lease_id, worker.exit_code,
                         f" ({worker.death})" if worker.death else "", worker.log_tail() or "(none)")


def kill_and_remove(cgroup: LeaseCgroup, timeout: float) -> None:
    """Kill ``cgroup`` and remove it; CgroupError when it cannot be."""
    cgroup.kill(timeout)
    cgroup.remove()


def worker_files(worker: Worker, workers_dir: Path) -> tuple[Path, ...]:
    """The files of ``worker`` in ``workers_dir``: its connection file, log,
    IPython history (and its journal) and lease record."""
    history = history_path(worker.log_path)
    return (Path(worker.manager.connection_file), worker.log_path, history,
            history.with_name(history.name + "-journal"),
            record_path(workers_dir, worker.spec.lease_id if worker.spec else worker.name))


def remove_files(*paths: Path) -> None:
    """Remove ``paths``; no error for one that is gone."""
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


async def quietly(awaitable: Any) -> None:
    """Await, swallowing errors: for cleanup paths that must not hide the
    error being reported."""
    try:
        await awaitable
    except Exception:  # noqa: BLE001 - cleanup only
        pass
