"""Lease cgroups: every process of a worker lives in one cgroup and dies with it.

A double fork with ``setsid`` leaves a process group and its parent's tree,
but not its cgroup: an unprivileged process cannot move itself out (that
needs write access to the ``cgroup.procs`` of a common ancestor, which the
agent's subtree does not give). So the agent makes a cgroup per worker under
its own subtree, puts the worker's first process in it before that process
runs anything (:mod:`.workers`, "the start gate"), and kills the whole
cgroup when the lease ends, when the worker dies and when the agent stops.

Three kinds, chosen by ``c.NodeAgent.cgroup_mode`` (:func:`containment`):

- ``v2``: the unified hierarchy (its mount found in ``/proc/mounts``);
  ``cgroup.kill`` kills the subtree at once; where the kernel has none
  (before 5.14) ``cgroup.freeze``, SIGKILL to each process, thaw, repeated.
  Host CPU and memory limits go to the v1 ``cpu``/``memory`` hierarchies
  where v2 lacks those controllers (:mod:`.cgroup_hybrid`).
- ``v1``: the ``freezer`` hierarchy (required: it is what makes the kill
  race-free), and ``memory``, ``pids`` and ``cpu`` where mounted (for
  limits): freeze, SIGKILL every task, thaw.
- ``none``: no cgroup. A loud warning, once per agent; kills reach the
  worker's process group and the descendants seen at kill time, which a
  double-forked daemon escapes (docs/security.md, "Containment").

The agent's subtree (``c.NodeAgent.cgroup_root``): by default
``gpupool/agent-<12 hex digits of the state dir>`` under the agent's own
cgroup (``/proc/self/cgroup``), which is the subtree systemd delegates to a
unit with ``Delegate=yes``. The state-dir part keeps two agents on one host
(tests, or a second agent for another GPU set) out of each other's way: a
restarted agent kills every cgroup of its subtree that it does not re-adopt.

All calls are blocking file writes of a few microseconds, except
:meth:`LeaseCgroup.kill`, which waits (up to its ``timeout``) until the
processes are gone: call that one in a thread from the event loop.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import signal
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import psutil

MODES = ("auto", "v2", "v1", "none")

#: v1 controllers a lease cgroup joins when mounted; ``freezer`` is required.
V1_CONTROLLERS = ("freezer", "memory", "pids", "cpu")

#: Where the kernel lists mounts and a process's cgroups (the seams for tests).
MOUNTS = Path("/proc/mounts")
SELF_CGROUP = Path("/proc/self/cgroup")

_POLL_S = 0.02


class CgroupError(Exception):
    """A cgroup could not be made, joined, killed or removed; the message
    says which path and what to change."""


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


# -- the contract ---------------------------------------------------------------


class LeaseCgroup(ABC):
    """The cgroup of one worker (and so of one lease once it is bound):
    ``name`` is its directory name under the agent's subtree."""

    kind = "none"

    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    def add(self, pid: int) -> None:
        """Put process ``pid`` (and, for new children, what it starts from
        then on) in this cgroup. CgroupError when the kernel refuses."""

    @abstractmethod
    def pids(self) -> set[int]:
        """Every live process in this cgroup and its sub-cgroups now."""

    @abstractmethod
    def kill(self, timeout: float = 10.0) -> list[int]:
        """SIGKILL every process of the cgroup, those started meanwhile too,
        and wait up to ``timeout`` seconds; returns the pids still there
        (stuck in the kernel, say). Blocking."""

    @abstractmethod
    def remove(self) -> None:
        """Remove the (empty) cgroup; no error when it is gone already.
        CgroupError when processes remain (kill first)."""

    def set_limits(self, cpu: float | None = None, memory: int | None = None) -> None:
        """Cap the cgroup's host CPU (``cpu`` cores, e.g. 2.5) and memory
        (``memory`` bytes); None leaves one as it is. CgroupError when this
        kind of cgroup (or this host) cannot, naming what is missing."""
        raise CgroupError(f"host CPU and memory limits need a cgroup, and this agent runs without one "
                          f"(c.NodeAgent.cgroup_mode = {self.kind!r})")


