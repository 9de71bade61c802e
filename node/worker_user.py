"""The Linux accounts workers run as: one (``c.AgentWorkers.worker_user``,
:class:`WorkerUser`) keeps the agent's secrets from user code; a pool
(``c.AgentWorkers.worker_users``, :class:`WorkerUserPool`) also keeps one
user's worker from another's. Who may reach what, and how an account is
cleaned before it is used again: docs/security.md, "Workers as an
unprivileged user".
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import psutil

#: Where a pool account's leftovers are removed when it is given back
#: (besides its work directory): the world-writable places of a node.
SHARED_SCRATCH = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))

#: How many levels below each of those the sweep looks: deep enough for a
#: folder per owner in a shared one (``/tmp/gpupool-scratch/OWNER``, the
#: workers' scratch folders), shallow enough to stay quick on a big /tmp.
SWEEP_DEPTH = 3


@dataclass(frozen=True)
class WorkerUser:
    """A worker account: ``name``, ``uid``, ``gid`` (primary group),
    ``groups`` (every group id it is in, the primary one included) and
    ``home`` (its home directory from the password database)."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    @classmethod
    def lookup(cls, name: str) -> "WorkerUser":
        """The account called ``name``; ValueError when there is none."""
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise ValueError(f"there is no user {name!r} on this node (c.AgentWorkers.worker_user; "
                             f"create one with: useradd --system --no-create-home {name})") from None
        return cls(entry.pw_name, entry.pw_uid, entry.pw_gid, tuple(os.getgrouplist(entry.pw_name, entry.pw_gid)),
                   entry.pw_dir)

    def check_can_switch(self) -> None:
        """ValueError unless this process may start processes as this user."""
        if os.geteuid() not in (0, self.uid):
            raise ValueError(f"starting workers as user {self.name!r} needs an agent running as root "
                             f"(this one runs as uid {os.geteuid()}); unset c.AgentWorkers.worker_user otherwise")

    def popen_kwargs(self) -> dict[str, Any]:
        """``subprocess.Popen`` arguments that start a process as this user."""
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def environment(self, home: str) -> dict[str, str]:
        """The variables naming the user, with ``home`` as its home directory."""
        return {"HOME": home, "USER": self.name, "LOGNAME": self.name}

    def blocked_at(self, path: Path) -> Path | None:
        """The first directory on the way to ``path`` (``path`` included) that
        this user may not enter (or, for a file, execute), or None when it can
        reach ``path``. Symbolic links are followed where they point."""
        path = path.absolute()
        for folder in [*reversed(path.parents), path]:
            try:
                info = folder.stat()
            except OSError:
                return folder
            if not self._may_enter(info):
                return folder
        return None

    def _may_enter(self, info: os.stat_result) -> bool:
        if self.uid == 0:
            return True
        if info.st_uid == self.uid:
            return bool(info.st_mode & stat.S_IXUSR)
        if info.st_gid in self.groups:
            return bool(info.st_mode & stat.S_IXGRP)
        return bool(info.st_mode & stat.S_IXOTH)


class NoFreeWorkerUser(Exception):
    """Every account of the pool is in use; the message names the setting."""


class WorkerUserPool:
    """Worker accounts, one per live worker (``c.AgentWorkers.worker_users``).

    ``users``: the accounts (distinct uids, none of them root). ``scratch``:
    the shared directories swept of an account's files when it is given back
    (:data:`SHARED_SCRATCH`). Not thread-safe: call from the agent's event
    loop (:meth:`give_back`'s sweep may go to a thread).
    """

    def __init__(self, users: Sequence[WorkerUser], *, scratch: Iterable[Path] = SHARED_SCRATCH,
                 log: logging.Logger | None = None) -> None:
        uids = [user.uid for user in users]
        if len(set(uids)) != len(uids):
            raise ValueError("c.AgentWorkers.worker_users names one uid twice: every account must be its own")
        if 0 in uids:
            raise ValueError("root cannot be a worker user (c.AgentWorkers.worker_users)")
        self.users = tuple(users)
        self.scratch = tuple(scratch)
        self.log = log or logging.getLogger("gpupool.agent")
        self._taken: set[str] = set()

    @property
    def free(self) -> list[WorkerUser]:
        """The accounts no worker holds, in configuration order."""
        return [user for user in self.users if user.name not in self._taken]

    def take(self) -> WorkerUser:
        """A free account, marked taken; one that still runs a process (left
        by an earlier agent, or by hand) is skipped. NoFreeWorkerUser when
        there is none."""
        busy = _running_uids()
        for user in self.free:
            if user.uid not in busy:
                self._taken.add(user.name)
                return user
        raise NoFreeWorkerUser(
            f"all {len(self.users)} worker users are in use ({len(self._taken)} by workers, "
            f"{len(self.free)} running other processes): add accounts to c.AgentWorkers.worker_users "
            f"(one per lease this node may run at once, plus c.AgentWorkers.warm_workers)")

    def claim(self, name: str) -> WorkerUser | None:
        """Mark the account ``name`` taken (a re-adopted worker's); None when
        it is not in the pool."""
        user = next((user for user in self.users if user.name == name), None)
        if user is not None:
            self._taken.add(name)
        return user

    def give_back(self, user: WorkerUser, workdir: Path | None = None) -> bool:
        """Return ``user`` to the pool once no process runs as it: first its
        files in ``workdir`` (emptied, kept) and the scratch directories are
        removed. Returns False (and keeps it out of the pool) while a
        process of it still runs. Blocking (a directory walk)."""
        if user.uid in _running_uids():
            self.log.error("worker user %s still runs processes after its worker stopped: kept out of the pool",
                           user.name)
            return False
        if workdir is not None and workdir.is_dir():
            for entry in os.scandir(workdir):
                _remove_entry(entry)
        for folder in self.scratch:
            _sweep(folder, user.uid, SWEEP_DEPTH)
        self._taken.discard(user.name)
        return True


def _running_uids() -> set[int]:
    """The real uids of every live process (zombies hold nothing)."""
    uids = set()
    for proc in psutil.process_iter(["uids", "status"]):
        info = proc.info
        if info.get("uids") is not None and info.get("status") != psutil.STATUS_ZOMBIE:
            uids.update((info["uids"].real, info["uids"].effective))
    return uids


def _sweep(folder: Path, uid: int, depth: int) -> None:
    """Remove what ``uid`` owns in ``folder``, looking ``depth`` levels
    down. A directory of ``uid``'s that holds something of another's (a
    shared root another worker made its own folder in) keeps that, and
    itself; one at the last level goes whole. Links are never followed."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        is_dir = stat.S_ISDIR(info.st_mode)
        if is_dir and depth > 0:
            _sweep(Path(entry.path), uid, depth - 1)
        if info.st_uid != uid:
            continue
        if is_dir and depth > 0:
            try:
                os.rmdir(entry.path)  # only once empty: what is left is someone else's
            except OSError:
                pass
        else:
            _remove_entry(entry)


def _remove_entry(entry: os.DirEntry) -> None:
    # Never follows a link: rmtree refuses links and walks with file descriptors.
    try:
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)
    except OSError:
        pass
