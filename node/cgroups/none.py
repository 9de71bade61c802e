"""No cgroup: the weaker containment of a worker's process group and the
descendants seen at kill time (docs/security.md, "Containment")."""

from __future__ import annotations

import logging
import os
import signal
import time

import psutil

from .contract import CgroupError, Containment, LeaseCgroup
from .files import live, wait_empty, wait_until


class GroupOnly(LeaseCgroup):
    """No cgroup: the worker's process group and the descendants of the
    processes added, as found at kill time (the weaker mode)."""

    confines = False
    freeze_method = ("SIGSTOP of its process group and tree (no cgroup: a process that left them runs on, and "
                     "anyone allowed to signal them can resume them)")

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._leaders: list[psutil.Process] = []
        self._stopped: list[psutil.Process] = []

    def add(self, pid: int) -> None:
        try:
            self._leaders.append(psutil.Process(pid))
        except psutil.Error:
            pass

    def _tree(self) -> list[psutil.Process]:
        found = {}
        for leader in self._leaders:
            try:
                if leader.is_running():
                    found[leader.pid] = leader
                    found.update({child.pid: child for child in leader.children(recursive=True)})
            except psutil.Error:
                continue
        return list(found.values())

    def pids(self) -> set[int]:
        return live(proc.pid for proc in self._tree())

    def kill(self, timeout: float = 10.0) -> list[int]:
        tree = self._tree()
        for leader in self._leaders:
            try:
                if leader.is_running() and os.getpgid(leader.pid) == leader.pid:
                    os.killpg(leader.pid, signal.SIGKILL)
            except (OSError, psutil.Error):
                pass
        for proc in tree:
            try:
                proc.kill()  # psutil checks the start time: never a reused pid
            except psutil.Error:
                pass
        deadline = time.monotonic() + timeout
        return wait_empty(lambda: live(proc.pid for proc in tree if proc.is_running()), deadline)

    def remove(self) -> None:
        self._leaders.clear()

    def freeze(self, timeout: float = 10.0) -> None:
        tree = self._tree()
        self._signal(tree, signal.SIGSTOP)
        self._stopped = tree
        if not wait_until(lambda: all(_stopped(proc) for proc in tree), timeout):
            self.thaw()
            raise CgroupError(f"the processes of {self.name} did not stop within {timeout:g}s; they run on")

    def thaw(self) -> None:
        # The leaders' trees again: after an agent restart this handle never stopped them itself.
        self._signal({p.pid: p for p in [*self._stopped, *self._tree()]}.values(), signal.SIGCONT)
        self._stopped = []

    def frozen(self) -> bool:
        tree = self._tree()
        return bool(tree) and all(_stopped(proc) for proc in tree)

    @staticmethod
    def _signal(procs, signum: int) -> None:
        for proc in procs:
            try:
                proc.send_signal(signum)  # psutil checks the start time: never a reused pid
            except psutil.Error:
                pass


def _stopped(proc: psutil.Process) -> bool:
    try:
        return proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return True  # gone: nothing left to stop


class NoContainment(Containment):
    """No cgroup at all; says so loudly when made (``why``: the reason)."""

    mode = "none"

    def __init__(self, why: str, log: logging.Logger | None = None) -> None:
        self.where, self.why = "nowhere", why
        (log or logging.getLogger("gpupool.agent")).warning(
            "NO CGROUP CONTAINMENT (%s): a process a worker starts in a session of its own (setsid, a double "
            "fork) can outlive its lease, and host CPU and memory limits (--cpus, --host-memory) ARE NOT ENFORCED; "
            "run the agent as root or give it a delegated cgroup subtree "
            "(systemd: Delegate=yes), see docs/security.md, \"Containment\"", why)

    def create(self, name: str) -> GroupOnly:
        return GroupOnly(name)

    def find(self, name: str) -> None:
        return None

    def names(self) -> list[str]:
        return []

