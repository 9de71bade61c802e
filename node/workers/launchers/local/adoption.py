"""What a restarted agent finds of the host processes an earlier run of the
``local`` launcher started (:meth:`.launcher.LocalLauncher.adopt` and
:meth:`~.launcher.LocalLauncher.sweep`).

A record's worker (:class:`~...records.WorkerRecord`) is looked for in the
cgroup the record names (its pid there, with the recorded start time), and
every other cgroup of the agent's subtree is killed and removed, whatever
its processes call themselves. Without a cgroup (an agent run with
``cgroup_mode = "none"``) the worker is its pid with its connection file on
its command line, and the strays are found by command line and process group.
"""

from __future__ import annotations

import asyncio
import logging

import psutil

from ....cgroups import CgroupError, Containment
from ...process import running
from ...records import WorkerRecord
from ...stopping import kill_and_remove


def recorded_process(record: WorkerRecord, cgroup_pids: set[int] | None = None) -> psutil.Process | None:
    """The worker process of ``record`` if it still runs (same pid, same
    start time) where it should: in ``cgroup_pids`` (the pids of its
    cgroup), or, without a cgroup (None), with its connection file on its
    command line. Else None."""
    if cgroup_pids is not None and record.pid not in cgroup_pids:
        return None
    try:
        proc = psutil.Process(record.pid)
        if abs(proc.create_time() - record.create_time) > 0.01 or not running(proc):
            return None
        if cgroup_pids is not None:
            return proc
        return proc if any(record.connection_file in arg for arg in proc.cmdline()) else None
    except psutil.Error:
        return None


async def kill_stray_cgroups(cgroups: Containment, keep: set[str], log: logging.Logger) -> None:
    """Kill and remove every cgroup of the agent's subtree not in ``keep``."""
    for name in cgroups.names():
        if name in keep or (cgroup := cgroups.find(name)) is None:
            continue
        pids = sorted(cgroup.pids())
        if pids:
            log.warning("killing cgroup %s an earlier run of the agent left: pids %s", name, ", ".join(map(str, pids)))
        try:
            await asyncio.to_thread(kill_and_remove, cgroup, 10.0)
        except CgroupError as exc:
            log.error("%s", exc)
