"""A task limit (``pids.max``) for a worker that runs in Slurm, which sets
none itself: Slurm 22.05's cgroup plugins do not use the pids controller,
so a cell that forks without end would take the node's tasks from every
other job. The limit goes on Slurm's own cgroup of the job where its
hierarchy has the pids controller (cgroup v2 with ``pids`` enabled), else
on a cgroup of the agent's in the v1 pids hierarchy that the kernel's
processes join (v1 hierarchies are independent: its other cgroups, Slurm's,
stay as they were). docs/launchers.md, "Processes".
"""

from __future__ import annotations

from pathlib import Path

import psutil

from ....cgroups import CgroupError
from ....cgroups.files import make_dirs, procs, rmdir_tree, write
from ....cgroups.mounts import read_mounts


def limit(kernel: psutil.Process, job_id: int, step_id: int | None, pids: int, own: Path | None) -> Path:
    """Cap the tasks of ``kernel`` (a worker of Slurm job ``job_id``, or of
    its step ``step_id``) and all it starts at ``pids``; ``own``: the folder to make for it in the v1 pids
    hierarchy (None: there is none). Returns the cgroup folder written.
    CgroupError when neither Slurm's cgroup nor a v1 one can hold it. Blocking, brief."""
    slurms = _slurm_pids_cgroup(kernel.pid, job_id, step_id)
    if slurms is not None:
        write(slurms / "pids.max", str(int(pids)))
        return slurms
    if own is None:
        raise CgroupError(f"Slurm's cgroup of job {job_id} has no pids controller and this node has no v1 pids "
                          "hierarchy for one of the agent's (enable the pids controller for Slurm's cgroups)")
    make_dirs(own)
    write(own / "pids.max", str(int(pids)))  # before any process joins: none can slip past it
    try:
        tree = [kernel, *kernel.children(recursive=True)]
    except psutil.Error:
        tree = []
    for proc in tree:
        if proc.pid not in procs(own):
            write(own / "cgroup.procs", str(proc.pid))
    return own


def release(own: Path | None) -> None:
    """Remove the agent's cgroup made by :func:`limit` (after Slurm ended
    the job, so it is empty); quietly when it is gone or still in use."""
    if own is not None:
        try:
            rmdir_tree(own)
        except CgroupError:
            pass


def _slurm_pids_cgroup(pid: int, job_id: int, step_id: int | None) -> Path | None:
    """The folder of Slurm's cgroup of job ``job_id`` (of its step
    ``step_id``: a slice's own) that holds ``pid`` in
    a hierarchy with the pids controller, or None (the kernel's pids cgroup
    is not Slurm's job's: Slurm does not use that controller)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        mounts = read_mounts()
    except OSError:
        return None
    for line in lines:
        number, controllers, place = line.split(":", 2)
        for mount in mounts:
            v2 = number == "0" and not controllers and mount.fstype == "cgroup2"
            v1 = "pids" in controllers.split(",") and mount.fstype == "cgroup" and "pids" in mount.options
            if not (v2 or v1):
                continue
            folder = _job_folder(mount.path / place.lstrip("/"), job_id, step_id)
            if folder is not None and (folder / "pids.max").exists():
                return folder
    return None


def _job_folder(folder: Path, job_id: int, step_id: int | None) -> Path | None:
    """``folder``'s ancestor (or itself) that is Slurm's ``job_<job_id>``
    (``job_<job_id>/step_<step_id>`` for a step), or None."""
    for candidate in (folder, *folder.parents):
        if candidate.name == f"job_{job_id}" and step_id is None:
            return candidate
        if candidate.name == f"step_{step_id}" and candidate.parent.name == f"job_{job_id}":
            return candidate
    return None
