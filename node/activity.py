"""Whether a worker is running a cell, read from its IOPub ``status`` messages.

The service reclaims a lease for idleness only when the agent reports its
worker ``idle`` for the lease's idle timeout: a running cell is never
reclaimed for idleness. ipykernel publishes ``status: busy`` before and
``status: idle`` after every request it handles, on shell and control alike,
each with the request as parent. :class:`WorkerActivity` turns that stream
into ``execution_state`` and ``idle_since``; :func:`watch_iopub` feeds it
from a SUB socket.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
import time
from datetime import datetime, timezone
from typing import Any, Callable

import zmq.asyncio

from gpupool.kernelconn import connect_channel, kernel_session
from gpupool.schema import WorkerState, isoformat


#: How many ended cells a worker's report repeats (a heartbeat every few seconds sees them all
#: unless cells under a tenth of its interval follow each other; the service ignores what it has).
RECENT_CELLS = 32


class WorkerActivity:
    """Execution state of one worker.

    ``execution_state`` is ``"starting"`` until :meth:`mark_ready`, then
    ``"busy"`` while any request is in flight, else ``"idle"``. Requests are
    tracked by parent message id rather than by the last status alone, because
    ipykernel answers control requests (interrupt, debug) while a shell
    request runs, and their ``idle`` must not hide the running cell.

    ``idle_since`` (epoch seconds) is when the last cell (``execute_request``)
    ended, or when the worker became ready if no cell ran yet; None while
    busy. ``cell_started`` (epoch seconds) is when the last cell started (None:
    none yet); ``cells`` the ``(start, end)`` of the last :data:`RECENT_CELLS`
    cells that ended, oldest first: each heartbeat sends them, so the service
    records every cell, also the ones that start and end between two beats.
    Other requests (``kernel_info``, completion) change the state while they
    run but do not count as use. ``clock`` is the time seam for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._ready = False
        self._in_flight: dict[str, str] = {}  # parent msg_id -> msg_type
        self._idle_since: float | None = None
        self.cell_started: float | None = None
        self.cells: deque[tuple[float, float]] = deque(maxlen=RECENT_CELLS)

    def mark_ready(self) -> None:
        """The worker answered ``kernel_info``: from now on it is idle or busy."""
        if not self._ready:
            self._ready = True
            self._idle_since = self._clock()

    def on_message(self, msg: dict[str, Any]) -> None:
        """Account for one deserialized IOPub message (others than ``status``
        are ignored)."""
        if msg.get("msg_type") != "status":
            return
        parent = msg.get("parent_header") or {}
        msg_id = parent.get("msg_id")
        if not msg_id:  # "starting" has no parent
            return
        state = msg.get("content", {}).get("execution_state")
        if state == WorkerState.busy:
            self._in_flight[msg_id] = parent.get("msg_type", "")
            if self._ready and parent.get("msg_type") == "execute_request":
                self.cell_started = self._clock()
        elif state == WorkerState.idle:
            msg_type = self._in_flight.pop(msg_id, parent.get("msg_type", ""))
            if msg_type == "execute_request" and self._ready:
                self._idle_since = self._clock()
                if self.cell_started is not None:
                    self.cells.append((self.cell_started, self._idle_since))

    @property
    def execution_state(self) -> WorkerState:
        if not self._ready:
            return WorkerState.starting
        return WorkerState.busy if self._in_flight else WorkerState.idle

    @property
    def cell_running(self) -> bool:
        """Whether a cell (an ``execute_request``) is in flight. Other requests are
        not cells: the agent's own comm requests before a park (their idle status
        may reach this watcher only after the freeze) must not make the park
        "mid-cell"."""
        return "execute_request" in self._in_flight.values()

    @property
    def idle_since(self) -> float | None:
        """Epoch seconds, or None while busy or starting."""
        return self._idle_since if self.execution_state == WorkerState.idle else None

    def idle_since_iso(self) -> str | None:
        """:attr:`idle_since` as the wire's ISO 8601 UTC string."""
        return _iso(self.idle_since)

    def cell_started_iso(self) -> str | None:
        """:attr:`cell_started` as the wire's ISO 8601 UTC string."""
        return _iso(self.cell_started)

    def cells_iso(self) -> list[list[str]]:
        """:attr:`cells` as ``[start, end]`` pairs of ISO 8601 UTC strings."""
        return [[_iso(start), _iso(end)] for start, end in self.cells]


def _iso(epoch: float | None) -> str | None:
    return None if epoch is None else isoformat(datetime.fromtimestamp(epoch, timezone.utc))


async def watch_iopub(activity: WorkerActivity, connection: dict[str, Any], context: zmq.asyncio.Context,
                      log: logging.Logger, ready: asyncio.Event | None = None) -> None:
    """Feed ``activity`` from the worker's IOPub until cancelled.

    ``connection`` is the worker's connection info (``key`` as bytes or str). Only
    ``kernel.*`` topics are subscribed (status, execute_input, shutdown): a
    cell that prints megabytes never reaches the agent, so a slow agent cannot
    make the kernel's IOPub drop a ``status`` message at its high-water mark.
    ``ready`` is set once the subscription is confirmed by ipykernel's
    ``iopub_welcome`` (ipykernel >= 7) or the first message.
    """
    session = kernel_session(connection)
    socket = connect_channel(context, connection, "iopub", topic=b"kernel.")  # CurveZMQ when the worker encrypts
    try:
        while True:
            frames = await socket.recv_multipart()
            if ready is not None:
                ready.set()
            try:
                _idents, parts = session.feed_identities(frames)
                msg = session.deserialize(parts, content=True)
            except Exception as exc:  # a bad frame must not end the watch
                log.debug("ignoring an unreadable IOPub message: %s", exc)
                continue
            activity.on_message(msg)
    finally:
        socket.close(linger=0)
