"""The records a restarted agent finds its workers by.

Workers are started independent of the agent (no ipykernel parent poller),
so a crashed or killed agent does not take the users' variables with it.
For each lease's worker the agent keeps a :class:`WorkerRecord` next to the
worker's connection file (``STATE_DIR/workers/LEASE.lease.json``: lease,
slice, pid, the process's start time and its cgroup and account, or the
state of the launcher that started it); a restarted agent reads them
(:mod:`.recovery`) and its launcher re-adopts each record's worker.
:func:`stray_workers` finds the kernel processes of this host that no kept
worker is, by their command line (the connection file under the workers
folder): the ``local`` launcher's in no cgroup, and a Slurm step's kernel and
srun on the agent's node; the launchers' sweeps kill them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from gpupool.wire.nodes import GPUInfo

from .process import running
from .spec import LeaseSlice

RECORD_SUFFIX = ".lease.json"

#: The mark of a worker started under a state dir: its connection file's name.
CONNECTION_PREFIX = "kernel-"


@dataclass(frozen=True)
class WorkerRecord(LeaseSlice):
    """What a restarted agent needs to re-adopt a lease's worker: the slice
    (:class:`~.spec.LeaseSlice`), the process (``pid`` and ``create_time``,
    psutil's epoch seconds), its files (``connection_file``, ``log_path``),
    its ``cgroup``'s name under the agent's subtree (empty: it has none),
    the ``user`` it runs as, when it is one of a pool's (empty: not), and
    ``launcher``: the launcher's own state of a worker another launcher than
    ``local`` started (a Slurm job's :class:`~.launchers.slurm.SlurmWorkerRecord`;
    None: a host process of the agent's), which re-adopts it."""

    pid: int
    create_time: float
    connection_file: str
    log_path: str
    cgroup: str = ""
    user: str = ""
    parked: dict | None = None
    launcher: dict | None = None

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
                       user=str(body.get("user", "")), parked=_parked(body.get("parked")),
                       launcher=_parked(body.get("launcher")))
        except Exception as exc:  # KeyError, TypeError, GPUPoolError: all mean "not a record"
            raise ValueError(f"{path} is not a worker record: {exc}") from None


def _parked(value: object) -> dict | None:
    """An object of a record (``parked``, ``launcher``), or None."""
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"an object was expected, got {value!r:.40}")
    return value


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


def stray_workers(workers_dir: Path, keep: set[int]) -> list[psutil.Process]:
    """Live worker processes of ``workers_dir`` (their command line names a
    connection file there) whose pid is not in ``keep``."""
    mark = f"{workers_dir}{os.sep}{CONNECTION_PREFIX}"
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid not in keep and proc.pid != os.getpid() and running(proc) and \
                    any(mark in arg for arg in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            continue
    return found
