"""One notebook kernel attached to one lease: run cells, move variables, release.

An :class:`Attachment` owns the lease's worker connection and heartbeat. The
magics hold at most one; everything that talks to the worker goes through it.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import threading
from typing import Any, Callable

from gpupool.api import ServiceClient
from gpupool.errors import GPUPoolError, Reason
from gpupool.heartbeat import beat_interval, ended_message
from gpupool.kernelcmd import TRANSFER_TARGET
from gpupool.wire.leases import Lease
from gpupool.transfer import load_pulled

from . import dataplane
from .heartbeat import Heartbeat
from .park import Parked, park, park_due, park_reason
from .relay import OutputRelay, remote_error
from gpupool.remote import RemoteKernel, interrupt_from_thread

log = logging.getLogger("gpupool.magics")


class Attachment:
    """The attached lease: ``lease`` (as last seen), its ``remote`` kernel and
    its heartbeat. Create with :meth:`connect`."""

    def __init__(self, client: ServiceClient, lease: Lease, remote: RemoteKernel, heartbeat: Heartbeat) -> None:
        self.client, self.lease, self.remote, self.heartbeat = client, lease, remote, heartbeat
        # Held by the main thread while it talks to the worker; the heartbeat thread
        # parks only when it can take it without waiting.
        self.lock = threading.Lock()
        self.parked: Parked | None = None
        # Where the worker runs, in words (set when the gpupool kernel attaches; docs/api.md "Working directory").
        self.workdir: str | None = None

    def park_when_idle(self, ahead: float, max_bytes: int | None,
                       take: Callable[[dict[str, Any], list[dict[str, Any]]], None]) -> None:
        """Park (see :mod:`gpupool.magics.park`) ``ahead`` seconds before the
        service would reclaim this lease for idleness; ``take(values, items)``
        receives the variables (called on the heartbeat thread)."""
        def on_beat(lease: Lease) -> bool:
            due = self.heartbeat.preempted or park_due(lease, ahead, self.heartbeat.interval)
            if not due or not self.lock.acquire(blocking=False):
                return False
            try:
                self.parked = park(self.lease, max_bytes, take, self._release_lease, TRANSFER_TARGET,
                                   why=self.heartbeat.preempted or park_reason(lease))
            except GPUPoolError as exc:
                log.warning("could not park %s: %s", self.lease.id, exc.message)
                return False
            finally:
                self.lock.release()
            count = len(self.parked.names)
            self.heartbeat.say(f"lease {self.lease.id} was {self.parked.why}: {count} name{'s' * (count != 1)} "
                               "came back to this kernel; the next cell resumes on a slice of the same size",
                               kind="parked")
            return True

        self.heartbeat.on_beat = on_beat
        self.heartbeat.park_ahead = ahead
        self.heartbeat.on_preempt = self._interrupt

    def _interrupt(self, lease: Lease) -> None:
        """Interrupt the running cell (KeyboardInterrupt on the worker) over a
        connection of this thread's own; parking follows once it is idle."""
        interrupt_from_thread(self.lease.connection or {})

    def _release_lease(self, lease_id: str, reason: str) -> Lease:
        return self.client.release(lease_id, reason=reason)

    @classmethod
    def connect(cls, client: ServiceClient, lease: Lease, timeout: float = 30.0) -> "Attachment":
        """Connect to an ``active`` lease's worker and start heartbeating.

        Raises GPUPoolError ``worker_unreachable`` if the worker does not answer.
        """
        remote = RemoteKernel(lease.connection or {})
        try:
            remote.wait_ready(timeout)
        except BaseException:
            remote.close()
            raise
        beat = Heartbeat(client, lease.id, beat_interval(lease))
        beat.start()
        return cls(client, lease, remote, beat)

    @property
    def ended(self) -> Lease | None:
        """The lease as last seen if it ended behind our back, else None."""
        return self.heartbeat.ended

    def check_alive(self) -> None:
        if self.heartbeat.ended is not None:
            raise GPUPoolError(Reason.lease_lost, ended_message(self.heartbeat.ended), 410)
        if self.parked is not None:  # parked between the magic's check and now: rare, say it plainly
            raise GPUPoolError(Reason.lease_lost, f"lease {self.lease.id} was just parked after idle; "
                               "run the cell again to resume on a new slice", 410)

    def run_cell(self, code: str, max_output_bytes: int | None = None) -> None:
        """Run ``code`` on the worker with its outputs in the current cell.

        Raises a :class:`~gpupool.magics.relay.RemoteError` subclass when the
        remote cell failed, GPUPoolError ``lease_lost`` when the lease ended
        while the cell ran, KeyboardInterrupt when interrupted.
        """
        relay = OutputRelay(max_output_bytes)
        with self.lock:
            self.check_alive()
            self.heartbeat.running(True)
            try:
                self.remote.execute(code, relay, _ask_stdin, self.check_alive)
            finally:
                self.heartbeat.running(False)
                relay.finish()
        if relay.error is not None:
            raise remote_error(relay.error)

    def push(self, values: dict[str, Any], devices: dict[str, str] | None = None
             ) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """Send ``values`` into the worker's namespace; ``devices`` (name ->
        ``"cuda:0"``) says where the worker puts each one (what a pull
        recorded; a value whose device is missing there stays on the CPU and
        is listed in the errors). Returns ``(items sent, errors by name)``."""
        with self._guarded():
            header, answer = dataplane.push(self._comm_unlocked, self.remote.connection, values, devices or {})
        errors = {**header["errors"], **answer.get("errors", {})}
        return [i for i in header["items"] if i["name"] in answer.get("loaded", [])], errors

    def pull(self, names: list[str] | None, max_bytes: int | None = None) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, str]]:
        """Fetch ``names`` (None: all user variables) from the worker; GPU
        tensors arrive on the CPU. Returns ``(values, items, errors by name)``."""
        request = {"op": "pull", "names": names} if names is not None else {"op": "pull_all", "max_bytes": max_bytes}
        with self._guarded():
            header, buffers = dataplane.pull(self._comm_unlocked, self.remote.connection, request)
        try:
            return load_pulled(header, buffers)
        except KeyboardInterrupt:
            raise dataplane.TransferInterrupted("unpacking", [i["name"] for i in header.get("items", [])]) from None

    def have(self, names: list[str]) -> set[str]:
        """Which of ``names`` the worker's namespace holds (one comm round trip)."""
        answer, _ = self._comm({"op": "have", "names": names})
        return set(answer.get("have", []))

    def versions(self) -> dict[str, str]:
        """The worker's Python and key package versions (see gpupool.transfer.package_versions)."""
        answer, _ = self._comm({"op": "versions"}, timeout=30)
        return dict(answer.get("versions", {}))

    def request(self, data: dict[str, Any], timeout: float = 30.0) -> tuple[dict[str, Any], list]:
        """One op of the worker's transfer comm (``{"op": ...}``, see
        gpupool.provisioner.worker_extension.comm.REMOTING_OPS); raises GPUPoolError
        ``transfer_failed`` when the worker answers not ok."""
        return self._comm(data, timeout=timeout)

    def _comm(self, request: dict[str, Any], buffers: list | None = None,
              timeout: float = 600.0) -> tuple[dict[str, Any], list]:
        """One transfer request, guarded like a cell: it ends as soon as the
        lease is seen ended or the worker stops answering its heartbeat."""
        with self._guarded():
            return self._comm_unlocked(request, buffers, timeout)

    @contextlib.contextmanager
    def _guarded(self):
        """Hold the lock and count as running (no idle reclaim, no parking)
        for one transfer, all its round trips and its stream."""
        with self.lock:
            self.check_alive()
            self.heartbeat.running(True)
            try:
                yield
            finally:
                self.heartbeat.running(False)

    def _comm_unlocked(self, request: dict[str, Any], buffers: list | None = None,
                       timeout: float = 600.0) -> tuple[dict[str, Any], list]:
        answer, buffers = self.remote.comm_request(TRANSFER_TARGET, request, buffers, timeout=timeout,
                                                   check=self.check_alive)
        _raise_unless_ok(answer)
        return answer, buffers

    def release(self, reason: str | None = None) -> Lease:
        """Stop heartbeating, close the connection and release the lease."""
        self.heartbeat.stop()
        self.remote.close()
        return self.client.release(self.lease.id, reason=reason)

    def refresh(self) -> Lease:
        """The lease as the service sees it now."""
        self.lease = self.client.get_lease(self.lease.id)
        return self.lease


def _raise_unless_ok(answer: dict[str, Any]) -> None:
    if not answer.get("ok"):
        raise GPUPoolError(Reason.transfer_failed,
                           f"the worker could not complete the transfer: {answer.get('message')}", 502)


def _ask_stdin(request: dict[str, Any]) -> str:
    """Answer the worker's ``input_request`` by asking the notebook user."""
    prompt = request.get("prompt", "")
    return getpass.getpass(prompt) if request.get("password") else input(prompt)
