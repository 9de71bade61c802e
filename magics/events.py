"""Lease events of the gpupool kernel: said at the top of the next cell, and
sent to front ends that listen.

Notices that come while no cell runs (the idle warning, "parked", "node
lost", "node back", "resumed", a lease ended behind the user's back) must
not be written into an old cell's saved output. The kernel keeps them and
says each once at the top of the next cell's output; a front end (the
JupyterLab extension) that opens a comm to target ``gpupool.status`` gets
each at once as ``{"event": KIND, "message": WORDS}``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

TARGET = "gpupool.status"
log = logging.getLogger("gpupool.magics")


class Events:
    """Pending notices plus the open ``gpupool.status`` comms. ``notify`` may
    be called from any thread (the heartbeat's)."""

    def __init__(self, comm_manager: Any) -> None:
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._comms: dict[str, Any] = {}
        comm_manager.register_target(TARGET, self._opened)

    def _opened(self, comm: Any, msg: dict[str, Any]) -> None:
        with self._lock:
            self._comms[comm.comm_id] = comm
        comm.on_close(lambda msg: self._closed(comm.comm_id))

    def _closed(self, comm_id: str) -> None:
        with self._lock:
            self._comms.pop(comm_id, None)

    def notify(self, kind: str, message: str) -> None:
        """Keep ``message`` for the next cell and send it to the listening front ends."""
        with self._lock:
            self._pending.append(message)
            comms = list(self._comms.values())
        for comm in comms:
            try:
                comm.send({"event": kind, "message": message})
            except Exception:  # a closed front end must not lose the notice for the others
                log.warning("could not send a gpupool event to comm %s", comm.comm_id, exc_info=True)

    def take_pending(self) -> list[str]:
        """The notices since the last call, oldest first (and forget them)."""
        with self._lock:
            pending, self._pending = self._pending, []
        return pending
