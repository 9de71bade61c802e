"""How the agent watches and stops a worker that runs as a pod: the worker
code's process and cgroup contracts (:class:`~...process.WorkerProcess`,
:class:`~....cgroups.LeaseCgroup`) over the worker's pod, all through the API
server, since an unprivileged agent sees none of the pod's processes
(liveness, stop, GPU memory, park: docs/launchers.md, "Kubernetes").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import subprocess
import time
from typing import Any, Iterable

import psutil

from ....cgroups import CgroupError, LeaseCgroup
from ...process import WorkerProcess
from .client import PodClient, PodError
from .status import end_words, ended, exit_code, started_at

#: Seconds between two reads of a pod being stopped (until the API server no longer has it).
GONE_POLL_S = 0.2
#: Seconds an ended pod's deletion may take beyond its grace period before the stop gives up on it.
DELETE_SLACK_S = 10.0


class PodWatch:
    """The API side of one worker pod (``name``, ``uid``) through
    ``client``: reads it, deletes it, waits for it to go. Every call runs on
    ``loop`` (the agent's); :meth:`delete_blocking` brings a thread's call there."""

    def __init__(self, client: PodClient, name: str, uid: str, loop: asyncio.AbstractEventLoop,
                 log: logging.Logger) -> None:
        self.client = client
        self.name = name
        self.uid = uid
        self.loop = loop
        self.log = log
        self._deleting: set[asyncio.Task] = set()  # background deletions: a task nothing holds may be collected

    async def read(self) -> dict[str, Any] | None:
        """The pod, or None when it is gone (or another pod took its name: not ours). PodError."""
        pod = await self.client.pod(self.name)
        if pod is not None and (pod.get("metadata") or {}).get("uid") != self.uid:
            return None
        return pod

    async def delete(self, grace: float, wait: float) -> bool:
        """Delete the pod (``grace`` seconds for its kernel to exit on
        SIGTERM) and wait up to ``wait`` seconds until the API server no longer
        has it; True once it is gone. PodError."""
        await self.client.delete_pod(self.name, grace_seconds=max(0, int(grace)))
        deadline = time.monotonic() + wait
        while await self.read() is not None:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(GONE_POLL_S)
        return True

    def delete_blocking(self, timeout: float) -> bool:
        """:meth:`delete` for the reaper's blocking kill, waiting up to
        ``timeout`` seconds; True once the pod is gone. From a thread, the
        calls run on the agent's loop; on the loop itself (a reap) the
        deletion only starts, in the background (False), so the loop never
        waits on the API server. CgroupError when the API refuses."""
        if _on(self.loop):
            task = self.loop.create_task(self.delete(0, 0))
            self._deleting.add(task)
            task.add_done_callback(self._logged)
            return False
        future = asyncio.run_coroutine_threadsafe(self.delete(0, timeout), self.loop)
        try:
            return future.result(timeout + 5)
        except (PodError, concurrent.futures.TimeoutError) as exc:
            future.cancel()
            why = exc or "the API server did not answer"
            raise CgroupError(f"could not delete the worker pod {self.name}: {why}") from None

    def _logged(self, task: asyncio.Task) -> None:
        self._deleting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("could not delete the ended worker pod %s: %s", self.name, task.exception())


class PodProcess(WorkerProcess):
    """The kernel of a worker pod, as the agent knows it: through the pod.
    ``pid`` is 0 (the pod's processes have no host PID the agent may read);
    the exit code is the container's (:func:`.status.exit_code`); the pod
    is read every ``interval`` seconds until it ended."""

    pid = 0

    def __init__(self, watch: PodWatch, interval: float, pod: dict[str, Any]) -> None:
        self.watch = watch
        self.interval = interval
        self._started = started_at(pod)
        self._pod: dict[str, Any] | None = pod
        self._ended = False
        self._words: str | None = None
        self._task = watch.loop.create_task(self._follow())

    @property
    def exit_note(self) -> str | None:  # type: ignore[override]
        """Why the pod ended, in the cluster's words; None while it runs."""
        return self._words

    @property
    def returncode(self) -> int | None:
        return exit_code(self._pod) if self._ended else None

    def poll(self) -> int | None:
        return self.returncode

    def exited(self) -> bool:
        return self._ended

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait (blocking, from a thread) until the pod was seen ended;
        ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ended:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pod {self.watch.name}", timeout or 0)
            time.sleep(0.05)
        return self.returncode

    def create_time(self) -> float:
        return self._started

    def children(self) -> list[psutil.Process]:
        return []  # none the agent can see

    def kill_group(self, contained: bool) -> None:
        """Nothing: the pod's cgroup holds what the kernel started (:meth:`PodGroup.kill`)."""

    def kill(self, children: Iterable[psutil.Process], timeout: float) -> list[int]:
        """Delete the pod (from a thread) and wait up to ``timeout`` seconds; ``[0]`` when it is still there."""
        self.watch.loop.call_soon_threadsafe(self._task.cancel)
        try:
            gone = self.watch.delete_blocking(timeout)
        except CgroupError as exc:
            self.watch.log.error("%s", exc)
            gone = False
        self._seen(None if gone else self._pod, f"the worker's pod {self.watch.name} was deleted by the agent")
        return [] if gone else [self.pid]

    async def shutdown(self, manager: Any, grace: float) -> None:
        """Ask the kernel to exit (``shutdown_request`` on its control
        channel), give it ``grace`` seconds to, then delete the pod and wait
        until it is gone; release the manager's sockets and files."""
        self._task.cancel()
        try:
            if not self._ended:
                await _ask_to_exit(manager)
            gone = await self.watch.delete(grace, grace + DELETE_SLACK_S)
            if not gone:
                raise PodError(f"the worker pod {self.watch.name} was still there {grace + DELETE_SLACK_S:g} s "
                               "after its deletion")
            self._seen(None, f"the worker's pod {self.watch.name} was deleted by the agent")
        finally:
            await manager.cleanup_resources()

    async def _follow(self) -> None:
        """Read the pod every ``interval`` seconds until it ended. A failed
        read is logged and tried again: the API server's hiccup is no worker's death."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                pod = await self.watch.read()
            except PodError as exc:
                self.watch.log.warning("could not read worker pod %s: %s", self.watch.name, exc)
                continue
            if ended(pod):
                self._seen(pod, end_words(self.watch.name, pod))
                return
            self._pod = pod

    def _seen(self, pod: dict[str, Any] | None, words: str) -> None:
        """The pod ended as ``pod`` shows it (None: gone); the first words stay."""
        if not self._ended:
            self._pod, self._words, self._ended = pod if pod is not None else self._pod, words, True


class PodGroup(LeaseCgroup):
    """Where a worker pod's processes live: the pod's cgroup, the
    kubelet's. It confines them (every process of the pod dies with it, the
    pod's CPU and memory limits hold them), but an unprivileged agent can
    neither list nor freeze them."""

    kind = "kubernetes"
    confines = True
    freeze_method = "none: an unprivileged agent cannot freeze a pod's cgroup"
    task_limit_owner = "the kubelet (its podPidsLimit)"

    def __init__(self, watch: PodWatch) -> None:
        super().__init__(watch.name)
        self.watch = watch

    def add(self, pid: int) -> None:
        """Nothing: the kubelet put the pod's processes in its cgroup."""

    def pids(self) -> set[int]:
        """None readable: the pod's processes have no host PID the agent may see (GPU memory is not accounted)."""
        return set()

    def kill(self, timeout: float = 10.0) -> list[int]:
        """Delete the pod (the kubelet kills every process of it) and wait up
        to ``timeout`` seconds until it is gone; on the agent's loop (a
        reap) the deletion only starts. Returns ``[]``; CgroupError
        when the API refuses or the pod outlives ``timeout``."""
        if not self.watch.delete_blocking(timeout) and timeout > 0 and not _on(self.watch.loop):
            raise CgroupError(f"the worker pod {self.watch.name} was still there {timeout:g} s after its deletion")
        return []

    def remove(self) -> None:
        """Nothing: the pod's cgroup goes with the pod."""

    def set_limits(self, cpu: float | None = None, memory: int | None = None, pids: int | None = None) -> None:
        """Nothing: the pod was made with the lease's CPUs and memory as its
        requests and limits (:func:`.pods.worker_pod`), which the kubelet's
        cgroup holds; the task limit is the kubelet's (``podPidsLimit``)."""

    def freeze(self, timeout: float = 10.0) -> None:
        """CgroupError always: the pod's cgroup is the kubelet's, and the
        device plugin's GPU stays with the pod for its life; the park path
        then spills the worker instead (docs/launchers.md, "Kubernetes")."""
        raise CgroupError(f"the worker pod {self.name} cannot be frozen: an unprivileged agent cannot freeze a pod's "
                          "cgroup (its GPU stays with the pod while it lives)")

    def thaw(self) -> None:
        """Nothing: a pod is never frozen."""


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    """True when called on ``loop``'s own thread, while it runs."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


async def _ask_to_exit(manager: Any) -> None:
    """Send ``shutdown_request`` on the kernel's control channel (answered
    even while a cell runs); the pod's deletion, next, waits for its exit."""
    client = manager.client()
    client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
    try:
        client.shutdown()
        await asyncio.sleep(0.2)  # ZeroMQ sends in the background: let the request leave before the socket closes
    finally:
        client.stop_channels()
