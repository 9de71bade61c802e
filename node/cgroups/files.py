"""The file operations every cgroup kind shares: writing a control file,
listing, signalling and waiting for the processes of a cgroup directory,
making and removing cgroup directories. All blocking, a few microseconds
each, except the waits."""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path
from typing import Callable, Iterable

import psutil

from .contract import CgroupError, LeaseCgroup

POLL_S = 0.02


def write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc.strerror or exc}") from None


def procs(path: Path, file: str = "cgroup.procs") -> set[int]:
    """Pids listed in ``file`` of the cgroup at ``path`` and every sub-cgroup."""
    found: set[int] = set()
    for folder, _, _ in os.walk(path):
        try:
            found.update(int(line) for line in (Path(folder) / file).read_text().split())
        except (FileNotFoundError, NotADirectoryError):
            continue
    return found


def rmdir_tree(path: Path) -> None:
    """rmdir ``path`` and its sub-cgroups, deepest first (cgroup directories
    hold only kernel files, which go with the directory)."""
    if not path.exists():
        return
    for folder, subdirs, _ in os.walk(path, topdown=False):
        rmdir(Path(folder))


def rmdir(folder: Path, grace: float = 1.0) -> None:
    # A killed process is listed (v1) until its parent reaps it: give that a moment.
    deadline = time.monotonic() + grace
    while True:
        try:
            os.rmdir(folder)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                listed = procs(folder)
                if not live(listed) and time.monotonic() < deadline:
                    time.sleep(POLL_S)
                    continue
                raise CgroupError(f"cannot remove the cgroup {folder}: processes {sorted(listed)} are still in "
                                  f"it") from None
            raise CgroupError(f"cannot remove the cgroup {folder}: {exc.strerror}") from None


def controllers(path: Path) -> set[str]:
    """The controllers a v2 cgroup at ``path`` has (its ``cgroup.controllers``); none when unreadable."""
    try:
        return set((path / "cgroup.controllers").read_text().split())
    except OSError:
        return set()


def counter(path: Path, key: str) -> int | None:
    """The value of line ``key N`` of a flat-keyed cgroup file (``memory.events``,
    ``memory.oom_control``; ``key`` empty: the number a single-value file holds,
    ``memory.failcnt``); None when the file or the line is missing."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.strip().rpartition(" ")
        if name == key and value.isdigit():
            return int(value)
    return None


def sigkill(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)  # a pid listed in the cgroup is that process, not a reused one
        except OSError:
            pass


def live(pids: Iterable[int]) -> set[int]:
    """The pids that are not zombies: an exited process that its parent has
    not reaped yet runs nothing and holds no memory."""
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.Error:
            pass
    return alive


def make_dirs(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CgroupError(f"cannot make the cgroup {path}: {exc.strerror or exc} (the agent needs root or a "
                          f"delegated subtree: systemd Delegate=yes; or set c.AgentEnforcement.cgroup_root)") from None


def fresh(group: LeaseCgroup, *paths: Path) -> None:
    """Make ``paths`` for ``group``; a stale cgroup of the same name is killed first."""
    if any(path.exists() for path in paths):
        group.kill()
    for path in paths:
        make_dirs(path)


def rmdir_quietly(root: Path) -> None:
    for path in (root, root.parent if root.parent.name == "gpupool" else None):
        try:
            if path is not None:
                os.rmdir(path)
        except OSError:
            return  # in use (another agent's subtree, a lease left), or gone


def subdirs(root: Path) -> list[str]:
    try:
        return sorted(entry.name for entry in os.scandir(root) if entry.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll ``condition()`` until it holds or ``timeout`` seconds passed; returns whether it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S / 4)
    return True


def wait_empty(pids: Callable[[], set[int]], deadline: float) -> list[int]:
    """Poll ``pids()`` until it is empty or ``deadline`` (monotonic) passed;
    returns what is left, sorted."""
    while (left := pids()) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return sorted(left)
