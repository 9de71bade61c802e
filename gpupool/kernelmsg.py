"""Reading a worker's messages: how long one wait on its sockets lasts
(:data:`POLL_MS`) and :func:`deserialize`, Session's without date parsing.
Shared by :mod:`gpupool.remote` and its IOPub relay (:mod:`gpupool.iopubrelay`)."""

from __future__ import annotations

from hmac import compare_digest
from typing import Any

from jupyter_client.session import Session

#: Milliseconds one poll of a worker's sockets waits, so that every wait can
#: see a stop, a deadline or Ctrl-C this often.
POLL_MS = 50


def deserialize(session: Session, parts: list, content: bool = True) -> dict[str, Any]:
    """``session.deserialize(parts, content, copy=False)`` without turning the
    header's and parent's ``date`` strings into datetimes: that is dateutil
    parsing two dates per message, the largest cost of a forwarded cell in the
    notebook kernel (py-spy), and nothing here reads a worker's dates (the
    front end's come through ipykernel). The checks are Session's own: the
    HMAC signature, replayed signatures (its digest history), at least five
    parts. Raises ValueError or TypeError as Session.deserialize does."""
    frames = [part.bytes if hasattr(part, "bytes") else bytes(part) for part in parts[:5]]
    if len(frames) < 5:
        raise TypeError("malformed message, must have at least 5 elements")
    if session.auth is not None:
        signature = frames[0]
        if not signature:
            raise ValueError("Unsigned Message")
        if signature in session.digest_history:
            raise ValueError(f"Duplicate Signature: {signature!r}")
        if content:  # as Session: only a message that is read whole is remembered
            session._add_digest(signature)
        if not compare_digest(signature, session.sign(frames[1:5])):
            raise ValueError(f"Invalid Signature: {signature!r}")
    header = session.unpack(frames[1])
    return {"header": header, "msg_id": header["msg_id"], "msg_type": header["msg_type"],
            "parent_header": session.unpack(frames[2]), "metadata": session.unpack(frames[3]),
            "content": session.unpack(frames[4]) if content else frames[4],
            "buffers": [part.buffer if hasattr(part, "buffer") else memoryview(part) for part in parts[5:]]}
