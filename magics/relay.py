"""Replays a worker's IOPub messages as outputs of the local cell.

Each message kind maps to what the local kernel would have produced itself:
``stream`` to ``sys.stdout``/``sys.stderr`` (so carriage-return progress bars
work), ``display_data``/``update_display_data`` through the display publisher
(display handles keep their ids), ``execute_result`` through the displayhook
(so it is the cell's ``Out[n]``), ``clear_output`` as itself, and ``error``
kept to be raised as :class:`RemoteError` when the cell ends. Streams are
flushed before any other output so the order is the worker's order.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from IPython.core.getipython import get_ipython
from IPython.display import clear_output, publish_display_data

from gpupool.units import format_bytes

_IGNORED = {"execute_input", "comm_open", "comm_msg", "comm_close", "shutdown_reply", "debug_event"}


class RemoteError(Exception):
    """An exception raised by a cell on the worker.

    IPython shows ``_render_traceback_()`` instead of a local traceback (as
    ipyparallel's ``RemoteError`` does), so the user sees the worker's
    traceback only. :func:`remote_error` builds a subclass named after the
    remote exception, so the cell's error says ``ZeroDivisionError``.
    """

    def __init__(self, ename: str, evalue: str, traceback: list[str]) -> None:
        super().__init__(evalue)
        self.ename, self.evalue, self.traceback = ename, evalue, traceback

    def _render_traceback_(self) -> list[str]:
        return self.traceback or [f"{self.ename}: {self.evalue}"]

    def __str__(self) -> str:
        return self.evalue


def remote_error(content: dict[str, Any]) -> RemoteError:
    """A RemoteError subclass named like the remote exception, from an
    ``error`` message's content (``ename``, ``evalue``, ``traceback``)."""
    ename = str(content.get("ename", "RemoteError"))
    name = ename if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", ename) else "RemoteError"
    kind = type(name, (RemoteError,), {"__module__": "gpupool.remote"})
    return kind(ename, str(content.get("evalue", "")), list(content.get("traceback", [])))


#: The MIME type of an ipywidgets view (jupyter-widgets' output): its model lives behind a comm.
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class OutputRelay:
    """Callable for :meth:`RemoteKernel.execute`: one IOPub message in, the
    same output out in the current cell. ``error`` holds the remote error's
    content after the cell, if any.

    ``max_bytes`` bounds what one cell relays (stream text and display data,
    counted in characters of their payloads; a ``clear_output`` starts the
    count again, since the front end drops what it cleared). What goes over
    it is dropped, with one note when the cut starts and :meth:`finish`
    saying how much was cut. ``execute_result`` and ``error`` always pass.
    A widget's view is shown as its text (its comm is not relayed).
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.error: dict[str, Any] | None = None
        self.max_bytes = max_bytes
        self.shown = 0
        self.cut = 0

    def __call__(self, msg: dict[str, Any]) -> None:
        kind, content = msg["header"]["msg_type"], msg["content"]
        if kind == "stream":
            stream = sys.stderr if content.get("name") == "stderr" else sys.stdout
            text = self._admit(content.get("text", ""))
            if text:
                stream.write(text)
            return
        if kind in _IGNORED:
            return
        if kind in ("display_data", "update_display_data", "execute_result") and WIDGET_VIEW in content.get("data", {}):
            # A widget's comm stays on the worker (this relay forwards no comms): its text stands in for it,
            # not a view the front end cannot find a model for.
            content = {**content, "data": {k: v for k, v in content["data"].items() if k != WIDGET_VIEW}}
            if not content["data"]:
                return
        if kind in ("display_data", "update_display_data") and not self._admit_whole(content.get("data", {})):
            return
        _flush()
        if kind == "clear_output":
            self.shown = 0
        if kind in ("display_data", "update_display_data"):
            publish_display_data(content.get("data", {}), content.get("metadata", {}),
                                 transient=content.get("transient") or None,
                                 update=kind == "update_display_data")
        elif kind == "execute_result":
            _show_result(content.get("data", {}), content.get("metadata", {}))
        elif kind == "clear_output":
            clear_output(wait=bool(content.get("wait")))
        elif kind == "error":
            self.error = content


    def _admit(self, text: str) -> str:
        """The part of ``text`` that fits under the cap (all of it without one)."""
        if self.max_bytes is None:
            return text
        room = max(0, self.max_bytes - self.shown)
        if len(text) > room:
            self._start_cut()
            self.cut += len(text) - room
            text = text[:room]
        self.shown += len(text)
        return text

    def _admit_whole(self, data: dict[str, Any]) -> bool:
        size = sum(len(v) if isinstance(v, str) else len(json.dumps(v)) for v in data.values())
        if self.max_bytes is not None and self.shown + size > self.max_bytes:
            self._start_cut()
            self.cut += size
            return False
        self.shown += size
        return True

    def _start_cut(self) -> None:
        if not self.cut:
            _flush()
            print(f"\ngpupool: this cell's output passed {format_bytes(self.max_bytes)}; the rest is cut "
                  "(c.GPUMagics.max_output_bytes)", file=sys.stderr, flush=True)

    def finish(self) -> None:
        """After the cell: say how much output was cut, if any."""
        _flush()
        if self.cut:
            print(f"gpupool: {format_bytes(self.cut)} of output not shown", file=sys.stderr, flush=True)


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


def _show_result(data: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Emit the remote result as this cell's ``execute_result`` (``Out[n]``)."""
    hook = getattr(get_ipython(), "displayhook", None)
    if hook is None:
        publish_display_data(data, metadata)
        return
    hook.start_displayhook()
    hook.write_output_prompt()
    hook.write_format_data(data, metadata)
    hook.finish_displayhook()


class OutputBudget:
    """The output cap of forwarded cells (``c.GPUMagics.max_output_bytes``),
    counted on the relay thread in bytes of each message's content and
    buffers, whole messages at a time (the relay does not decode them).
    ``stream``, ``display_data`` and ``update_display_data`` count;
    ``clear_output`` starts the count again (the front end drops what it
    cleared); everything else (results, errors, comms, widgets' state) passes."""

    COUNTED = ("stream", "display_data", "update_display_data")

    def __init__(self) -> None:
        self.reset(None)

    def reset(self, max_bytes: int | None) -> None:
        """A new cell starts with ``max_bytes`` (None: no cap)."""
        self.max_bytes, self.shown, self.cut, self._told = max_bytes, 0, 0, False

    def admit(self, msg_type: str, size: int) -> bool:
        if msg_type == "clear_output":
            self.shown = 0
        if self.max_bytes is None or msg_type not in self.COUNTED:
            return True
        if self.shown + size > self.max_bytes:
            self.cut += size
            return False
        self.shown += size
        return True

    def cut_started(self) -> bool:
        """True once, at the first message cut in this cell."""
        told, self._told = self._told, True
        return not told

    def cut_words(self) -> str:
        return (f"\ngpupool: this cell's output passed {format_bytes(self.max_bytes)}; the rest is cut "
                "(c.GPUMagics.max_output_bytes)\n")

    def finish_words(self) -> str:
        return f"gpupool: {format_bytes(self.cut)} of output not shown\n"
