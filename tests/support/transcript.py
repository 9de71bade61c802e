"""A notebook kernel's IOPub as a person reads it: stream text under each
cell, and the events of the ``gpupool.status`` comm."""

from __future__ import annotations

import queue
import re

from procs import wait_for


class Transcript:
    """Every IOPub stream text of one kernel, in arrival order, with the id of
    the request it belongs to (a notebook shows it under that cell)."""

    def __init__(self, kc) -> None:
        self.kc = kc
        self.streams: list[tuple[str | None, str]] = []  # (parent msg_id, text)
        self.events: list[dict] = []  # what the gpupool.status comm sent
        self.states: list[dict] = []  # and the state snapshots it sent, in order
        self._idle: set[str] = set()

    def listen(self) -> None:
        """Open a comm to the kernel's ``gpupool.status`` target, as the JupyterLab extension does."""
        msg = self.kc.session.msg("comm_open", {"comm_id": "status-1", "target_name": "gpupool.status", "data": {}})
        self.kc.shell_channel.send(msg)

    def pump(self) -> None:
        """Read what has arrived (up to 0.2 s of waiting)."""
        try:
            while True:
                msg = self.kc.get_iopub_msg(timeout=0.2)
                parent = msg["parent_header"].get("msg_id")
                if msg["msg_type"] == "stream":
                    self.streams.append((parent, msg["content"]["text"]))
                elif msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == "status-1":
                    if "event" in msg["content"]["data"]:
                        self.events.append(msg["content"]["data"])
                    elif "state" in msg["content"]["data"]:
                        self.states.append(msg["content"]["data"]["state"])
                elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    self._idle.add(parent)
        except queue.Empty:
            pass

    def execute(self, code: str, timeout: float = 60, ok: bool = True) -> tuple[str, dict]:
        """Run a cell; returns ``(msg_id, reply content)`` once the kernel is idle after it
        (its reply ``ok``, or an error when not ``ok``)."""
        msg_id = self.kc.execute(code)
        wait_for(lambda: self.pump() or msg_id in self._idle, timeout, f"the cell {code!r}")
        reply = self.kc.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=timeout)
        assert (reply["content"]["status"] == "ok") == ok, (code, reply["content"], self.text())
        return msg_id, reply["content"]

    def text(self) -> str:
        return "".join(text for _, text in self.streams)

    def lines(self, pattern: re.Pattern | str) -> list[tuple[int, str | None, str]]:
        """``(position, parent, line)`` of each line matching ``pattern``."""
        return [(i, parent, line) for i, (parent, text) in enumerate(self.streams)
                for line in text.splitlines() if re.search(pattern, line)]

    def wait_for_line(self, pattern: str, timeout: float, what: str) -> None:
        wait_for(lambda: self.pump() or self.lines(pattern), timeout, what)

    def wait_for_state(self, predicate, timeout: float, what: str) -> dict:
        """The first state snapshot ``predicate`` accepts."""
        return wait_for(lambda: self.pump() or next((s for s in self.states if predicate(s)), None), timeout, what)

    def wait_for_event(self, kind: str, timeout: float, what: str) -> dict:
        return wait_for(lambda: self.pump() or next((e for e in self.events if e["event"] == kind), None),
                        timeout, what)
