"""cgroup v2: lease cgroups in the unified hierarchy, killed with
``cgroup.kill`` (Linux 5.14+) or, before it, by freezing and SIGKILL."""

from __future__ import annotations

import time
from pathlib import Path

from .contract import CgroupError, Containment, LeaseCgroup
from .files import (POLL_S, controllers, counter, fresh, live, make_dirs, procs, rmdir_quietly, rmdir_tree, sigkill,
                    subdirs, wait_empty, wait_until, write)


class V2Cgroup(LeaseCgroup):
    """A cgroup of the unified hierarchy at ``path``."""

    kind = "v2"
    confines = True
    freeze_method = "cgroup v2 cgroup.freeze"

    def __init__(self, name: str, path: Path) -> None:
        super().__init__(name)
        self.path = path

    def add(self, pid: int) -> None:
        write(self.path / "cgroup.procs", str(pid))

    def pids(self) -> set[int]:
        return live(procs(self.path))

    def kill(self, timeout: float = 10.0) -> list[int]:
        if not self.path.exists():
            return []
        deadline = time.monotonic() + timeout
        if (self.path / "cgroup.kill").exists():
            # One write kills the subtree, forks in flight included (Linux 5.14+).
            write(self.path / "cgroup.kill", "1")
        else:
            self._freeze_and_kill(deadline)
        return wait_empty(self.pids, deadline)

    def _freeze_and_kill(self, deadline: float) -> None:
        # Frozen, nothing can fork; SIGKILL reaches frozen tasks in v2.
        write(self.path / "cgroup.freeze", "1")
        try:
            while pids := self.pids():  # one round at least, whatever the deadline
                sigkill(pids)
                if time.monotonic() >= deadline:
                    break
                time.sleep(POLL_S)
        finally:
            if self.path.exists():
                write(self.path / "cgroup.freeze", "0")

    def remove(self) -> None:
        rmdir_tree(self.path)

    def freeze(self, timeout: float = 10.0) -> None:
        write(self.path / "cgroup.freeze", "1")
        # Frozen once cgroup.events says so: every task has stopped (cgroup-v2.rst, "Freezer").
        if not wait_until(lambda: counter(self.path / "cgroup.events", "frozen") == 1, timeout):
            self.thaw()
            raise CgroupError(f"the processes of {self.path} did not freeze within {timeout:g}s (one may be stuck "
                              f"in the kernel); they run on")

    def thaw(self) -> None:
        if self.path.exists():
            write(self.path / "cgroup.freeze", "0")

    def frozen(self) -> bool:
        return counter(self.path / "cgroup.freeze", "") == 1

    def set_limits(self, cpu: float | None = None, memory: int | None = None, pids: int | None = None) -> None:
        wanted = [name for name, value in (("cpu", cpu), ("memory", memory), ("pids", pids)) if value is not None]
        available = controllers(self.path)
        missing = [name for name in wanted if name not in available]
        if missing:
            raise CgroupError(f"the {', '.join(missing)} controller is not enabled for {self.path} (it has: "
                              f"{' '.join(sorted(available)) or 'none'}): enable it in the parent's "
                              f"cgroup.subtree_control (systemd: Delegate=yes on the agent's unit, and the agent "
                              f"in a leaf cgroup of its own)")
        if memory is not None:
            write(self.path / "memory.max", str(int(memory)))
        if cpu is not None:
            write(self.path / "cpu.max", f"{max(1000, int(cpu * 100_000))} 100000")
        if pids is not None:
            write(self.path / "pids.max", str(int(pids)))

    def oom_kills(self) -> int | None:
        # Its subtree's kills, by its own limit or the host's (no memory.events without the controller).
        return counter(self.path / "memory.events", "oom_kill")


class V2Containment(Containment):
    """Lease cgroups under ``root`` (an absolute directory in the cgroup2 mount)."""

    mode = "v2"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.where = str(root)
        make_dirs(root)
        if not (root / "cgroup.kill").exists() and not (root / "cgroup.freeze").exists():
            raise CgroupError(f"{root} has neither cgroup.kill nor cgroup.freeze (Linux 5.2+ is needed)")

    def cap_pids(self, total: int) -> None:
        if "pids" not in controllers(self.root):
            raise CgroupError(f"the pids controller is not enabled for {self.root} (enable it in its parent's "
                              "cgroup.subtree_control; systemd: Delegate=yes)")
        write(self.root / "pids.max", str(int(total)))
        if "pids" not in set((self.root / "cgroup.subtree_control").read_text().split()):
            # The lease cgroups below need it for pids.max of their own; the root holds no process.
            write(self.root / "cgroup.subtree_control", "+pids")

    def create(self, name: str) -> V2Cgroup:
        group = V2Cgroup(name, self.root / name)
        fresh(group, group.path)
        return group

    def find(self, name: str) -> V2Cgroup | None:
        return V2Cgroup(name, self.root / name) if (self.root / name).is_dir() else None

    def names(self) -> list[str]:
        return subdirs(self.root)

    def close(self) -> None:
        rmdir_quietly(self.root)

