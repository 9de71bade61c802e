"""The cgroup contract: a lease's cgroup (:class:`LeaseCgroup`) and the
agent's subtree that makes them (:class:`Containment`), with the one error
both raise. The implementations: :mod:`.v2`, :mod:`.hybrid`, :mod:`.v1`,
:mod:`.none`; :func:`~.factory.containment` picks one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path


class CgroupError(Exception):
    """A cgroup could not be made, joined, killed or removed; the message
    says which path and what to change."""



class LeaseCgroup(ABC):
    """The cgroup of one worker (and so of one lease once it is bound):
    ``name`` is its directory name under the agent's subtree."""

    kind = "none"
    #: Why freezing this worker does not give its GPU back to the pool (words), or None when it
    #: does: a park in memory then spills it instead (:meth:`~..workers.parking.WorkerParking.park`).
    frozen_keeps_gpu: str | None = None

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    @abstractmethod
    def confines(self) -> bool:
        """True for a cgroup of the kernel's: a process joins it before it
        runs (the local launcher's start gate,
        :mod:`..workers.launchers.local.gate`), every process it starts stays
        in it (a double-forked daemon too), and a restarted agent finds it
        again by :attr:`name`. False for no cgroup: only the
        process group and tree of the processes :meth:`add` names, as seen at
        kill time."""

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

    def set_limits(self, cpu: float | None = None, memory: int | None = None, pids: int | None = None) -> None:
        """Cap the cgroup's host CPU (``cpu`` cores, e.g. 2.5), memory
        (``memory`` bytes) and tasks (``pids``: processes and threads together,
        the pids controller's ``pids.max``; a fork or thread start beyond it
        fails with EAGAIN inside the cgroup only); None leaves one as it is.
        CgroupError when this kind of cgroup (or this host) cannot, naming what
        is missing."""
        raise CgroupError(f"host CPU and memory limits need a cgroup, and this agent runs without one "
                          f"(c.AgentEnforcement.cgroup_mode = {self.kind!r})")

    def freeze(self, timeout: float = 10.0) -> None:
        """Stop every process of the cgroup where it is (a park): none runs
        until :meth:`thaw`, and the memory and pids limits still hold while
        it is frozen. Returns once all are frozen; CgroupError (the cgroup
        thawed again) when they are not within ``timeout`` seconds (a task
        stuck in the kernel, say), or when this kind cannot freeze. Blocking."""
        raise CgroupError(f"this kind of cgroup ({self.kind}) cannot freeze its processes")

    def thaw(self) -> None:
        """Let the processes of a frozen cgroup run again; no error when it is
        not frozen. CgroupError when the kernel refuses."""
        raise CgroupError(f"this kind of cgroup ({self.kind}) cannot thaw its processes")

    def frozen(self) -> bool:
        """True while the cgroup is frozen (as :meth:`freeze` left it; after an
        agent restart too: the kernel keeps the state)."""
        return False

    #: How :meth:`freeze` stops the processes, in words for the log.
    freeze_method = "nothing"
    #: Who limits this cgroup's tasks instead of the agent, in words for the log (a pod's: the
    #: kubelet); None: the agent, through :meth:`set_limits`.
    task_limit_owner: str | None = None

    def oom_kills(self) -> int | None:
        """How many of the cgroup's processes the kernel's OOM killer has
        killed so far (its memory limit reached, or the host's memory); None
        when this kind of cgroup, or one without the memory controller,
        cannot tell. Read it before :meth:`remove`."""
        return None


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

    def cap_pids(self, total: int) -> None:
        """Cap the tasks (processes and threads) of every lease cgroup of the
        subtree together at ``total`` (``pids.max`` of the subtree's root, which
        counts its whole subtree), so that workers never take what the agent
        keeps for itself. CgroupError when this host's cgroups cannot (no pids
        controller there), naming what is missing."""
        raise CgroupError(f"a process limit needs a cgroup with the pids controller, and this agent runs without "
                          f"one (c.AgentEnforcement.cgroup_mode = {self.mode!r})")

    def task_root(self) -> Path | None:
        """The subtree's folder in a v1 pids hierarchy, where a process that
        lives in another's cgroups (a Slurm job's) can be given a task limit
        without leaving them (v1 hierarchies are independent); None where
        this host has none."""
        return None

    def close(self) -> None:
        """Remove the agent's subtree if it is empty (and the ``gpupool``
        folder above it if that is empty too); quietly otherwise. Call when
        the agent stops, after its workers."""

