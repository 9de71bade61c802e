"""The agent's handle on one worker: its kernel manager, process, cgroup,
account, connection info and activity, and what it reports."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import IO, Any

import psutil
from jupyter_client.manager import AsyncKernelManager

from gpupool.schema import WorkerState
from gpupool.wire.nodes import WorkerReport

from ..activity import WorkerActivity
from ..cgroups import LeaseCgroup
from ..cgroups.none import GroupOnly
from ..worker_user import WorkerUser
from .kernel import connection_info
from .parkstate import ParkedInMemory
from .process import WorkerProcess
from .records import WorkerRecord
from .spec import WorkerSpec


class Worker:
    """One running (or dead) worker. Created and owned by
    :class:`~.manager.WorkerManager`.

    ``spec`` is None while the worker is warm (started ahead, bound to no
    lease); ``name`` is its lease id, or ``warm-N`` until it is bound.
    ``activity`` may be replaced (a warm worker's history is not its lease's):
    the IOPub watcher always feeds the current one. ``cgroup``: where all of
    its processes live (default: no cgroup, its process tree only).
    """

    def __init__(self, spec: WorkerSpec | None, manager: AsyncKernelManager, process: WorkerProcess,
                 log_path: Path, advertise_ip: str, name: str | None = None,
                 cgroup: LeaseCgroup | None = None) -> None:
        self.spec = spec
        self.name = name or (spec.lease_id if spec is not None else "warm")
        if cgroup is None:
            cgroup = GroupOnly(self.name)
            cgroup.add(process.pid)
        self.cgroup = cgroup
        self.user: WorkerUser | None = None  # the account it runs as, when not the agent's
        self.advertise_ip = advertise_ip
        self.manager = manager
        self.process = process
        self.log_path = log_path
        self.activity = WorkerActivity()
        self.exit_code: int | None = None
        self.ended = False  # its process is gone (a re-adopted one's exit code stays unknown)
        self.death: str | None = None  # once dead by itself: why, in words for the user (out of memory...)
        self.stopping = False  # the agent is stopping it: its exit is no death to report
        self.watcher: asyncio.Future | None = None
        self.parked: ParkedInMemory | None = None  # parked in memory: frozen, its GPU state in host memory
        # Of a worker another launcher started: its state (the record's ``launcher``), and the pids of
        # its processes outside its tree that a restarted agent must leave alone (a Slurm step's srun).
        self.launcher_state: dict | None = None
        self.helpers: set[int] = set()
        # A warm worker's shell client, opened as it started for its bind (binding.prepare); None once bound.
        self.bind_client: Any = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def on_message(self, msg: dict[str, Any]) -> None:
        """IOPub messages from :func:`~..activity.watch_iopub` go to the current activity."""
        self.activity.on_message(msg)

    @property
    def dead(self) -> bool:
        return self.ended

    def connection(self) -> dict[str, Any]:
        """The Jupyter connection info for ``POST /workers`` (``key`` as str)."""
        return connection_info(self.manager, self.advertise_ip)

    def record(self) -> WorkerRecord:
        """What a restarted agent needs to re-adopt this (bound) worker."""
        spec = self.spec
        return WorkerRecord(spec.lease_id, spec.owner, spec.gpus, spec.fraction, spec.memory, self.pid,
                            self.process.create_time(), str(self.manager.connection_file), str(self.log_path),
                            self.cgroup.name if self.cgroup.confines else "",
                            self.user.name if self.user is not None else "",
                            self.parked.to_json() if self.parked is not None else None, self.launcher_state)

    def report(self, memory_used: int | None = None) -> WorkerReport:
        """This worker as a heartbeat's WorkerReport."""
        if self.dead:
            return WorkerReport(self.spec.lease_id, self.pid, WorkerState.dead, exit_code=self.exit_code,
                                reason=self.death or self.process.exit_note)
        parked = self.parked
        return WorkerReport(self.spec.lease_id, self.pid,
                            self.activity.execution_state if parked is None else parked.execution_state,
                            idle_since=self.activity.idle_since_iso(), memory_used=memory_used,
                            cell_started=self.activity.cell_started_iso(), cells=self.activity.cells_iso(),
                            parked=None if parked is None else "memory",
                            parked_host_bytes=None if parked is None else parked.host_bytes)

    def log_tail(self, lines: int = 8) -> str:
        """The last lines the worker wrote to stdout/stderr (empty if none)."""
        return "\n".join(tail_lines(self.log_path, lines))

    def descendants(self) -> list[psutil.Process]:
        """Processes the worker started (dataloaders, compilers...), now:
        with a cgroup, every other process in it (a double-forked daemon
        too); else its process tree. Empty once the worker was reaped
        without a cgroup: its pid may belong to another process then."""
        if self.cgroup.confines:
            return _processes(self.cgroup.pids() - {self.pid})
        return self.process.children()


def _processes(pids: set[int]) -> list[psutil.Process]:
    found = []
    for pid in sorted(pids):
        try:
            found.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return found


def open_log(path: Path) -> IO[bytes]:
    """``path`` opened for appending a process's output, made readable by
    the agent's user only (a worker's output is its user's business)."""
    return open(path, "ab", opener=lambda name, flags: os.open(name, flags, 0o600))


def tail_lines(path: Path, lines: int) -> list[str]:
    """The last ``lines`` lines of the log ``path`` (none when it cannot be read)."""
    try:
        return path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return []
