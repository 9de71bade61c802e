"""A namespace moved worker to worker: the new worker takes the old one's
``pull_all`` straight from the old worker's data plane (node to node, never
through the notebook kernel, which only passes the ticket and the header on
the two workers' comms) and restores it as a spill's is restored."""

from __future__ import annotations

from typing import Any

from gpupool.dataplane import Ticket, TransferError, close_all, connect, recv_buffers
from gpupool.wire.transfer import Fetch

from .namespace import restore

#: Seconds the old worker's data connection may stall before the move counts as failed.
STALL_TIMEOUT = 60.0


def fetch(ip, request: Fetch) -> dict[str, Any]:
    """Op ``fetch``: its ``source`` (the old worker's ``ip`` and
    ``transfer_port``) offers its ``stream`` (a ticket and the buffers'
    ``sizes``) for its ``header`` (the old worker's pull_all header); take the buffers
    and restore them here (:func:`.namespace.restore`). Answers ``{"ok",
    "loaded", "errors"}``; TransferError, with nothing changed here, when
    the old worker cannot be reached or the bytes do not all verify."""
    source = request.source
    address = (str(source["ip"]), int(source["transfer_port"]))
    ticket = Ticket.from_wire(request.stream)
    sizes = [int(size) for size in request.stream["sizes"]]
    try:
        socks = connect(address, ticket, STALL_TIMEOUT, ticket.lanes(sizes))
    except OSError as exc:
        raise TransferError(f"this node could not reach the old worker's data port {address[0]}:{address[1]} "
                            f"({exc}); the cluster's network policy must let workers reach each other; "
                            "nothing moved") from None
    try:
        buffers = recv_buffers(socks, ticket, sizes)
    finally:
        close_all(socks)
    return restore(ip, request.header, buffers)
