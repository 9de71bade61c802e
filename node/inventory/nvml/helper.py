"""The NVML helper: a small process that asks NVML on the agent's behalf, so
that a driver call that hangs cannot stop the agent (:mod:`.watch` is the
agent's side). Run as ``python -m gpupool.node.inventory.nvml.helper FD``;
its requests and answers over the socket ``FD``: docs/code.md, "The NVML helper".
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

from ..base import Inventory, InventoryError


class Channel:
    """The helper's end of the socket; sends from several threads (the
    requests', the log relay's, the call watch's) one whole message at a time."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple) -> None:
        with self._lock:
            self.conn.send(message)

    def recv(self) -> Any:
        return self.conn.recv()


class CallWatch:
    """Which NVML function runs now; a thread tells the agent, once per call,
    when one has run for ``after`` seconds (NVML's calls release the GIL, so
    the thread runs while one hangs in the driver)."""

    def __init__(self, channel: Channel, after: float = 2.5) -> None:
        self.channel, self.after = channel, after
        self._call: tuple[str, float] | None = None
        self._told: tuple[str, float] | None = None
        threading.Thread(target=self._watch, name="nvml-call-watch", daemon=True).start()

    def run(self, name: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._call = (name, time.monotonic())
        try:
            return function(*args, **kwargs)
        finally:
            self._call = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(0.1, self.after / 4))
            call = self._call
            if call is not None and call is not self._told and time.monotonic() - call[1] >= self.after:
                self._told = call
                try:
                    self.channel.send(("slow", call[0], time.monotonic() - call[1]))
                except OSError:
                    return  # the agent is gone


class WatchedBinding:
    """The ``pynvml`` module with each ``nvml*`` function run through a
    :class:`CallWatch`; everything else (error classes, constants) as it is."""

    def __init__(self, module: Any, watch: CallWatch) -> None:
        self._module, self._watch = module, watch

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if not (name.startswith("nvml") and callable(value)):
            return value

        def watched(*args: Any, **kwargs: Any) -> Any:
            return self._watch.run(name, value, *args, **kwargs)
        return watched


class _Relay(logging.Handler):
    """Sends each log record to the agent, which logs it with its own handler."""

    def __init__(self, conn: Channel) -> None:
        super().__init__()
        self.conn = conn

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.conn.send(("log", record.levelno, record.name, record.getMessage()))
        except OSError:
            pass  # the agent is gone: nobody to tell


def snapshot(inventory: Inventory, came_back: bool = False) -> tuple[str, dict[str, Any]]:
    """``("ok", {...})``: everything the agent reads from an inventory between
    two heartbeats: ``error``, ``gpus`` (GPUInfo list), ``metrics``, ``usage``
    (GPUProcess list), ``known`` (UUIDs), ``health``, ``versions``, and
    ``came_back`` (NVML just worked again)."""
    usage = inventory.process_usage()  # one process listing per heartbeat, as the agent did itself
    return "ok", {"came_back": came_back, "error": inventory.error, "gpus": inventory.discover(),
                  "metrics": inventory.metrics(), "usage": usage, "known": inventory.process_known(),
                  "health": inventory.health(), "versions": inventory.versions()}


def open_nvml(options: dict[str, Any], watch: CallWatch) -> Inventory:
    """The inventory the helper serves: NVML (its calls watched by ``watch``),
    retried when it fails (raises :class:`InventoryError` as
    :class:`~gpupool.node.inventory.retrying.RetryingInventory` does)."""
    from ..retrying import RetryingInventory
    from .inventory import NVMLInventory

    try:
        import pynvml
    except ImportError:
        binding = None  # NVMLInventory says to install nvidia-ml-py
    else:
        binding = WatchedBinding(pynvml, watch)
    host_proc = options.get("host_proc")
    return RetryingInventory(lambda: NVMLInventory(binding, host_proc=host_proc), first=options.get("first", 5.0),
                             longest=options.get("longest", 300.0))


def serve(conn: Connection, open_inventory: Callable[[dict[str, Any], CallWatch], Inventory] = open_nvml) -> None:
    """Answer the agent's requests on ``conn`` until it closes or says ``close``."""
    conn = Channel(conn) if isinstance(conn, Connection) else conn
    watch = CallWatch(conn)
    inventory: Inventory | None = None
    while True:
        try:
            kind, args = conn.recv()
        except (EOFError, OSError):
            break
        try:
            if kind == "open":
                logging.getLogger("gpupool").setLevel(args.get("log_level", logging.INFO))
                watch.after = args.get("slow_after", watch.after)
                try:
                    inventory = open_inventory(args, watch)
                except InventoryError as exc:
                    conn.send(("error", exc.message, exc.reason, exc.retryable))
                    continue
                conn.send(snapshot(inventory))
            elif kind == "poll" and inventory is not None:
                conn.send(snapshot(inventory, inventory.refresh()))
            elif kind == "close":
                if inventory is not None:
                    inventory.close()
                conn.send(("closed",))
                break
            else:
                conn.send(("failed", f"the NVML helper got {kind!r} before 'open'"))
        except Exception:  # a bug, not NVML: say it, the agent replaces this helper
            conn.send(("failed", traceback.format_exc(limit=5)))


def main(argv: list[str] | None = None) -> int:
    """``python -m gpupool.node.inventory.nvml.helper FD``: serve on socket ``FD``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m gpupool.node.inventory.nvml.helper FD (the agent starts it)", file=sys.stderr)
        return 2
    # Ctrl-C on the agent's terminal reaches this process group too; the agent
    # itself decides when its helper ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    conn = Channel(Connection(sock.detach()))
    root = logging.getLogger("gpupool")
    root.addHandler(_Relay(conn))
    root.propagate = False
    serve(conn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
