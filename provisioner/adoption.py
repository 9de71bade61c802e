"""Workers that outlive their agent, and the agent that finds them again.

Workers are started independent of the agent (no ipykernel parent poller),
so a crashed or killed agent does not take the users' variables with it.
For each lease's worker the agent keeps a :class:`WorkerRecord` next to the
worker's connection file (``STATE_DIR/workers/LEASE.lease.json``: lease,
slice, pid, the process's start time and its cgroup). A restarted agent
reads them (:meth:`~.workers.WorkerManager.recover`): a worker still running
is re-adopted and reported to the service, which keeps its lease or tells
the agent to stop it; every other process a previous run started (warm
workers, workers of no record, what a dead worker's cells left behind) is
killed. With cgroups (:mod:`.cgroups`) the worker is looked for in the
cgroup its record names, and "every other process" is every other cgroup of
the agent's subtree; the command-line and process-group searches below are
for processes in no cgroup (an agent run with ``cgroup_mode = "none"``).

A re-adopted worker is not this process's child: :class:`AdoptedProcess`
watches it through psutil, which compares the process's start time, so a
reused pid is never taken for it. Its exit code is known only to its parent
(init, by then), so it is reported dead without one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from gpupool.schema import GPUInfo

RECORD_SUFFIX = ".lease.json"

#: The mark of a worker started under a state dir: its connection file's name.
CONNECTION_PREFIX = "kernel-"


@dataclass(frozen=True)
class WorkerRecord:
    """What a restarted agent needs to re-adopt a lease's worker: the slice
    (``lease_id``, ``owner``, ``gpus``, ``fraction``, ``memory`` bytes), the
    process (``pid`` and ``create_time``, psutil's epoch seconds) and its files
    (``connection_file``, ``log_path``) and its ``cgroup``'s name under the
    agent's subtree (empty: it has none) and the ``user`` it runs as, when
    it is one of a pool's (empty: not)."""

    lease_id: str
    owner: str
    gpus: tuple[GPUInfo, ...]
    fraction: float
    memory: int
    pid: int
    create_time: float
    connection_file: str
    log_path: str
    cgroup: str = ""
    user: str = ""

    def write(self, workers_dir: Path) -> None:
        """Write the record atomically, readable by the agent's user only."""
        body = {**asdict(self), "gpus": [gpu.to_json() for gpu in self.gpus]}
        target = record_path(workers_dir, self.lease_id)
        tmp = target.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(body, out)
        tmp.replace(target)

    @classmethod
    def read(cls, path: Path) -> "WorkerRecord":
        """Read one record; ValueError (or OSError) when it is not one."""
        body = json.loads(path.read_text())
        try:
            gpus = tuple(GPUInfo.from_json(gpu) for gpu in body["gpus"])
            return cls(lease_id=str(body["lease_id"]), owner=str(body["owner"]), gpus=gpus,
                       fraction=float(body["fraction"]), memory=int(body["memory"]), pid=int(body["pid"]),
                       create_time=float(body["create_time"]), connection_file=str(body["connection_file"]),
                       log_path=str(body["log_path"]), cgroup=_cgroup_name(body.get("cgroup", "")),
                       user=str(body.get("user", "")))
        except Exception as exc:  # KeyError, TypeError, GPUPoolError: all mean "not a record"
            raise ValueError(f"{path} is not a worker record: {exc}") from None

    def process(self, cgroup_pids: set[int] | None = None) -> psutil.Process | None:
        """The recorded worker process if it still runs (same pid, same start
        time) where it should: in ``cgroup_pids`` (the pids of its cgroup),
        or, without a cgroup (None), with its connection file on its command
        line. Else None."""
        if cgroup_pids is not None and self.pid not in cgroup_pids:
            return None
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > 0.01 or not _running(proc):
                return None
            if cgroup_pids is not None:
                return proc
            return proc if any(self.connection_file in arg for arg in proc.cmdline()) else None
        except psutil.Error:
            return None


def _cgroup_name(value: object) -> str:
    """A record's cgroup name: one directory name, never a path."""
    name = str(value)
    if name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"{name!r} is not a cgroup name")
    return name


def record_path(workers_dir: Path, lease_id: str) -> Path:
    """Where the record of ``lease_id``'s worker lives."""
    return workers_dir / f"{lease_id}{RECORD_SUFFIX}"


def read_records(workers_dir: Path) -> tuple[list[WorkerRecord], list[str]]:
    """Every record under ``workers_dir``: ``(records, problems)``, where a
    problem names a file that could not be read (it is left out)."""
    records, problems = [], []
    for path in sorted(workers_dir.glob(f"*{RECORD_SUFFIX}")):
        try:
            records.append(WorkerRecord.read(path))
        except (OSError, ValueError) as exc:
            problems.append(str(exc))
    return records, problems


def create_time(pid: int) -> float:
    """psutil's start time of ``pid`` (epoch seconds); 0.0 when it is gone."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


class AdoptedProcess:
    """A worker process started by an earlier run of the agent: the part of
    ``subprocess.Popen`` that the worker code uses (``pid``, ``returncode``,
    ``wait``), on a psutil handle. ``returncode`` stays None while
    it runs; afterwards it is None too, since only the process's parent
    learns its exit status: ask :attr:`gone`."""

    returncode = None

    def __init__(self, proc: psutil.Process) -> None:
        self.proc = proc
        self.pid = proc.pid

    @property
    def gone(self) -> bool:
        return not _running(self.proc)

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the process has exited; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        try:
            self.proc.wait(timeout)
        except psutil.TimeoutExpired:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0) from None
        except psutil.Error:
            pass

    def children(self) -> list[psutil.Process]:
        try:
            return self.proc.children(recursive=True) if not self.gone else []
        except psutil.Error:
            return []


def stray_workers(workers_dir: Path, keep: set[int]) -> list[psutil.Process]:
    """Live worker processes of ``workers_dir`` (their command line names a
    connection file there) whose pid is not in ``keep``."""
    mark = f"{workers_dir}{os.sep}{CONNECTION_PREFIX}"
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid not in keep and proc.pid != os.getpid() and _running(proc) and \
                    any(mark in arg for arg in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def left_behind(pgid: int, since: float) -> list[psutil.Process]:
    """Live processes of process group ``pgid`` started at or after ``since``
    (epoch seconds): what a dead worker (a session leader, so its pid is the
    group's id) started and left running."""
    found = []
    for proc in psutil.process_iter(["pid", "create_time"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["create_time"] >= since - 0.01 and _running(proc):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def kill_all(procs: list[psutil.Process], timeout: float = 10.0) -> list[int]:
    """SIGKILL ``procs``, their process groups while their leader still
    runs, and their descendants; wait up to ``timeout`` seconds. Returns the
    pids still alive (stuck in the kernel, say)."""
    targets: dict[int, psutil.Process] = {}
    for proc in procs:
        targets[proc.pid] = proc
        try:
            targets.update({child.pid: child for child in proc.children(recursive=True)})
        except psutil.Error:
            pass
    for proc in procs:
        if _running(proc):
            try:
                # A live leader: its pid, and so its group id, cannot be reused yet.
                if os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
    for proc in targets.values():
        try:
            proc.kill()  # psutil checks the start time: never a reused pid
        except psutil.Error:
            pass
    deadline = time.monotonic() + timeout
    alive = [proc for proc in targets.values() if _running(proc)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [proc for proc in alive if _running(proc)]
    return [proc.pid for proc in alive]


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
