"""The agent's NVML inventory, read through a watched helper process.

A call into the NVIDIA driver can hang and cannot be cancelled, so the
agent never makes one: :class:`WatchedInventory` asks an NVML helper
(:mod:`.helper`, a process of its own) once per heartbeat for every
reading, waits for the answer off the event loop for at most ``timeout``
seconds (``c.AgentInventory.nvml_timeout``), and answers the :class:`Inventory`
methods from the last answer, so they never block. A helper that passes its
timeout (or dies) is killed and left behind; the node is ``degraded`` with
words saying the GPU driver stopped answering (its leases go on, nothing new
is placed there), and a new helper is started after a delay that doubles
from ``first`` to ``longest`` seconds (:func:`~gpupool.node.inventory.retrying.backoff_delay`).
Once one answers, the GPUs are registered again.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

from gpupool.wire.nodes import GPUInfo
from gpupool.units import format_duration

from ...attribution import memory_by_pid
from ..base import Inventory, InventoryError, InventoryOptions
from ..retrying import MAX_ERROR, backoff_delay

log = logging.getLogger("gpupool.agent")

#: Starting NVML (``nvmlInit`` and listing the GPUs) may take this many times
#: ``timeout``: without persistence mode the driver initialises every GPU then.
OPEN_FACTOR = 6
#: Seconds a helper gets to shut NVML down when the agent stops.
CLOSE_TIMEOUT = 1.0
#: What the readings are while no helper answers: nothing known.
NOTHING = {"error": None, "gpus": [], "metrics": [], "usage": [], "known": set(), "health": {},
           "versions": {"driver": None, "cuda": None}}


def helper_command() -> list[str]:
    """The program of the NVML helper, without its socket's fd (appended)."""
    return [sys.executable, "-m", "gpupool.node.inventory.nvml.helper"]


class HelperLost(Exception):
    """The helper did not answer in time, or is gone. ``why``: the words for
    the service (``inventory_error``)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Helper:
    """One helper process (``command`` + the fd of its end of a socket pair)
    and the agent's end, a :class:`~multiprocessing.connection.Connection`.
    Its stderr is the agent's (a traceback there lands in the agent's log)."""

    def __init__(self, command: Sequence[str]) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen([*command, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ask(self, request: tuple, timeout: float) -> tuple:
        """Send ``request``; the helper's answer, within ``timeout`` seconds.
        Log records it sends meanwhile are logged here. Raises
        :class:`HelperLost` when the time passes or the helper is gone."""
        deadline = time.monotonic() + timeout
        slow = None  # the NVML function the helper says has not returned yet
        try:
            self.conn.send(request)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self.conn.poll(left):
                    what = "NVML did not answer" if slow is None else f"{slow} did not return"
                    raise HelperLost(f"the GPU driver stopped answering: {what} within {format_duration(timeout)}")
                answer = self.conn.recv()
                if answer[0] == "slow":
                    slow = answer[1]
                    log.debug("NVML helper pid %d: %s has not returned after %.1fs", self.pid, slow, answer[2])
                elif answer[0] == "log":
                    _kind, level, name, message = answer
                    logging.getLogger(name).log(level, "%s", message)
                else:
                    return answer
        except (EOFError, OSError):
            try:
                code = self.proc.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
            raise HelperLost(f"the NVML helper process stopped (exit code {code})") from None

    def kill(self) -> None:
        """Kill the process (it may stay a while: a call stuck in the driver
        ends only when the driver lets it) and close the socket."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.conn.close()

    def gone(self) -> bool:
        """True once the process has ended (and is reaped)."""
        return self.proc.poll() is not None