class Containment(ABC):
    """The agent's subtree: makes, finds and lists lease cgroups. ``mode``
    is ``"v2"``, ``"v1"`` or ``"none"``; ``where`` says where, in words."""

    mode = "none"
    where = "nowhere"

    @abstractmethod
    def create(self, name: str) -> LeaseCgroup:
        """A new, empty cgroup ``name`` (a stale one of that name, left by an
        earlier run, is killed and reused). CgroupError when it cannot be made."""

    @abstractmethod
    def find(self, name: str) -> LeaseCgroup | None:
        """The existing cgroup ``name``, or None."""

    @abstractmethod
    def names(self) -> list[str]:
        """The names of every cgroup in the subtree now, sorted."""

    def close(self) -> None:
        """Remove the agent's subtree if it is empty (and the ``gpupool``
        folder above it if that is empty too); quietly otherwise. Call when
        the agent stops, after its workers."""


# -- cgroup v2 ------------------------------------------------------------------


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc.strerror or exc}") from None


def _procs(path: Path, file: str = "cgroup.procs") -> set[int]:
    """Pids listed in ``file`` of the cgroup at ``path`` and every sub-cgroup."""
    found: set[int] = set()
    for folder, _, _ in os.walk(path):
        try:
            found.update(int(line) for line in (Path(folder) / file).read_text().split())
        except (FileNotFoundError, NotADirectoryError):
            continue
    return found


def _rmdir_tree(path: Path) -> None:
    """rmdir ``path`` and its sub-cgroups, deepest first (cgroup directories
    hold only kernel files, which go with the directory)."""
    if not path.exists():
        return
    for folder, subdirs, _ in os.walk(path, topdown=False):
        _rmdir(Path(folder))


def _rmdir(folder: Path, grace: float = 1.0) -> None:
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
                listed = _procs(folder)
                if not _live(listed) and time.monotonic() < deadline:
                    time.sleep(_POLL_S)
                    continue
                raise CgroupError(f"cannot remove the cgroup {folder}: processes {sorted(listed)} are still in "
                                  f"it") from None
            raise CgroupError(f"cannot remove the cgroup {folder}: {exc.strerror}") from None


def _sigkill(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)  # a pid listed in the cgroup is that process, not a reused one
        except OSError:
            pass


def _live(pids: Iterable[int]) -> set[int]:
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


class V2Cgroup(LeaseCgroup):
    """A cgroup of the unified hierarchy at ``path``."""

    kind = "v2"

    def __init__(self, name: str, path: Path) -> None:
        super().__init__(name)
        self.path = path

    def add(self, pid: int) -> None:
        _write(self.path / "cgroup.procs", str(pid))

    def pids(self) -> set[int]:
        return _live(_procs(self.path))

    def kill(self, timeout: float = 10.0) -> list[int]:
        if not self.path.exists():
            return []
        deadline = time.monotonic() + timeout
        if (self.path / "cgroup.kill").exists():
            # One write kills the subtree, forks in flight included (Linux 5.14+).
            _write(self.path / "cgroup.kill", "1")
        else:
            self._freeze_and_kill(deadline)
        return _wait_empty(self.pids, deadline)

    def _freeze_and_kill(self, deadline: float) -> None:
        # Frozen, nothing can fork; SIGKILL reaches frozen tasks in v2.
        _write(self.path / "cgroup.freeze", "1")
        try:
            while pids := self.pids():  # one round at least, whatever the deadline
                _sigkill(pids)
                if time.monotonic() >= deadline:
                    break
                time.sleep(_POLL_S)
        finally:
            if self.path.exists():
                _write(self.path / "cgroup.freeze", "0")

    def remove(self) -> None:
        _rmdir_tree(self.path)

    def set_limits(self, cpu: float | None = None, memory: int | None = None) -> None:
        wanted = [name for name, value in (("cpu", cpu), ("memory", memory)) if value is not None]
        available = set((self.path / "cgroup.controllers").read_text().split())
        missing = [name for name in wanted if name not in available]
        if missing:
            raise CgroupError(f"the {', '.join(missing)} controller is not enabled for {self.path} (it has: "
                              f"{' '.join(sorted(available)) or 'none'}): enable it in the parent's "
                              f"cgroup.subtree_control (systemd: Delegate=yes on the agent's unit, and the agent "
                              f"in a leaf cgroup of its own)")
        if memory is not None:
            _write(self.path / "memory.max", str(int(memory)))
        if cpu is not None:
            _write(self.path / "cpu.max", f"{max(1000, int(cpu * 100_000))} 100000")


