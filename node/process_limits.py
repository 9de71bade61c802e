"""The node's task budget: how many tasks (processes and threads) this node's
workers may have together, and each lease's worker alone, so that a cell
that forks without end stops at its own worker's limit and never takes the
node. How each limit is found and where it is written: docs/enforcement.md,
"Processes".
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass
from pathlib import Path

from .cgroups import CgroupError, Containment, LeaseCgroup
from .cgroups.mounts import MOUNTS, SELF_CGROUP, own_cgroups, read_mounts

#: The fewest tasks a lease's worker is given (a Python kernel with a few
#: threads and a DataLoader's worker processes), unless the node has fewer for workers.
MIN_WORKER_PIDS = 128
#: Where the kernel's own limits are (the seam for tests).
PROC_KERNEL = Path("/proc/sys/kernel")


@dataclass(frozen=True)
class ProcessBudget:
    """``workers``: tasks all workers of the node may have together;
    ``per_lease``: each lease's (0: its share of ``workers``); ``node_gpus``:
    the node's GPU count, what shares are of."""

    workers: int
    per_lease: int = 0
    node_gpus: int = 1

    def for_lease(self, gpus: int, fraction: float) -> int:
        """The tasks of a lease of ``gpus`` GPUs at ``fraction`` each."""
        if self.per_lease:
            return min(self.per_lease, self.workers)
        share = gpus * fraction / max(1, self.node_gpus)
        return max(min(MIN_WORKER_PIDS, self.workers), int(self.workers * min(1.0, share)))


def node_limit(*, mounts: Path = MOUNTS, self_cgroup: Path = SELF_CGROUP,
               kernel: Path = PROC_KERNEL) -> tuple[int, str]:
    """``(tasks, what sets that)``: the lowest task limit over this process
    and everything it may start (see the module's words). Blocking, brief."""
    found = []
    for name in ("pid_max", "threads-max"):
        value = _number(kernel / name)
        if value is not None:
            found.append((value, f"kernel.{name}"))
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY:
        found.append((soft, "RLIMIT_NPROC (ulimit -u)"))
    found.extend(_cgroup_limits(mounts, self_cgroup))
    return min(found, default=(1 << 22, "the kernel's most (PID_MAX_LIMIT)"))


def _cgroup_limits(mounts: Path, self_cgroup: Path) -> list[tuple[int, str]]:
    """``pids.max`` of this process's cgroup and each above it, in every hierarchy that has the file."""
    try:
        found, own = read_mounts(mounts), own_cgroups(self_cgroup)
    except OSError:
        return []
    limits = []
    for mount in found:
        place = own.get("") if mount.fstype == "cgroup2" else own.get("pids") if "pids" in mount.options else None
        if place is None:
            continue
        folder = Path(os.path.normpath(f"{mount.path}/{place.lstrip('/')}"))
        while folder != mount.path and mount.path in folder.parents:
            value = _number(folder / "pids.max")
            if value is not None:
                limits.append((value, f"pids.max of {folder}"))
            folder = folder.parent
    return limits


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def plan(cgroups: Containment, reserve: int, per_lease: int, node_gpus: int,
         log: logging.Logger) -> ProcessBudget | None:
    """The node's :class:`ProcessBudget`, its workers' cap written to the
    agent's subtree; None (after a loud warning) when this host's cgroups
    cannot hold a task limit. ``reserve``: ``c.AgentEnforcement.agent_pids_reserve``
    (at most half the node's limit is kept); ``per_lease``:
    ``c.AgentEnforcement.worker_pids_max``. Blocking, brief."""
    limit, source = node_limit()
    kept = min(reserve, limit // 2)
    if kept < reserve:
        log.warning("c.AgentEnforcement.agent_pids_reserve = %d is more than half of this node's task limit (%d, %s): "
                    "the agent keeps %d", reserve, limit, source, kept)
    workers = limit - kept
    try:
        cgroups.cap_pids(workers)
    except (CgroupError, OSError) as exc:
        log.warning("PROCESS LIMITS NOT ENFORCED: a worker that forks without end can take this node's %d tasks "
                    "(%s) from the agent and every other worker: %s", limit, source, exc)
        return None
    budget = ProcessBudget(workers, per_lease, node_gpus)
    log.info("workers may have %d tasks (processes and threads) together: the node's %d (%s) less %d kept for "
             "the agent; each lease %s", workers, limit, source, kept,
             f"{budget.per_lease} (c.AgentEnforcement.worker_pids_max)" if per_lease else
             f"its GPU share of them, at least {min(MIN_WORKER_PIDS, workers)}")
    return budget


def limit_tasks(cgroup: LeaseCgroup, lease_id: str, pids: int | None, log: logging.Logger) -> bool:
    """Write ``pids`` (tasks) to the worker's ``cgroup``; True when it holds
    (or none was asked). Logs a loud warning and returns False when this
    cgroup cannot. Blocking, brief."""
    if pids is None:
        return True
    try:
        cgroup.set_limits(pids=pids)
    except (CgroupError, OSError) as exc:
        log.warning("PROCESS LIMIT NOT ENFORCED for lease %s (%d tasks): %s", lease_id, pids, exc)
        return False
    log.info("lease %s limited to %d tasks", lease_id, pids)
    return True
