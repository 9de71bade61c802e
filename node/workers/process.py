"""The worker process contract: how the agent watches and stops the process
of one worker, whoever started it (:class:`WorkerProcess`), and its two
host kinds, :class:`LocalProcess` (this agent's child) and
:class:`AdoptedProcess` (found again after a restart). Why each is safe to
signal: docs/code.md, "The worker process contract".
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from typing import Any, Iterable

import psutil


class WorkerProcess(ABC):
    """The process of one worker. ``pid``: its process id (the kernel's:
    the start gate execs it in place)."""

    pid: int

    #: Why the exit code of the ended process is unknown, in words for the
    #: service's report; None when it is known.
    exit_note: str | None = None

    @property
    @abstractmethod
    def returncode(self) -> int | None:
        """The exit code once the process was reaped (negative: killed by
        that signal); None before, or when it cannot be known."""

    @abstractmethod
    def poll(self) -> int | None:
        """:attr:`returncode`, reaping the process when it exited and this
        agent is its parent."""

    @abstractmethod
    def exited(self) -> bool:
        """True once the process has exited, without reaping it (a zombie
        keeps its process group id until :meth:`wait`)."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> int | None:
        """Wait until the process has exited; returns :attr:`returncode`.
        ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""

    @abstractmethod
    def create_time(self) -> float:
        """psutil's start time of the process (epoch seconds; 0.0 when it is gone)."""

    @abstractmethod
    def children(self) -> list[psutil.Process]:
        """The processes it started that are still in its tree, now; empty
        once its pid may belong to someone else."""

    @abstractmethod
    def kill_group(self, contained: bool) -> None:
        """After its exit: SIGKILL what it left running in its process
        group. ``contained``: a cgroup holds them (and was killed), so a kind
        that must search every process for them may skip it."""

    @abstractmethod
    def kill(self, children: Iterable[psutil.Process], timeout: float) -> list[int]:
        """SIGKILL the process, its group and ``children`` (seen before it
        died) and wait up to ``timeout`` seconds; returns the pids still
        alive. Blocking."""

    @abstractmethod
    async def shutdown(self, manager: Any, grace: float) -> None:
        """Ask the kernel to exit through its kernel ``manager`` and wait up
        to ``grace`` seconds (a few more for the manager's own steps); the
        manager's files and sockets are released. Raises when it did not
        exit in time: the caller kills what is left."""