class V2Containment(Containment):
    """Lease cgroups under ``root`` (an absolute directory in the cgroup2 mount)."""

    mode = "v2"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.where = str(root)
        _make_dirs(root)
        if not (root / "cgroup.kill").exists() and not (root / "cgroup.freeze").exists():
            raise CgroupError(f"{root} has neither cgroup.kill nor cgroup.freeze (Linux 5.2+ is needed)")

    def create(self, name: str) -> V2Cgroup:
        group = V2Cgroup(name, self.root / name)
        _fresh(group, group.path)
        return group

    def find(self, name: str) -> V2Cgroup | None:
        return V2Cgroup(name, self.root / name) if (self.root / name).is_dir() else None

    def names(self) -> list[str]:
        return _subdirs(self.root)

    def close(self) -> None:
        _rmdir_quietly(self.root)


# -- cgroup v1 ------------------------------------------------------------------


class V1Cgroup(LeaseCgroup):
    """A cgroup in several v1 hierarchies: ``paths`` maps controller ->
    directory; ``freezer`` is always among them."""

    kind = "v1"

    def __init__(self, name: str, paths: dict[str, Path]) -> None:
        super().__init__(name)
        self.paths = paths

    @property
    def freezer(self) -> Path:
        return self.paths["freezer"]

    def add(self, pid: int) -> None:
        for path in self.paths.values():
            _write(path / "cgroup.procs", str(pid))

    def pids(self) -> set[int]:
        return _live(_procs(self.freezer))

    def kill(self, timeout: float = 10.0) -> list[int]:
        if not self.freezer.exists():
            return []
        deadline = time.monotonic() + timeout
        try:
            while self.pids():  # one round at least, whatever the deadline
                # Frozen, nothing forks between the listing and the kill; the
                # SIGKILLs are delivered at the thaw.
                self._freeze(deadline)
                _sigkill(_procs(self.freezer, "tasks"))
                _write(self.freezer / "freezer.state", "THAWED")
                if not _wait_empty(self.pids, min(deadline, time.monotonic() + 0.5)) or \
                        time.monotonic() >= deadline:
                    break
        finally:
            if self.freezer.exists():
                _write(self.freezer / "freezer.state", "THAWED")
        return _wait_empty(self.pids, deadline)

    def _freeze(self, deadline: float) -> None:
        _write(self.freezer / "freezer.state", "FROZEN")
        # FREEZING until every task stopped; a task in uninterruptible sleep can keep it there.
        while (self.freezer / "freezer.state").read_text().strip() != "FROZEN" and time.monotonic() < deadline:
            time.sleep(_POLL_S)

    def remove(self) -> None:
        for path in self.paths.values():
            _rmdir_tree(path)

    def set_limits(self, cpu: float | None = None, memory: int | None = None) -> None:
        for name, value in (("memory", memory), ("cpu", cpu)):
            if value is not None and name not in self.paths:
                raise CgroupError(f"the v1 {name} controller is not mounted on this node (/proc/mounts)")
        if memory is not None:
            _write(self.paths["memory"] / "memory.limit_in_bytes", str(int(memory)))
        if cpu is not None:
            _write(self.paths["cpu"] / "cpu.cfs_period_us", "100000")
            _write(self.paths["cpu"] / "cpu.cfs_quota_us", str(max(1000, int(cpu * 100_000))))


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
            _make_dirs(path)

    def create(self, name: str) -> V1Cgroup:
        group = V1Cgroup(name, {controller: root / name for controller, root in self.roots.items()})
        _fresh(group, *group.paths.values())
        return group

    def find(self, name: str) -> V1Cgroup | None:
        if not (self.roots["freezer"] / name).is_dir():
            return None
        return V1Cgroup(name, {controller: root / name for controller, root in self.roots.items()})

    def names(self) -> list[str]:
        return sorted(set().union(*(_subdirs(root) for root in self.roots.values())))

    def close(self) -> None:
        for root in self.roots.values():
            _rmdir_quietly(root)


# -- no cgroup ------------------------------------------------------------------


