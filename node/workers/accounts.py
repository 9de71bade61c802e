"""Who a worker runs as and where it works: the agent's own account, the one
worker user, a lease owner's own account, or one of a pool's
(:mod:`..worker_user`)."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from pathlib import Path

from ..worker_user import WorkerUser
from .spec import WorkerLaunch


class WorkerAccounts:
    """The accounts of one node's workers, as ``settings`` says (``user``,
    ``users``, ``cwd``). Pool accounts are taken for a start and given back
    once the worker's processes are gone."""

    def __init__(self, settings: WorkerLaunch, log: logging.Logger) -> None:
        self.state_dir = settings.state_dir
        self.user = settings.user
        self.users = settings.users
        self.homes_dir = settings.state_dir / "worker-homes"
        self.cwd = str(settings.cwd or (_user_home(self.user, self.state_dir) if self.user is not None
                                        else Path.home()))
        if self.users is not None:
            _shared_scratch_root(log)

    @property
    def others(self) -> bool:
        """True when workers run as accounts other than the agent's (pool or one worker user)."""
        return self.user is not None or self.users is not None

    def take(self, user: WorkerUser | None) -> WorkerUser | None:
        """The account of a new worker: ``user`` (the lease owner's own,
        from a ``worker_user`` template), else a free one of the pool, else
        the one worker user (None: the agent's). NoFreeWorkerUser when the
        pool has none free."""
        return user or (self.users.take() if self.users is not None else self.user)

    def pooled(self, user: WorkerUser | None) -> bool:
        """True when :meth:`take` of ``user`` hands out a pool account."""
        return user is None and self.users is not None

    def workdir(self, account: WorkerUser | None, user: WorkerUser | None) -> str:
        """The working directory of a worker running as ``account`` (taken
        for ``user``): the lease owner's home, a pool account's
        ``worker-homes/NAME`` (made for it, 0700), else :attr:`cwd`."""
        if user is not None:
            return str(_user_home(user, self.state_dir))
        if account is None or self.users is None:
            return self.cwd
        folder = self.homes_dir / account.name
        self.homes_dir.mkdir(mode=0o711, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chown(folder, account.uid, account.gid)
        return str(folder)

    def claim(self, name: str) -> WorkerUser | None:
        """The account of a re-adopted worker whose record names ``name``."""
        if self.users is not None and name:
            return self.users.claim(name)
        return self.user

    async def give_back(self, account: WorkerUser | None) -> None:
        """Return a pool account once its worker's processes are gone."""
        if self.users is not None and account is not None:
            await asyncio.to_thread(self.users.give_back, account, self.homes_dir / account.name)

    async def give_back_free(self) -> None:
        """Clean up after the pool's free accounts (what killed workers left)."""
        if self.users is not None:
            for account in self.users.free:
                await self.give_back(account)


def _user_home(user: WorkerUser, state_dir: Path) -> Path:
    """The worker user's working directory: its home when that is its own
    directory, else ``state_dir/worker-home`` made for it."""
    home = Path(user.home)
    if home.is_dir() and home.stat().st_uid == user.uid:
        return home
    made = state_dir / "worker-home"
    made.mkdir(mode=0o700, exist_ok=True)
    os.chown(made, user.uid, user.gid)
    return made


def _shared_scratch_root(log: logging.Logger) -> None:
    """Make the workers' scratch root (:func:`gpupool.node.worker_extension.workdir.enter_workdir`:
    ``TMP/gpupool-scratch``) root's and sticky, as /tmp is, so that each pool
    account can make its owner's folder there; made by the first worker, it
    would be that account's alone."""
    root = Path(tempfile.gettempdir()) / "gpupool-scratch"
    try:
        root.mkdir(exist_ok=True)
        if root.stat().st_uid == os.getuid():
            root.chmod(0o1777)
        else:
            log.warning("%s belongs to uid %s: workers of the other worker users cannot make their scratch folders "
                        "there; remove it (it is made again for all)", root, root.stat().st_uid)
    except OSError as exc:
        log.warning("cannot prepare the workers' scratch folder %s: %s", root, exc)
