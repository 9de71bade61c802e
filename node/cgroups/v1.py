"""cgroup v1: lease cgroups in the ``freezer`` hierarchy (which makes the
kill race-free) and in ``memory``, ``pids`` and ``cpu`` where mounted."""

from __future__ import annotations

import time
from pathlib import Path

from .contract import CgroupError, Containment, LeaseCgroup
from .files import (POLL_S, counter, fresh, live, make_dirs, procs, rmdir_quietly, rmdir_tree, sigkill, subdirs,
                    wait_empty, wait_until, write)


class V1Cgroup(LeaseCgroup):
    """A cgroup in several v1 hierarchies: ``paths`` maps controller ->
    directory; ``freezer`` is always among them."""

    kind = "v1"
    confines = True
    freeze_method = "cgroup v1 freezer.state"

    def __init__(self, name: str, paths: dict[str, Path]) -> None:
        super().__init__(name)
        self.paths = paths

    @property
    def freezer(self) -> Path:
        return self.paths["freezer"]

    def add(self, pid: int) -> None:
        for path in self.paths.values():
            write(path / "cgroup.procs", str(pid))

    def pids(self) -> set[int]:
        return live(procs(self.freezer))

    def kill(self, timeout: float = 10.0) -> list[int]:
        if not self.freezer.exists():
            return []
        deadline = time.monotonic() + timeout
        try:
            while self.pids():  # one round at least, whatever the deadline
                # Frozen, nothing forks between the listing and the kill; the
                # SIGKILLs are delivered at the thaw.
                self._freeze(deadline)
                sigkill(procs(self.freezer, "tasks"))
                write(self.freezer / "freezer.state", "THAWED")
                if not wait_empty(self.pids, min(deadline, time.monotonic() + 0.5)) or \
                        time.monotonic() >= deadline:
                    break
        finally:
            if self.freezer.exists():
                write(self.freezer / "freezer.state", "THAWED")
        return wait_empty(self.pids, deadline)

    def _freeze(self, deadline: float) -> None:
        write(self.freezer / "freezer.state", "FROZEN")
        # FREEZING until every task stopped; a task in uninterruptible sleep can keep it there.
        while (self.freezer / "freezer.state").read_text().strip() != "FROZEN" and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def remove(self) -> None:
        for path in self.paths.values():
            rmdir_tree(path)

    def freeze(self, timeout: float = 10.0) -> None:
        write(self.freezer / "freezer.state", "FROZEN")
        if not wait_until(self.frozen, timeout):
            self.thaw()
            raise CgroupError(f"the processes of {self.freezer} did not freeze within {timeout:g}s (one may be "
                              f"stuck in the kernel); they run on")

    def thaw(self) -> None:
        if self.freezer.exists():
            write(self.freezer / "freezer.state", "THAWED")

    def frozen(self) -> bool:
        try:  # FREEZING until every task has stopped
            return (self.freezer / "freezer.state").read_text().strip() == "FROZEN"
        except OSError:
            return False

    def set_limits(self, cpu: float | None = None, memory: int | None = None, pids: int | None = None) -> None:
        for name, value in (("memory", memory), ("cpu", cpu), ("pids", pids)):
            if value is not None and name not in self.paths:
                raise CgroupError(f"the v1 {name} controller is not mounted on this node (/proc/mounts)")
        if pids is not None:
            write(self.paths["pids"] / "pids.max", str(int(pids)))
        if memory is not None:
            write(self.paths["memory"] / "memory.limit_in_bytes", str(int(memory)))
        if cpu is not None:
            write(self.paths["cpu"] / "cpu.cfs_period_us", "100000")
            write(self.paths["cpu"] / "cpu.cfs_quota_us", str(max(1000, int(cpu * 100_000))))

    def oom_kills(self) -> int | None:
        if "memory" not in self.paths:
            return None
        kills = counter(self.paths["memory"] / "memory.oom_control", "oom_kill")
        if kills is None:
            # Before Linux 4.13 no oom_kill line: the times usage hit the limit is the nearest sign
            # (without swap, a process that keeps asking past it is OOM-killed).
            kills = counter(self.paths["memory"] / "memory.failcnt", "")
        return kills


class V1Containment(Containment):
    """Lease cgroups under ``roots`` (controller -> absolute directory)."""

    mode = "v1"

    def __init__(self, roots: dict[str, Path]) -> None:
        if "freezer" not in roots:
            raise CgroupError("the v1 freezer controller is not mounted (/proc/mounts): without it a kill races "
                              "with forks")
        self.roots = roots
        self.where = ", ".join(str(path) for path in roots.values())
        for path in roots.values():
            make_dirs(path)

    def cap_pids(self, total: int) -> None:
        if "pids" not in self.roots:
            raise CgroupError("the v1 pids controller is not mounted on this node (/proc/mounts)")
        write(self.roots["pids"] / "pids.max", str(int(total)))

    def task_root(self) -> Path | None:
        return self.roots.get("pids")

    def create(self, name: str) -> V1Cgroup:
        group = V1Cgroup(name, {controller: root / name for controller, root in self.roots.items()})
        fresh(group, *group.paths.values())
        return group

    def find(self, name: str) -> V1Cgroup | None:
        if not (self.roots["freezer"] / name).is_dir():
            return None
        return V1Cgroup(name, {controller: root / name for controller, root in self.roots.items()})

    def names(self) -> list[str]:
        return sorted(set().union(*(subdirs(root) for root in self.roots.values())))

    def close(self) -> None:
        for root in self.roots.values():
            rmdir_quietly(root)

