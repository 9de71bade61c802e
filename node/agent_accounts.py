"""The accounts a node's workers run as: ``c.AgentWorkers.worker_user`` (one
account, or a template naming one per lease owner) or ``worker_users`` (a
pool), checked once when the agent starts (docs/security.md, "Containment")."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from gpupool.errors import GPUPoolError, Reason, bad_request

from .worker_user import WorkerUser, WorkerUserPool


def is_user_template(worker_user: str) -> bool:
    """Whether ``c.AgentWorkers.worker_user`` names an account per lease (``"{username}"``)."""
    return "{" in worker_user


def expand_worker_user(template: str, owner: str) -> str:
    """The account name ``template`` gives for the lease owner ``owner`` (pure):
    ``"{username}"`` -> ``"ann"``, ``"jupyter-{username}"`` -> ``"jupyter-ann"``.
    Raises a 400 GPUPoolError for an owner that is no POSIX account name, and
    GPUPoolError ``not_configured`` for a template with other fields."""
    if not re.fullmatch(r"[a-z_][a-z0-9_.-]{0,31}", owner):
        raise bad_request(f"lease owner {owner!r} is no account name of this node (c.AgentWorkers.worker_user "
                          f"{template!r}): lower-case letters, digits, '_', '.', '-', at most 32")
    try:
        return template.format(username=owner)
    except (KeyError, IndexError, ValueError):
        raise GPUPoolError(Reason.not_configured, f"c.AgentWorkers.worker_user {template!r}: the only field a "
                           "template may hold is {username}") from None


class WorkerAccountSettings:
    """``c.AgentWorkers.worker_user`` and ``worker_users`` of one node, resolved to
    accounts and checked at construction (the workers' allotment of them is
    :class:`~.workers.accounts.WorkerAccounts`).

    ``worker_user``, ``worker_users``: the settings; ``state_dir``: the
    agent's (each account must reach it); ``node``: named in refusals.
    ``user`` is the one fixed account and ``users`` the pool (each None when
    not set); with a template, :meth:`for_owner` looks the account up per
    lease. Raises GPUPoolError ``not_configured`` naming what is wrong.
    """

    def __init__(self, worker_user: str | None, worker_users: list[str], state_dir: str, node: str,
                 log: logging.Logger) -> None:
        self.template = worker_user if is_user_template(worker_user or "") else None
        self.state_dir, self.node = Path(state_dir), node
        if self.template is not None:
            expand_worker_user(self.template, "probe")  # a bad template stops the start
        self.user = self._checked(worker_user, "--worker-user") if worker_user and self.template is None else None
        self.users = self._pool(worker_user, worker_users, log)

    @property
    def separate(self) -> bool:
        """True when workers run as accounts other than the agent's."""
        return self.user is not None or self.users is not None or self.template is not None

    def _pool(self, worker_user: str | None, names: list[str], log: logging.Logger) -> WorkerUserPool | None:
        """The ``worker_users`` pool, each account checked as ``worker_user``'s."""
        if not names:
            return None
        if worker_user:
            raise GPUPoolError(Reason.not_configured,
                               "set c.AgentWorkers.worker_user or c.AgentWorkers.worker_users, not both")
        try:
            return WorkerUserPool([self._checked(name, "c.AgentWorkers.worker_users") for name in names], log=log)
        except ValueError as exc:
            raise GPUPoolError(Reason.not_configured, str(exc)) from None

    def _checked(self, name: str, option: str) -> WorkerUser:
        """The account ``name``, checked: it exists, this agent may start
        processes as it, and it can run this Python and reach the state directory."""
        try:
            user = WorkerUser.lookup(name)
            user.check_can_switch()
        except ValueError as exc:
            raise GPUPoolError(Reason.not_configured, f"{exc} ({option})") from None
        state_dir = self.state_dir.resolve()
        python = Path(sys.executable).absolute()  # what workers run
        blocked = user.blocked_at(python) or user.blocked_at(python.resolve())
        if blocked is not None:
            raise GPUPoolError(Reason.not_configured, f"worker user {user.name!r} cannot run this Python ({python}): "
                               f"it may not enter or execute {blocked}; install gpupool where that user can "
                               "(e.g. a virtual environment under /opt) or pick another --worker-user")
        # The state dir itself is opened to it (0711) when the agent starts.
        _must_reach(user, next(folder for folder in state_dir.parents if folder.exists()),
                    f"the state directory {state_dir} (--state-dir), where its connection files are",
                    "another state directory")
        return user

    def open_spill_folder(self, folder: Path) -> None:
        """Make the spill folder enterable, not listable (0711): a worker spilled to disk writes
        its lease's folder there itself (0700, its account's). Raises GPUPoolError
        ``not_configured`` when a worker account cannot enter a folder on the way (a
        ``c.AgentParking.spill_dir`` of the admin's); accounts of a template are checked as
        their leases come (an account that cannot: its spills fail, said in words)."""
        folder.mkdir(parents=True, exist_ok=True, mode=0o711)
        folder.chmod(0o711)
        for user in [*([self.user] if self.user else []), *(self.users.users if self.users else ())]:
            _must_reach(user, folder, f"the spill folder {folder} (c.AgentParking.spill_dir), where parked workers "
                        "save what they hold", "another folder")

    def for_owner(self, owner: str) -> WorkerUser | None:
        """The account of ``owner``'s worker when ``worker_user`` is a template
        (None otherwise: the one fixed account). Raises a 400 GPUPoolError when
        the owner has no account on this node, or it may not be switched to."""
        if self.template is None:
            return None
        try:
            user = WorkerUser.lookup(expand_worker_user(self.template, owner))
            user.check_can_switch()
        except ValueError as exc:
            raise GPUPoolError(Reason.worker_user_unknown, f"cannot start the worker of {owner!r} on node "
                               f"{self.node}: {exc} (c.AgentWorkers.worker_user = {self.template!r})",
                               400) from None
        if user.uid == 0:
            raise bad_request(f"refusing to run {owner!r}'s worker as root (c.AgentWorkers.worker_user)")
        return user


def _must_reach(user: WorkerUser, folder: Path, what: str, instead: str) -> None:
    """GPUPoolError ``not_configured`` when ``user`` cannot enter ``folder`` (``what`` it is, in
    words; ``instead``: what else the admin may choose)."""
    blocked = user.blocked_at(folder)
    if blocked is not None:
        raise GPUPoolError(Reason.not_configured, f"worker user {user.name!r} cannot enter {blocked} on the way to "
                           f"{what}: allow it (chmod o+x {blocked}) or choose {instead}")
