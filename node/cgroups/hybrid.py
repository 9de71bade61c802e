"""Host CPU, memory and task limits on a v2 lease cgroup whose hierarchy lacks
the ``cpu``, ``memory`` or ``pids`` controller, through the v1 hierarchies
of a hybrid host (cgroup2 at ``/sys/fs/cgroup/unified`` with no controllers):
a cgroup of the lease's name under the agent's v1 subtree, which the worker
joins from its first instruction (docs/enforcement.md, "Host CPU and memory").
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .contract import CgroupError
from .files import controllers, make_dirs, procs, rmdir_quietly, rmdir_tree, write
from .mounts import Mount, under
from .v1 import V1Cgroup
from .v2 import V2Cgroup, V2Containment

LIMIT_CONTROLLERS = ("cpu", "memory", "pids")


class HybridCgroup(V2Cgroup):
    """A v2 lease cgroup whose limits go to v1 where v2 lacks the controller;
    ``v1_roots``: controller -> the agent's subtree in that v1 hierarchy."""

    def __init__(self, name: str, path: Path, v1_roots: dict[str, Path]) -> None:
        super().__init__(name, path)
        self.v1 = V1Cgroup(name, {c: root / name for c, root in v1_roots.items()})

    def add(self, pid: int) -> None:
        super().add(pid)
        for path in self.v1.paths.values():  # from the first instruction: why, docs/enforcement.md
            write(path / "cgroup.procs", str(pid))

    def set_limits(self, cpu: float | None = None, memory: int | None = None, pids: int | None = None) -> None:
        asked = {"cpu": cpu, "memory": memory, "pids": pids}
        in_v2 = set((self.path / "cgroup.controllers").read_text().split())
        v2 = {c: v for c, v in asked.items() if v is not None and c in in_v2}
        v1 = {c: v for c, v in asked.items() if v is not None and c not in in_v2}
        missing = sorted(set(v1) - set(self.v1.paths))
        if missing:
            raise CgroupError(f"the {', '.join(missing)} controller is in neither the v2 hierarchy ({self.path}) "
                              "nor a v1 one (/proc/mounts)")
        if v2:
            super().set_limits(cpu=v2.get("cpu"), memory=v2.get("memory"), pids=v2.get("pids"))
        if v1:
            part = V1Cgroup(self.name, {c: self.v1.paths[c] for c in v1})
            for path in part.paths.values():
                make_dirs(path)
                # Only processes not there yet (one added before these cgroups existed, one of an
                # older agent's worker): a move costs a grace period even when it changes nothing.
                for pid in self.pids() - procs(path):
                    write(path / "cgroup.procs", str(pid))
            part.set_limits(cpu=v1.get("cpu"), memory=v1.get("memory"), pids=v1.get("pids"))

    def oom_kills(self) -> int | None:
        # memory.events exists only where v2 has the memory controller; else the v1 memory cgroup counts.
        kills = super().oom_kills()
        return kills if kills is not None else self.v1.oom_kills()

    def remove(self) -> None:
        super().remove()
        for path in self.v1.paths.values():
            if path.exists():
                rmdir_tree(path)


class HybridContainment(V2Containment):
    """:class:`.v2.V2Containment` whose cgroups are :class:`HybridCgroup`."""

    def __init__(self, root: Path, v1_roots: dict[str, Path]) -> None:
        super().__init__(root)
        self.v1_roots = v1_roots
        self.where = f"{root} (limits: {', '.join(f'{c} {p}' for c, p in v1_roots.items())})"

    def create(self, name: str) -> HybridCgroup:
        base = super().create(name)
        group = HybridCgroup(name, base.path, self.v1_roots)
        for path in group.v1.paths.values():
            make_dirs(path)  # joined at add()
        return group

    def cap_pids(self, total: int) -> None:
        if "pids" in controllers(self.root) or "pids" not in self.v1_roots:
            super().cap_pids(total)
        else:
            make_dirs(self.v1_roots["pids"])
            write(self.v1_roots["pids"] / "pids.max", str(int(total)))

    def task_root(self) -> Path | None:
        return self.v1_roots.get("pids")

    def find(self, name: str) -> HybridCgroup | None:
        return HybridCgroup(name, self.root / name, self.v1_roots) if (self.root / name).is_dir() else None

    def close(self) -> None:
        super().close()
        for root in self.v1_roots.values():
            rmdir_quietly(root)


def v2_containment(root: Path, mounts: Sequence[Mount], own: dict[str, str], relative: str) -> V2Containment:
    """The v2 containment under ``root``: hybrid when its hierarchy lacks
    ``cpu`` or ``memory`` and a v1 hierarchy (with this process in it) has it."""
    plain = V2Containment(root)  # its checks first: the errors name the v2 root
    try:
        present = set((root / "cgroup.controllers").read_text().split())
    except OSError:
        present = set()
    v1 = {}
    for controller in LIMIT_CONTROLLERS:
        mount = next((m.path for m in mounts if m.fstype == "cgroup" and controller in m.options), None)
        if controller not in present and mount is not None and controller in own:
            v1[controller] = under(mount, own[controller], relative)
    return HybridContainment(root, v1) if v1 else plain
