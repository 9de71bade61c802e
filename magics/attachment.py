"""One notebook kernel attached to one lease: run cells, move variables, release.

An :class:`Attachment` owns the lease's worker connection and heartbeat. The
magics hold at most one; everything that talks to the worker goes through it.
"""

from __future__ import annotations

import getpass
from typing import Any

from gpupool.api import ServiceClient
from gpupool.errors import GPUPoolError
from gpupool.schema import Lease
from gpupool.transfer import dump_values, load_values

from .heartbeat import Heartbeat
from .relay import OutputRelay, remote_error
from .remote import RemoteKernel

TRANSFER_TARGET = "gpupool.transfer"


def ended_message(lease: Lease) -> str:
    """Words for a lease that ended without us asking, e.g. ``lease L-1 was
    reclaimed: idle for 30m (idle timeout 30m)`` or ``lease L-1 failed: ...``."""
    verb = "failed" if lease.state.value == "failed" else f"was {lease.state.value}"
    return f"lease {lease.id} {verb}: {lease.reason or 'no reason given'}"


class Attachment:
    """The attached lease: ``lease`` (as last seen), its ``remote`` kernel and
    its heartbeat. Create with :meth:`connect`."""

    def __init__(self, client: ServiceClient, lease: Lease, remote: RemoteKernel, heartbeat: Heartbeat) -> None:
        self.client, self.lease, self.remote, self.heartbeat = client, lease, remote, heartbeat

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
        interval = max(0.5, min((lease.heartbeat_ttl or 60) / 3, 15.0))
        beat = Heartbeat(client, lease.id, interval)
        beat.start()
        return cls(client, lease, remote, beat)

    @property
    def ended(self) -> Lease | None:
        """The lease as last seen if it ended behind our back, else None."""
        return self.heartbeat.ended

    def _check_alive(self) -> None:
        if self.heartbeat.ended is not None:
            raise GPUPoolError("lease_lost", ended_message(self.heartbeat.ended), 410)

    def run_cell(self, code: str) -> None:
        """Run ``code`` on the worker with its outputs in the current cell.

        Raises a :class:`~gpupool.magics.relay.RemoteError` subclass when the
        remote cell failed, GPUPoolError ``lease_lost`` when the lease ended
        while the cell ran, KeyboardInterrupt when interrupted.
        """
        self._check_alive()
        relay = OutputRelay()
        self.heartbeat.running(True)
        try:
            self.remote.execute(code, relay, _ask_stdin, self._check_alive)
        finally:
            self.heartbeat.running(False)
        if relay.error is not None:
            raise remote_error(relay.error)

    def push(self, values: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """Send ``values`` into the worker's namespace; returns ``(items sent,
        errors by name)``."""
        self._check_alive()
        header, buffers = dump_values(values)
        answer, _ = self.remote.comm_request(TRANSFER_TARGET, {"op": "push", "header": header}, buffers)
        _raise_unless_ok(answer)
        errors = {**header["errors"], **answer.get("errors", {})}
        return [i for i in header["items"] if i["name"] in answer.get("loaded", [])], errors

    def pull(self, names: list[str] | None, max_bytes: int | None = None) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, str]]:
        """Fetch ``names`` (None: all user variables) from the worker; GPU
        tensors arrive on the CPU. Returns ``(values, items, errors by name)``."""
        self._check_alive()
        request = {"op": "pull", "names": names} if names is not None else {"op": "pull_all", "max_bytes": max_bytes}
        answer, buffers = self.remote.comm_request(TRANSFER_TARGET, request)
        _raise_unless_ok(answer)
        values, errors = load_values(answer["header"], buffers)
        return values, [i for i in answer["header"]["items"] if i["name"] in values], errors

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
        raise GPUPoolError("transfer_failed", f"the worker could not complete the transfer: {answer.get('message')}", 502)


def _ask_stdin(request: dict[str, Any]) -> str:
    """Answer the worker's ``input_request`` by asking the notebook user."""
    prompt = request.get("prompt", "")
    return getpass.getpass(prompt) if request.get("password") else input(prompt)
