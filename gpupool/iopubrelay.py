"""The notebook kernel's relay of a worker's IOPub to the front end
(:meth:`gpupool.remote.RemoteKernel.relay_iopub`), on a thread of its own."""

from __future__ import annotations

import threading
from typing import Any, Callable

import zmq
from jupyter_client.session import Session

from .kernelmsg import POLL_MS, deserialize


#: The front end's comm messages, forwarded without a reply.
COMM_MSG_TYPES = ("comm_open", "comm_msg", "comm_close")


class IOPubRelay(threading.Thread):
    """Reads a worker's IOPub on a thread of its own and re-signs the
    front end's messages for the notebook kernel's IOPub (the bare
    forwarding hop: only header and parent are decoded, content and buffers
    pass as they came). The busy and idle of the forwarded cell ``awaited``
    are passed too (the front end hears the worker's own), and its idle also
    goes to ``inner``, where :meth:`RemoteKernel._until_idle` waits for the
    cell's end; other ``status`` messages are dropped (the notebook kernel
    says busy and idle itself). What the notebook kernel itself asked for
    (transfers, version checks: parented to ``session``'s own session id)
    goes to ``inner`` only. Of the rest only what belongs to a front end
    passes: a message parented to a request of a session that a forwarded
    request came from (:meth:`front`), or one with no parent at all (the
    worker's own output outside any request); what answers anyone else's
    requests (the agent's shutdown, a parking connection's transfer comm,
    another client's cells) is dropped, or JupyterLab would warn of
    unknown comms and replies. A message whose signature does not verify is
    dropped (:func:`deserialize` raises)."""

    def __init__(self, iopub: zmq.Socket, inner: zmq.Socket, session: Session,
                 publish: Callable[[list, list, dict], None]) -> None:
        super().__init__(name="gpupool-iopub-relay", daemon=True)
        self.iopub, self.inner, self.session, self.publish = iopub, inner, session, publish
        self._halt = threading.Event()
        #: msg_id of the forwarded request whose idle status RemoteKernel waits for.
        self.awaited: str | None = None
        self._fronts: set[str] = set()  # session ids of the front ends whose requests were forwarded

    def front(self, msg: dict[str, Any]) -> None:
        """``msg`` (a front end's request) is about to be forwarded: its
        session's messages are the front end's to see (any thread)."""
        self._fronts.add(msg["header"].get("session", ""))

    def run(self) -> None:
        while not self._halt.is_set():
            if not self.iopub.poll(POLL_MS):
                continue
            try:
                frames = self.iopub.recv_multipart(copy=False)
                self._pass(frames)
            except zmq.ZMQError:  # the context is being destroyed
                return
            except Exception:  # one bad message must not stop the relay
                import logging

                logging.getLogger("gpupool.magics").warning("dropped a worker message", exc_info=True)

    def _pass(self, frames: list) -> None:
        idents, parts = self.session.feed_identities(frames, copy=False)
        msg = deserialize(self.session, parts, content=False)
        parent = msg["parent_header"]
        if parent.get("session") == self.session.session:
            self.inner.send_multipart(frames, copy=False)
            return
        if parent and parent.get("session") not in self._fronts:
            return
        # A front end's comm message gets the worker's busy/idle (the notebook kernel sends
        # none of its own for it): JupyterLab listens for a comm message's output only until
        # its idle, and an @interact callback prints after the notebook kernel's idle.
        status = msg["header"]["msg_type"] == "status" and parent.get("msg_type") not in COMM_MSG_TYPES
        awaited = parent.get("msg_id") == self.awaited
        if status and not awaited:
            return
        self.publish(idents, [part.buffer if hasattr(part, "buffer") else part for part in parts], msg)
        if status and self._state(parts[4]) == "idle":
            self.inner.send_multipart(frames, copy=False)

    def _state(self, content: Any) -> str | None:
        """The execution_state of a status message's content frame."""
        return self.session.unpack(content.bytes if hasattr(content, "bytes") else content).get("execution_state")

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=1.0)
