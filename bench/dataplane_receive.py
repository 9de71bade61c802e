"""The data plane's receiving end alone: encrypted against plain, same process, alternating.

One sender process streams the same bytes with ``gpupool.dataplane.send_buffers``
over loopback TCP; this process receives them with ``recv_buffers`` (into fresh
receive buffers from ``allocate``, as a worker or notebook kernel does), the
encrypted (AES-256-GCM) and the plain transfer in turn, their order swapped every
round so neither always follows the other's freed memory. No kernels, comms or
pickling: what is left is the socket, the cipher and the fresh destination.
Prints MiB/s per round beside raw TCP into a touched buffer. Run from the
repository root:

    .venv/bin/python bench/dataplane_receive.py [--mib 1024] [--rounds 4]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from remoting_bench import raw_socket_seconds  # noqa: E402

from gpupool import dataplane  # noqa: E402

MIB = 1024**2


def _send(port: int, tickets: dict[str, dict], order: list[str], nbytes: int) -> None:
    payload = memoryview(bytearray(os.urandom(MIB) * (nbytes // MIB)))
    for mode in order:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.recv(1)  # go
            dataplane.send_buffers(conn, dataplane.Ticket.from_wire(tickets[mode]), [payload])
            conn.recv(1)  # received


def measure(nbytes: int, rounds: int) -> dict[str, list[int]]:
    """MiB/s of each receive, by mode (``curve``: encrypted, ``none``: plain), in round order."""
    tickets = {"curve": dataplane.Ticket.new(True), "none": dataplane.Ticket.new(False)}
    order = [mode for turn in range(rounds) for mode in (("curve", "none") if turn % 2 == 0 else ("none", "curve"))]
    server = socket.create_server(("127.0.0.1", 0))
    sender = multiprocessing.Process(target=_send, args=(server.getsockname()[1],
                                                         {m: t.wire() for m, t in tickets.items()}, order, nbytes))
    sender.start()
    rates: dict[str, list[int]] = {"curve": [], "none": []}
    try:
        for mode in order:
            conn, _ = server.accept()
            with conn:
                start = time.perf_counter()
                conn.sendall(b"g")
                received = dataplane.recv_buffers(conn, tickets[mode], [nbytes])
                rates[mode].append(round(nbytes / MIB / (time.perf_counter() - start)))
                conn.sendall(b"k")
            del received
    finally:
        sender.join(60)
        server.close()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[256, 1024], help="sizes in MiB (default 256 1024)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per size, order swapped each (default 4)")
    args = parser.parse_args()
    print(f"cipher: {dataplane.default_cipher()}; load {os.getloadavg()[0]:.1f}")
    for mib in args.mib:
        raw = mib / raw_socket_seconds(mib * MIB)
        rates = measure(mib * MIB, args.rounds)
        best = {mode: max(r) for mode, r in rates.items()}
        print(f"{mib} MiB: raw TCP {raw:.0f} MiB/s; encrypted {rates['curve']} (best {best['curve'] / raw:.0%} of "
              f"raw); plain {rates['none']} (best {best['none'] / raw:.0%})")


if __name__ == "__main__":
    main()