class WatchedInventory(Inventory):
    """NVML through a helper process that is replaced when it hangs.

    ``host_proc``, ``first`` and ``longest`` go to the helper's
    :class:`~gpupool.node.inventory.retrying.RetryingInventory` (NVML failing to start is
    retried there) and are also the schedule on which a hung helper is
    replaced. ``timeout``: seconds one round of readings may take;
    ``open_timeout`` (default :data:`OPEN_FACTOR` x ``timeout``): starting
    NVML in a new helper. ``command``: the helper program (default
    :func:`helper_command`). ``clock``: monotonic seconds.

    Opens NVML on construction, blocking for up to ``open_timeout`` (the
    agent has no event loop running yet). Raises :class:`InventoryError`
    when there is no NVML to retry (no driver library, no GPU; the message
    says to pass ``--simulate``); a helper that hangs or NVML that may heal
    leaves the inventory failed (:attr:`error`) and tried again later.
    """

    kind = "nvml"

    @classmethod
    def create(cls, options: InventoryOptions) -> "WatchedInventory":
        """NVML as ``options`` say (``host_proc``, ``retry``, ``timeout``, ``helper``); raises as the constructor."""
        return cls(host_proc=options.host_proc, timeout=options.timeout, first=options.retry[0],
                   longest=options.retry[1], command=options.helper)

    def __init__(self, *, host_proc: str | None = None, timeout: float = 5.0, open_timeout: float | None = None,
                 first: float = 5.0, longest: float = 300.0, command: Sequence[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.open_timeout = OPEN_FACTOR * timeout if open_timeout is None else open_timeout
        self.first, self.longest = first, longest
        self._options = {"host_proc": host_proc, "first": first, "longest": longest, "slow_after": timeout / 2,
                         "log_level": logging.getLogger("gpupool").getEffectiveLevel()}
        self._command = list(command) if command else helper_command()
        self._clock = clock
        self._helper: Helper | None = None
        self._abandoned: list[Helper] = []
        self._readings: dict[str, Any] = NOTHING
        self._gpus: list[GPUInfo] = []
        self._helper_error: str | None = None
        self.failures = 0  # helpers lost in a row
        self.next_attempt = 0.0
        self._lock = threading.Lock()  # one request at a time
        self._pending: asyncio.Future | None = None
        self._closed = False
        self._start(first=True)

    @property
    def helper_pid(self) -> int | None:
        """The pid of the helper answering now; None while none is."""
        helper = self._helper
        return None if helper is None else helper.pid

    # -- the helper's life ----------------------------------------------------------------------------------

    def _start(self, first: bool = False) -> bool:
        """Start a helper and open NVML in it; True when NVML works after a
        lost helper. Raises InventoryError when ``first`` and NVML cannot be
        there at all."""
        try:
            self._helper = Helper(self._command)
        except OSError as exc:
            self._lost(f"the NVML helper could not start ({exc})")
            return False
        try:
            answer = self._helper.ask(("open", self._options), self.open_timeout)
        except HelperLost as exc:
            self._lost(exc.why)
            return False
        if answer[0] == "error":
            _kind, message, reason, retryable = answer
            if first and not retryable:
                self._helper.kill()
                self._helper.proc.wait()
                self._helper = None
                raise InventoryError(message, reason=reason, retryable=False)
            self._lost(reason)
            return False
        return self._apply(answer)

    def _apply(self, answer: tuple) -> bool:
        """Take the helper's readings; True when NVML just works again."""
        if answer[0] != "ok":
            log.error("the NVML helper failed: %s", answer[-1])
            self._lost(f"the NVML helper failed: {str(answer[-1]).strip().splitlines()[-1]}")
            return False
        readings = answer[1]
        back = bool(readings["came_back"])
        if self._helper_error is not None:
            if readings["error"] is None:
                log.warning("the GPU driver answers again (NVML helper pid %d, after %d lost helper(s)): this node "
                            "reports its GPUs again", self._helper.pid, self.failures)
                back = True
            self._helper_error, self.failures, self.next_attempt = None, 0, 0.0
        if readings["error"] is None or not self._gpus:
            self._gpus = list(readings["gpus"]) or self._gpus
        self._readings = readings
        return back

    def _lost(self, why: str) -> None:
        """Kill the helper (if any), read nothing, start another after the backoff."""
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.kill()
            self._abandoned.append(helper)
        if self._closed:
            return
        self.failures += 1
        delay = backoff_delay(self.failures, self.first, self.longest)
        self.next_attempt = self._clock() + delay
        self._readings = NOTHING
        why = why[:MAX_ERROR]
        if self._helper_error is None:
            log.warning("%s: this node reports it cannot read its GPUs (its leases go on, no new ones come); the "
                        "NVML helper%s was killed and a new one starts in %gs, then less and less often (up to "
                        "every %gs). If this repeats, look for Xid errors in the kernel log (dmesg) and at "
                        "nvidia-smi: the GPU may need a reset", why, f" (pid {helper.pid})" if helper else "",
                        delay, self.longest)
        else:
            log.log(logging.INFO if why != self._helper_error else logging.DEBUG,
                    "the NVML helper still fails (%s); next one in %gs", why, delay)
        self._helper_error = why

    def _reap(self) -> None:
        self._abandoned = [helper for helper in self._abandoned if not helper.gone()]

    # -- refreshing, off the event loop ---------------------------------------------------------------------

    def refresh(self) -> bool:
        """One round of readings from the helper, blocking for up to
        ``timeout`` (or ``open_timeout`` when a new helper starts): the
        agent calls it through :meth:`update`, never on its event loop.
        True when NVML just works again (the GPUs are to be registered)."""
        with self._lock:
            if self._closed:
                return False
            self._reap()
            if self._helper is None:
                if self._clock() < self.next_attempt:
                    return False
                return self._start()
            try:
                answer = self._helper.ask(("poll", None), self.timeout)
            except HelperLost as exc:
                self._lost(exc.why)
                return False
            return self._apply(answer)

    async def update(self) -> bool:
        """:meth:`refresh` in a thread; waits at most ``timeout`` (and a
        second) for it. A refresh still running then (a new helper opening
        NVML) goes on, and a later call returns its result."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(asyncio.to_thread(self.refresh))
        pending = self._pending
        done, _ = await asyncio.wait({pending}, timeout=self.timeout + 1.0)
        if not done:
            return False
        self._pending = None
        return pending.result()

    # -- the Inventory contract, from the last readings -----------------------------------------------------

    @property
    def error(self) -> str | None:  # type: ignore[override]
        """Why the GPUs cannot be read now: the helper is lost, or NVML fails in it."""
        return self._helper_error or self._readings["error"]

    def discover(self) -> list[GPUInfo]:
        """The GPUs last read; while NVML fails, the ones last known."""
        return list(self._gpus)

    def metrics(self) -> list[dict[str, Any]]:
        return [dict(reading) for reading in self._readings["metrics"]]

    def process_usage(self) -> list:
        return list(self._readings["usage"])

    def process_memory(self) -> dict[int, int]:
        return memory_by_pid(self.process_usage())

    def process_known(self) -> set[str]:
        return set(self._readings["known"])

    def versions(self) -> dict[str, str | None]:
        return dict(self._readings["versions"])

    def health(self) -> dict[str, dict[str, Any]]:
        return dict(self._readings["health"])

    def close(self) -> None:
        """Shut NVML down in the helper (for at most :data:`CLOSE_TIMEOUT`)
        and end it; kill what is left. Idempotent; never blocks for long."""
        self._closed = True
        if self._lock.acquire(blocking=False):
            try:
                helper, self._helper = self._helper, None
                if helper is not None:
                    try:
                        helper.ask(("close", None), CLOSE_TIMEOUT)
                        helper.proc.wait(CLOSE_TIMEOUT)
                    except (HelperLost, subprocess.TimeoutExpired):
                        pass  # killed below
                    helper.kill()
                    self._abandoned.append(helper)
            finally:
                self._lock.release()
        elif self._helper is not None:
            self._helper.proc.kill()  # the refresh under way finds it gone
        for helper in self._abandoned:
            try:
                helper.proc.wait(CLOSE_TIMEOUT)
            except subprocess.TimeoutExpired:
                log.warning("the NVML helper pid %d does not end (a call stuck in the GPU driver); leaving it",
                            helper.pid)
        self._reap()
