"""The Linux account workers run as (``c.NodeAgent.worker_user``).

User code runs in the workers; the agent holds the pool's agent token. With
a worker user, each worker process is started with that user's uid, primary
gid and groups (``subprocess.Popen``'s ``user``, ``group``,
``extra_groups``), so it can read neither the agent's token file nor
anything else that is the agent user's alone. The agent must run as root
(or with CAP_SETUID/CAP_SETGID) for that.
"""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
            raise ValueError(f"there is no user {name!r} on this node (c.NodeAgent.worker_user; "
                             f"create one with: useradd --system --no-create-home {name})") from None
        return cls(entry.pw_name, entry.pw_uid, entry.pw_gid, tuple(os.getgrouplist(entry.pw_name, entry.pw_gid)),
                   entry.pw_dir)

    def check_can_switch(self) -> None:
        """ValueError unless this process may start processes as this user."""
        if os.geteuid() not in (0, self.uid):
            raise ValueError(f"starting workers as user {self.name!r} needs an agent running as root "
                             f"(this one runs as uid {os.geteuid()}); unset c.NodeAgent.worker_user otherwise")

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
