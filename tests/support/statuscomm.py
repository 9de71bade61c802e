"""A front end's comm to the gpupool kernel's ``gpupool.status`` target, as the JupyterLab
extension uses it (docs/api.md, "The status comm"), driven with jupyter_client."""

from __future__ import annotations

import queue
import time
import uuid
from typing import Any

from frontend import Cell


class StatusComm:
    """A front end's comm to ``gpupool.status`` on kernel client ``kc``: every
    message the kernel sends on it, in order, in ``seen``; every other IOPub
    message in ``other``."""

    def __init__(self, kc) -> None:
        self.kc, self.comm_id = kc, uuid.uuid4().hex
        self.seen: list[dict[str, Any]] = []
        self.other: list[dict[str, Any]] = []
        self.asked: list[str] = []  # msg_ids of our requests
        self._read = 0
        kc.shell_channel.send(kc.session.msg("comm_open", {"comm_id": self.comm_id, "target_name": "gpupool.status",
                                                           "data": {}}))

    def _pump(self, timeout: float) -> dict[str, Any] | None:
        """Read one IOPub message (up to ``timeout`` s) into ``seen`` or ``other``."""
        try:
            msg = self.kc.get_iopub_msg(timeout=max(0.05, timeout))
        except queue.Empty:
            return None
        if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == self.comm_id:
            self.seen.append(msg["content"]["data"])
        else:
            self.other.append(msg)
        return msg

    def run(self, code: str, timeout: float = 60) -> Cell:
        """Execute ``code`` as a cell, keeping our comm's messages meanwhile."""
        msg_id = self.kc.execute(code)
        start = len(self.other)
        deadline = time.monotonic() + timeout
        while not any(m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "status"
                      and m["content"]["execution_state"] == "idle" for m in self.other[start:]):
            if time.monotonic() > deadline:
                raise AssertionError(f"cell did not finish in {timeout}s: {code!r}")
            self._pump(deadline - time.monotonic())
        cell = Cell(outputs=[(m["msg_type"], m["content"]) for m in self.other[start:]
                             if m["parent_header"].get("msg_id") == msg_id
                             and m["msg_type"] not in ("status", "execute_input")])
        reply = self.kc.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=timeout)
        cell.reply = reply["content"]
        return cell

    def next(self, predicate, timeout: float = 30) -> dict[str, Any]:
        """The first message after the last one read that ``predicate`` accepts
        (raises AssertionError with what came when none does within ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while True:
            while self._read < len(self.seen):
                data = self.seen[self._read]
                self._read += 1
                if predicate(data):
                    return data
            if time.monotonic() >= deadline:
                raise AssertionError(f"no such message within {timeout}s; got {self.seen}")
            self._pump(deadline - time.monotonic())

    def listen(self, seconds: float) -> None:
        """Read what the kernel sends for ``seconds`` (into ``seen``; :meth:`next` goes on from where it was)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._pump(deadline - time.monotonic())

    def state(self, phase: str, timeout: float = 30) -> dict[str, Any]:
        return self.next(lambda d: d.get("state", {}).get("phase") == phase, timeout)["state"]

    def last_state(self) -> dict[str, Any]:
        """The state the kernel sent last (it sends a request's new state before its reply)."""
        return [d["state"] for d in self.seen if "state" in d][-1]

    def event(self, kind: str, timeout: float = 30) -> dict[str, Any]:
        return self.next(lambda d: d.get("event") == kind, timeout)

    def send(self, data: Any) -> str:
        msg = self.kc.session.msg("comm_msg", {"comm_id": self.comm_id, "data": data})
        self.asked.append(msg["header"]["msg_id"])
        self.kc.shell_channel.send(msg)
        return msg["header"]["msg_id"]

    def ask(self, data: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        """Send request ``data`` (with an id) and return its reply."""
        ident = uuid.uuid4().hex
        self.send({**data, "id": ident})
        return self.next(lambda d: "reply" in d and d.get("id") == ident, timeout)

    def outputs_of_requests(self) -> list[dict[str, Any]]:
        """Output messages the kernel parented to one of our requests (there must be none)."""
        while self._pump(0.5) is not None:
            pass
        return [m for m in self.other if m["parent_header"].get("msg_id") in self.asked
                and m["msg_type"] in ("stream", "display_data", "execute_result", "error")]
