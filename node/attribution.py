"""Which worker uses which GPU memory: process trees and PID namespaces.

NVML reports each process on a GPU by its PID in the *host's* PID namespace
(the driver knows no other), also when the caller runs in a container
(NVIDIA's container toolkit issue #179; nvidia-smi inside a container shows
host PIDs or none for the same reason). The agent knows its workers by the
PIDs of its own namespace. :class:`PidMapper` translates between the two with
the ``NSpid`` line of ``/proc/PID/status`` (proc(5): the PID in each PID
namespace the process is in, outermost first), and :func:`attribute` sums a
worker's usage over its whole process tree (dataloaders, compilers, anything
the kernel started). PIDs that belong to no worker are *unattributed*: their
memory still counts as used on that GPU (placement must not hand it out).

Everything here reads files under a procfs root, so the tests run it on a
literal directory tree as well as on the real ``/proc``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

log = logging.getLogger("gpupool.agent")

# The inode of the initial (host) PID namespace: PROC_PID_INIT_INO in the
# kernel's include/linux/proc_ns.h; stable since Linux 3.8.
HOST_PID_NAMESPACE_INODE = 0xEFFFFFFC


@dataclass(frozen=True)
class ProcInfo:
    """One process as a procfs shows it: ``pid`` and ``ppid`` in that procfs's
    namespace, ``nspid`` the PID in each namespace from that procfs's own down
    to the process's (``NSpid`` of proc(5); just ``(pid,)`` on kernels before
    4.1), ``start_time`` in clock ticks after boot (field 22 of
    ``/proc/PID/stat``), which tells a PID apart from a later reuse of it."""

    pid: int
    ppid: int
    nspid: tuple[int, ...]
    start_time: int


def read_proc(proc_root: str | os.PathLike, pid: int | str) -> ProcInfo | None:
    """The process ``pid`` (or ``"self"``) under ``proc_root``; None when it does
    not exist (any more) or cannot be read."""
    base = Path(proc_root) / str(pid)
    try:
        status = (base / "status").read_text()
        stat = (base / "stat").read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in status.splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.strip()
    try:
        # comm may hold spaces and ')': the fields after the last ')' are fixed.
        after = stat[stat.rindex(")") + 2:].split()
        start_time = int(after[19])
        own = int(fields["Pid"])
        nspid = tuple(int(p) for p in fields.get("NSpid", str(own)).split())
        return ProcInfo(own, int(fields["PPid"]), nspid, start_time)
    except (KeyError, ValueError, IndexError):
        return None


def read_parents(proc_root: str | os.PathLike = "/proc") -> dict[int, int]:
    """pid -> parent pid of every process visible under ``proc_root`` now."""
    parents = {}
    try:
        names = os.listdir(proc_root)
    except OSError:
        return {}
    for name in names:
        if name.isdigit():
            info = read_proc(proc_root, name)
            if info is not None:
                parents[info.pid] = info.ppid
    return parents


def in_host_pid_namespace(proc_root: str | os.PathLike = "/proc") -> bool:
    """True when this process runs in the host's PID namespace, where NVML's
    PIDs are our PIDs. False in a container (or when it cannot be told)."""
    try:
        return os.stat(Path(proc_root) / "self" / "ns" / "pid").st_ino == HOST_PID_NAMESPACE_INODE
    except OSError:
        return False


class PidMapper:
    """Maps PIDs as NVML reports them (host namespace) to PIDs in the agent's
    namespace.

    ``host_proc``: where the host's procfs is mounted inside the agent's
    container (e.g. ``/host/proc``), or None. ``local_proc``: the agent's own
    procfs (``/proc``).

    - Agent in the host PID namespace (``host_proc`` None): NVML's PIDs are
      ours; a PID maps to itself while the process exists.
    - Agent in a container with ``host_proc``: the host's ``NSpid`` of a
      process lists its PID at every level; the entry at the agent's level is
      its local PID. The agent's level is found once from its own entry in
      ``host_proc`` (the one whose ``NSpid`` ends with ours and that started
      at the same tick). A mapping is accepted only when the local process
      has the same ``NSpid`` tail and start time, so a process of a sibling
      container that happens to have the same local PID is never taken.
    - Agent in a container without ``host_proc``: nothing maps; ``problem``
      says why and how to fix it (run the agent with the host PID namespace,
      e.g. ``hostPID: true``, or mount the host's /proc and set
      ``c.AgentInventory.host_proc``).
    """

    def __init__(self, host_proc: str | os.PathLike | None = None, local_proc: str | os.PathLike = "/proc",
                 host_namespace: bool | None = None) -> None:
        self.host_proc = Path(host_proc) if host_proc else None
        self.local_proc = Path(local_proc)
        # host_namespace: whether local_proc is the host's namespace; None = look.
        self._host_namespace = in_host_pid_namespace(local_proc) if host_namespace is None else host_namespace
        self._depth: int | None = None
        self.problem: str | None = None
        if self.host_proc is None and not self._host_namespace:
            self.problem = ("the agent runs in its own PID namespace, so the PIDs NVML reports (the host's) are "
                            "not its own: run it in the host PID namespace (hostPID: true) or mount the host's "
                            "/proc and set c.AgentInventory.host_proc")

    def _agent_depth(self) -> int | None:
        """How many namespace levels lie between the host and the agent."""
        if self._depth is None and self.host_proc is not None:
            me = read_proc(self.local_proc, "self")
            if me is None:
                self.problem = f"cannot read {self.local_proc}/self"
                return None
            for name in _listdir(self.host_proc):
                if not name.isdigit():
                    continue
                info = read_proc(self.host_proc, name)
                if info and info.start_time == me.start_time and info.nspid[-len(me.nspid):] == me.nspid:
                    self._depth = len(info.nspid) - len(me.nspid)
                    break
            else:
                self.problem = f"the agent's own process is not in {self.host_proc}: is it the host's /proc?"
        return self._depth

    def to_local(self, pids: Iterable[int]) -> dict[int, int]:
        """NVML pid -> local pid, for those of ``pids`` that live in the agent's
        namespace (or one below it). Others are absent."""
        pids = list(pids)
        if self.host_proc is None:
            if not self._host_namespace:
                return {}
            return {pid: pid for pid in pids if (self.local_proc / str(pid)).exists()}
        depth = self._agent_depth()
        if depth is None:
            return {}
        found = {}
        for pid in pids:
            outer = read_proc(self.host_proc, pid)
            if outer is None or len(outer.nspid) <= depth:
                continue
            local = read_proc(self.local_proc, outer.nspid[depth])
            if local and local.nspid == outer.nspid[depth:] and local.start_time == outer.start_time:
                found[pid] = local.pid
        return found


@dataclass(frozen=True)
class GPUProcess:
    """One process on one GPU as NVML reports it: ``gpu`` the GPU's (or MIG
    instance's) UUID, ``pid`` as NVML gives it (host namespace), ``local_pid``
    in the agent's namespace (None when it maps to none), ``memory`` in bytes
    (None when NVML cannot tell), ``sm_util`` percent from the latest
    utilization sample (None without one)."""

    gpu: str
    pid: int
    local_pid: int | None
    memory: int | None
    sm_util: int | None = None


@dataclass
class Attribution:
    """The result of :func:`attribute`: per lease, bytes per GPU UUID and the
    local PIDs found on a GPU; the processes of no worker."""

    memory: dict[str, dict[str, int]] = field(default_factory=dict)
    pids: dict[str, list[int]] = field(default_factory=dict)
    unattributed: list[GPUProcess] = field(default_factory=list)

    def worker_memory(self, lease_id: str) -> int | None:
        """Bytes the lease's worker tree uses over all GPUs; None when none of
        its processes is on a GPU with a known amount."""
        per_gpu = self.memory.get(lease_id)
        return sum(per_gpu.values()) if per_gpu else None

    def unattributed_memory(self) -> dict[str, int]:
        """GPU UUID -> bytes used by processes of no worker (known amounts only)."""
        total: dict[str, int] = {}
        for proc in self.unattributed:
            if proc.memory is not None:
                total[proc.gpu] = total.get(proc.gpu, 0) + proc.memory
        return total


def memory_by_pid(processes: Iterable[GPUProcess]) -> dict[int, int]:
    """GPU bytes per *local* pid (the agent's namespace), summed over all GPUs;
    processes that map to no local pid or whose memory is unknown are absent."""
    used: dict[int, int] = {}
    for proc in processes:
        if proc.local_pid is not None and proc.memory is not None:
            used[proc.local_pid] = used.get(proc.local_pid, 0) + proc.memory
    return used


def attribute(processes: Sequence[GPUProcess], roots: Mapping[str, int], parents: Mapping[int, int]) -> Attribution:
    """Assign each GPU process to the worker whose process tree holds it.

    ``roots``: lease id -> the worker's local PID; ``parents``: local pid ->
    parent pid (see :func:`read_parents`). A process belongs to a lease when
    walking up its parents reaches that lease's root. Pure: no I/O.
    """
    owner_of_root = {pid: lease for lease, pid in roots.items()}
    result = Attribution()
    for proc in processes:
        lease = _owner(proc.local_pid, owner_of_root, parents)
        if lease is None:
            result.unattributed.append(proc)
            continue
        result.pids.setdefault(lease, [])
        if proc.local_pid not in result.pids[lease]:
            result.pids[lease].append(proc.local_pid)
        if proc.memory is not None:
            per_gpu = result.memory.setdefault(lease, {})
            per_gpu[proc.gpu] = per_gpu.get(proc.gpu, 0) + proc.memory
    return result


def _owner(pid: int | None, owner_of_root: Mapping[int, str], parents: Mapping[int, int]) -> str | None:
    seen = set()
    while pid is not None and pid > 0 and pid not in seen:
        if pid in owner_of_root:
            return owner_of_root[pid]
        seen.add(pid)
        pid = parents.get(pid)
    return None


def add_unattributed(metrics: list[dict], attribution: Attribution, known: Iterable[str] | None = None) -> list[dict]:
    """The heartbeat's GPU readings with ``memory_unattributed``: bytes used
    by processes of no worker (0 when none), or None on GPUs not in ``known``
    (those whose process list NVML could not give; default: all known).
    Changes and returns ``metrics``."""
    unattributed = attribution.unattributed_memory()
    known = None if known is None else set(known)
    for reading in metrics:
        uuid = reading["uuid"]
        reading["memory_unattributed"] = (unattributed.get(uuid, 0) if known is None or uuid in known else None)
    return metrics


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