class GroupOnly(LeaseCgroup):
    """No cgroup: the worker's process group and the descendants of the
    processes added, as found at kill time (the weaker mode)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._leaders: list[psutil.Process] = []

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
        return _live(proc.pid for proc in self._tree())

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
        return _wait_empty(lambda: _live(proc.pid for proc in tree if proc.is_running()), deadline)

    def remove(self) -> None:
        self._leaders.clear()


class NoContainment(Containment):
    """No cgroup at all; says so loudly when made (``why``: the reason)."""

    mode = "none"

    def __init__(self, why: str, log: logging.Logger | None = None) -> None:
        self.where = "nowhere"
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


# -- choosing -------------------------------------------------------------------


def containment(mode: str, root: str, state_dir: str | os.PathLike, *, log: logging.Logger | None = None,
                mounts: Path = MOUNTS, self_cgroup: Path = SELF_CGROUP) -> Containment:
    """The agent's containment for ``mode`` (one of :data:`MODES`).

    ``root``: the agent's subtree: absolute (from the hierarchy's root, e.g.
    ``/system.slice/gpupool-agent.service/gpupool``) or relative to the
    agent's own cgroup; empty: :func:`default_root` of ``state_dir``.
    ``auto`` tries v2, then v1, then falls back to none (with the reasons in
    its warning); ``v2`` and ``v1`` raise CgroupError when they cannot be had.
    """
    if mode not in MODES:
        raise ValueError(f"cgroup mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        return NoContainment("c.NodeAgent.cgroup_mode = 'none'", log)
    relative = root or default_root(state_dir)
    found, own = read_mounts(mounts), own_cgroups(self_cgroup)
    reasons = []
    for kind in (("v2", "v1") if mode == "auto" else (mode,)):
        try:
            if kind == "v2":
                from .cgroup_hybrid import v2_containment  # it builds on this module's classes

                return v2_containment(_v2_root(found, own, relative), found, own, relative)
            return V1Containment(_v1_roots(found, own, relative))
        except (CgroupError, OSError) as exc:
            if mode != "auto":
                raise CgroupError(f"cgroup {kind} containment is not available: {exc} "
                                  f"(c.NodeAgent.cgroup_mode = 'auto' falls back to the others)") from None
            reasons.append(f"{kind}: {exc}")
    return NoContainment("; ".join(reasons), log)


def _under(mount: Path, own: str, relative: str) -> Path:
    base = relative if relative.startswith("/") else f"{own.rstrip('/')}/{relative}"
    path = Path(os.path.normpath(f"{mount}/{base.lstrip('/')}"))
    if mount != path and mount not in path.parents:
        raise CgroupError(f"the cgroup root {relative!r} leads out of {mount}")
    return path


def _v2_root(mounts: Sequence[Mount], own: dict[str, str], relative: str) -> Path:
    mount = next((m.path for m in mounts if m.fstype == "cgroup2"), None)
    if mount is None:
        raise CgroupError("no cgroup2 file system is mounted (/proc/mounts)")
    if "" not in own:
        raise CgroupError("this process is in no cgroup v2 (/proc/self/cgroup has no 0:: line)")
    return _under(mount, own[""], relative)


def _v1_roots(mounts: Sequence[Mount], own: dict[str, str], relative: str) -> dict[str, Path]:
    roots = {}
    for controller in V1_CONTROLLERS:
        mount = next((m.path for m in mounts if m.fstype == "cgroup" and controller in m.options), None)
        if mount is not None and controller in own and controller not in roots:
            roots[controller] = _under(mount, own[controller], relative)
    if "freezer" not in roots:
        raise CgroupError("the v1 freezer controller is not mounted (/proc/mounts)")
    return roots


def _make_dirs(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CgroupError(f"cannot make the cgroup {path}: {exc.strerror or exc} (the agent needs root or a "
                          f"delegated subtree: systemd Delegate=yes; or set c.NodeAgent.cgroup_root)") from None


def _fresh(group: LeaseCgroup, *paths: Path) -> None:
    """Make ``paths`` for ``group``; a stale cgroup of the same name is killed first."""
    if any(path.exists() for path in paths):
        group.kill()
    for path in paths:
        _make_dirs(path)


def _rmdir_quietly(root: Path) -> None:
    for path in (root, root.parent if root.parent.name == "gpupool" else None):
        try:
            if path is not None:
                os.rmdir(path)
        except OSError:
            return  # in use (another agent's subtree, a lease left), or gone


def _subdirs(root: Path) -> list[str]:
    try:
        return sorted(entry.name for entry in os.scandir(root) if entry.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []


def _wait_empty(pids, deadline: float) -> list[int]:
    """Poll ``pids()`` until it is empty or ``deadline`` (monotonic) passed;
    returns what is left, sorted."""
    while (left := pids()) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return sorted(left)
