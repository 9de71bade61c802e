"""A cell interrupted once it says something (a front end's Ctrl-C / interrupt kernel), driven
through a :class:`~statuscomm.StatusComm`'s kernel client, its comm messages kept meanwhile."""

from __future__ import annotations

import time

from frontend import Cell


def interrupted_cell(comm, km, code: str, once: str, timeout: float = 90) -> tuple[Cell, str]:
    """Run ``code``, interrupt the kernel once its output holds ``once``, and return the cell (its
    outputs and reply) and its output as it was when interrupted."""
    msg_id = comm.kc.execute(code)
    start = len(comm.other)
    deadline = time.monotonic() + timeout

    def mine() -> list:
        return [m for m in comm.other[start:] if m["parent_header"].get("msg_id") == msg_id]

    def text() -> str:
        return "".join(m["content"]["text"] for m in mine() if m["msg_type"] == "stream")

    while once not in text():
        if time.monotonic() > deadline:
            raise AssertionError(f"{code!r} never said {once!r}: {text()!r}")
        comm._pump(deadline - time.monotonic())
    before = text()
    km.interrupt_kernel()
    while not any(m["msg_type"] == "status" and m["content"]["execution_state"] == "idle" for m in mine()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{code!r} did not end after the interrupt: {text()!r}")
        comm._pump(deadline - time.monotonic())
    cell = Cell(outputs=[(m["msg_type"], m["content"]) for m in mine() if m["msg_type"] not in ("status", "execute_input")])
    reply = comm.kc.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = comm.kc.get_shell_msg(timeout=30)
    cell.reply = reply["content"]
    return cell, before