class LocalProcess(WorkerProcess):
    """A worker kernel this agent started: ``popen``, its child."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def exited(self) -> bool:
        if self.popen.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return self.popen.poll() is not None

    def wait(self, timeout: float | None = None) -> int | None:
        return self.popen.wait(timeout)

    def create_time(self) -> float:
        return create_time(self.pid)

    def children(self) -> list[psutil.Process]:
        if self.popen.returncode is not None:
            return []
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []

    def kill_group(self, contained: bool) -> None:
        # The leader is a zombie until reaped, so its process group id cannot
        # have been reused yet: the kill reaches only its own group.
        _kill_group(self.pid)

    def kill(self, children: Iterable[psutil.Process], timeout: float) -> list[int]:
        if self.popen.returncode is None:  # not reaped: the group id is still this worker's
            _kill_group(self.pid)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        children = list(children)
        for child in children:
            try:
                child.kill()  # psutil checks the create time: never a reused pid
            except psutil.Error:
                pass
        survivors = [child.pid for child in _wait_gone(children, timeout)]
        if self.popen.returncode is None:
            survivors.insert(0, self.pid)
        return survivors

    async def shutdown(self, manager: Any, grace: float) -> None:
        if self.popen.poll() is None:
            await asyncio.wait_for(manager.shutdown_kernel(), grace + 5)
            return
        # Dead and reaped already: only release the manager's pipes and files.
        # Not shutdown_kernel(now=True): it would signal a process group id
        # that may belong to someone else by now.
        await asyncio.wait_for(manager.provisioner.wait(), 5)
        await manager.cleanup_resources()


class AdoptedProcess(WorkerProcess):
    """A worker process started by an earlier run of the agent: ``proc``,
    a psutil handle, started at ``started`` (epoch seconds, from its
    record). Its exit code stays None: only its parent learns it."""

    exit_note = "the worker process ended (its exit code is unknown: it was re-adopted after an agent restart)"

    def __init__(self, proc: psutil.Process, started: float) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.started = started

    @property
    def returncode(self) -> None:
        return None

    def poll(self) -> None:
        return None

    def exited(self) -> bool:
        return not running(self.proc)

    def wait(self, timeout: float | None = None) -> None:
        try:
            self.proc.wait(timeout)
        except psutil.TimeoutExpired:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0) from None
        except psutil.Error:
            pass

    def create_time(self) -> float:
        return self.started

    def children(self) -> list[psutil.Process]:
        try:
            return self.proc.children(recursive=True) if not self.exited() else []
        except psutil.Error:
            return []

    def kill_group(self, contained: bool) -> None:
        if not contained:  # init reaped it: find its group's processes by their start time
            kill_all(left_behind(self.pid, self.started))

    def kill(self, children: Iterable[psutil.Process], timeout: float) -> list[int]:
        return kill_all([self.proc, *children], timeout)

    async def shutdown(self, manager: Any, grace: float) -> None:
        await asyncio.wait_for(self._ask_to_exit(manager, grace), grace + 5)
        await manager.cleanup_resources()

    async def _ask_to_exit(self, manager: Any, grace: float) -> None:
        # Not our child: jupyter_client's manager never started it, so ask on
        # the control channel (it answers while a cell runs) and watch the pid.
        client = manager.client()
        client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
        try:
            client.shutdown()
            await asyncio.to_thread(self.wait, grace)
        except subprocess.TimeoutExpired:
            pass
        finally:
            client.stop_channels()


def create_time(pid: int) -> float:
    """psutil's start time of ``pid`` (epoch seconds); 0.0 when it is gone."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def running(proc: psutil.Process) -> bool:
    """True while ``proc`` runs (not a zombie, not a reused pid)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def left_behind(pgid: int, since: float) -> list[psutil.Process]:
    """Live processes of process group ``pgid`` started at or after ``since``
    (epoch seconds): what a dead worker (a session leader, so its pid is the
    group's id) started and left running."""
    found = []
    for proc in psutil.process_iter(["pid", "create_time"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["create_time"] >= since - 0.01 and running(proc):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


async def kill_strays(strays: list[psutil.Process], log: logging.Logger) -> None:
    """Kill ``strays``, processes an earlier run of the agent left (a
    launcher's :meth:`~.launchers.base.WorkerLauncher.sweep`), logging which
    and any that survive SIGKILL."""
    if strays:
        log.warning("stopping %d process(es) an earlier run of the agent left: pids %s", len(strays),
                    ", ".join(str(p.pid) for p in strays))
        survivors = await asyncio.to_thread(kill_all, strays)
        if survivors:
            log.error("processes %s survived SIGKILL", survivors)


def kill_all(procs: list[psutil.Process], timeout: float = 10.0) -> list[int]:
    """SIGKILL ``procs``, their process groups while their leader still
    runs, and their descendants; wait up to ``timeout`` seconds. Returns the
    pids still alive (stuck in the kernel, say)."""
    targets: dict[int, psutil.Process] = {}
    for proc in procs:
        targets[proc.pid] = proc
        try:
            targets.update({child.pid: child for child in proc.children(recursive=True)})
        except psutil.Error:
            pass
    for proc in procs:
        if running(proc):
            try:
                # A live leader: its pid, and so its group id, cannot be reused yet.
                if os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
    for proc in targets.values():
        try:
            proc.kill()  # psutil checks the start time: never a reused pid
        except psutil.Error:
            pass
    return [proc.pid for proc in _wait_gone(list(targets.values()), timeout)]


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Poll until none of ``procs`` runs or ``timeout`` seconds passed; returns those still running."""
    deadline = time.monotonic() + timeout
    alive = [proc for proc in procs if running(proc)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [proc for proc in alive if running(proc)]
    return alive


def _kill_group(pgid: int) -> None:
    # Workers lead their own session (jupyter_client's launcher uses
    # start_new_session), so their pid is their process group id.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
