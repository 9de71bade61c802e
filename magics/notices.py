"""Lease notices of the gpupool kernel: what the heartbeat thread says
(idle warnings, parked, ended, node lost or back, preemption) reaches the
user once, and only while it is true.

A notice goes into the forwarded cell that runs now, or else waits for the
top of the next cell (never under an old one), and goes to listening front
ends as an event (:mod:`gpupool.magics.events`) either way.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

#: Notice kinds a forwarded cell says itself (its UsageError; the resume's line), so not atop it too.
SAID_BY_CELL = ("ended", "parked")
#: Notice kinds that are news, not warnings: on stdout, as the magics' own lines are (JupyterLab shows
#: stderr on a warning background); the others on stderr.
NEWS = ("resumed", "node_back", "service_back")
#: Seconds a cell waits, at most, for a heartbeat to see whether the service answers again before
#: it says that it does not (only when it would say so).
RECHECK_S = 1.0


def stream_of(kind: str) -> str:
    """``"stdout"`` or ``"stderr"``: where a notice of ``kind`` is said (:data:`NEWS`)."""
    return "stdout" if kind in NEWS else "stderr"


class Notices:
    """The notices of the gpupool kernel: said into its forwarded ``cell``
    (:class:`~.cell.ForwardedCell`) or atop the next one, and sent as
    ``events`` (:class:`~.events.Events`); what the user was told is marked on
    the attachment of ``lifecycle`` (:class:`~.lifecycle.Lifecycle`, set once
    the magics exist, which take these notices)."""

    def __init__(self, cell, events) -> None:
        self.cell, self.events = cell, events
        self.lifecycle = None
        self._lock = threading.Lock()
        self._pending: list[tuple[str, str, Any]] = []  # (kind, words, heartbeat) for the next cell

    def notify(self, kind: str, message: str, beat=None) -> None:
        """A notice from the heartbeat thread ``beat`` (a
        :class:`~.heartbeat.KernelHeartbeat`); none of a lease given up here
        (``beat`` stopped): it would be stale."""
        if beat is not None and beat.stopped:
            return
        running = self.cell.running
        if running is not None:
            self.cell.note(running, f"gpupool: {message}\n", stream_of(kind))
        else:
            with self._lock:
                self._pending.append((kind, message, beat))
        self.events.notify(kind, message)

    def say(self, forwarded: bool) -> None:
        """Say the notices that came since the last cell at the top of this
        one, but none of a lease given up since (its heartbeat stopped: a
        release, a resume), and, atop a cell to be ``forwarded``, not that
        the lease ended or was parked: the cell says that itself (its error,
        the resume's line); nor an idle warning that such a notice overtook,
        or whose lease ended, was parked or passed its deadline meanwhile. The ended lease a cell here was told of is let
        go at once, so that no later cell says its end again."""
        with self._lock:
            pending, self._pending = self._pending, []
        pending = self._recheck_service(pending)
        # A warning that the lease will be parked is stale once it was (or ended): only the later notice is said.
        overtaken = {id(beat) for kind, _, beat in pending if kind in SAID_BY_CELL}
        said = set()
        for kind, text, beat in pending:
            if forwarded and kind == "parked":
                self._unsaid_park(beat)
            if (beat is not None and beat.stopped) or (forwarded and kind in SAID_BY_CELL) \
                    or (kind == "idle_warning" and (id(beat) in overtaken or _stale(beat))):
                continue
            stream = getattr(sys, stream_of(kind))
            print(f"gpupool: {text}", file=stream)
            said.add(stream)
            self._told(kind, beat)
        for stream in said:  # before the worker's output; a flush costs a round trip to the IOPub thread
            stream.flush()

    def _recheck_service(self, pending: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
        """``pending``, where a notice that the service does not answer is said only if it still
        does not: its heartbeat beats again first (at most :data:`RECHECK_S`), and an outage that
        ended meanwhile is said by its "answers again" alone."""
        down = {id(beat): beat for kind, _, beat in pending if kind == "service_down" and beat is not None}
        if not down:
            return pending
        for beat in down.values():
            beat.recheck_service(RECHECK_S)
        with self._lock:
            pending, self._pending = pending + self._pending, []
        back = {id(beat) for kind, _, beat in pending if kind == "service_back"}
        return [(kind, text, beat) for kind, text, beat in pending if not (kind == "service_down" and id(beat) in back)]

    def _unsaid_park(self, beat) -> None:
        """A park notice left unsaid atop a forwarded cell: that cell's resume line says it, and
        what the park could not keep with it (not marked said: :meth:`.park.Parked.not_kept`)."""
        lifecycle = self.lifecycle
        attachment = lifecycle.attachment if lifecycle is not None else None
        if attachment is not None and beat is attachment.heartbeat and attachment.parked is not None:
            attachment.parked.lost_said = ()

    def _told(self, kind: str, beat) -> None:
        lifecycle = self.lifecycle
        attachment = lifecycle.attachment if lifecycle is not None else None
        if attachment is None or beat is not attachment.heartbeat:
            return
        if kind == "ended" and attachment.ended is not None:
            lifecycle.drop()
        elif kind == "parked" and attachment.parked is not None:
            attachment.parked.told = True


def _stale(beat) -> bool:
    """Whether the idle warning of heartbeat ``beat`` is stale now: what it
    warned of happened (or its deadline passed), though no notice said so yet."""
    stale = getattr(beat, "warning_stale", None)
    return bool(stale and stale())
