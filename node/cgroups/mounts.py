"""Where the cgroup hierarchies are: the host's cgroup mounts, this
process's own cgroups, and the agent's subtree in each hierarchy."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .contract import CgroupError

#: v1 controllers a lease cgroup joins when mounted; ``freezer`` is required.
V1_CONTROLLERS = ("freezer", "memory", "pids", "cpu")

#: Where the kernel lists mounts and a process's cgroups (the seams for tests).
MOUNTS = Path("/proc/mounts")
SELF_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class Mount:
    """One line of ``/proc/mounts``: where (``path``), the file system type
    (``cgroup2`` or ``cgroup``) and its options (v1: the controllers)."""

    path: Path
    fstype: str
    options: tuple[str, ...]


def read_mounts(mounts: Path = MOUNTS) -> list[Mount]:
    """The cgroup mounts of this host (v1 and v2), in ``/proc/mounts`` order."""
    found = []
    for line in mounts.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2"):
            # /proc/mounts escapes spaces and the like as octal (\040).
            path = fields[1].encode().decode("unicode_escape")
            found.append(Mount(Path(path), fields[2], tuple(fields[3].split(","))))
    return found


def own_cgroups(self_cgroup: Path = SELF_CGROUP) -> dict[str, str]:
    """This process's cgroup per hierarchy: ``{"": "/path"}`` for v2 (the
    ``0::`` line) and ``{"memory": "/path", ...}`` for each v1 controller."""
    found = {}
    for line in self_cgroup.read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if number == "0" and not controllers:
            found[""] = path
        for name in controllers.split(","):
            if name:
                found[name] = path
    return found


def default_root(state_dir: str | os.PathLike) -> str:
    """The relative subtree name an agent with ``state_dir`` uses under its
    own cgroup: ``gpupool/agent-<hash>``, the same after every restart."""
    digest = hashlib.sha256(os.path.realpath(state_dir).encode()).hexdigest()[:12]
    return f"gpupool/agent-{digest}"


def under(mount: Path, own: str, relative: str) -> Path:
    base = relative if relative.startswith("/") else f"{own.rstrip('/')}/{relative}"
    path = Path(os.path.normpath(f"{mount}/{base.lstrip('/')}"))
    if mount != path and mount not in path.parents:
        raise CgroupError(f"the cgroup root {relative!r} leads out of {mount}")
    return path


def v2_root(mounts: Sequence[Mount], own: dict[str, str], relative: str) -> Path:
    mount = next((m.path for m in mounts if m.fstype == "cgroup2"), None)
    if mount is None:
        raise CgroupError("no cgroup2 file system is mounted (/proc/mounts)")
    if "" not in own:
        raise CgroupError("this process is in no cgroup v2 (/proc/self/cgroup has no 0:: line)")
    return under(mount, own[""], relative)


def v1_roots(mounts: Sequence[Mount], own: dict[str, str], relative: str) -> dict[str, Path]:
    roots = {}
    for controller in V1_CONTROLLERS:
        mount = next((m.path for m in mounts if m.fstype == "cgroup" and controller in m.options), None)
        if mount is not None and controller in own and controller not in roots:
            roots[controller] = under(mount, own[controller], relative)
    if "freezer" not in roots:
        raise CgroupError("the v1 freezer controller is not mounted (/proc/mounts)")
    return roots

