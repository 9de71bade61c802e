"""A worker's kernel as jupyter_client runs it, for every launcher: its
command line, its connection file (with the data plane's port) and the
connection info its owner gets.

The local launcher's start gate (a booted kernel joins its cgroup before it
runs) is :mod:`.launchers.local.gate`'s subclass of
:class:`WorkerKernelManager`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any, Sequence, TypeVar

import zmq.asyncio
from jupyter_client.kernelspec import NATIVE_KERNEL_NAME, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from jupyter_client.session import new_id

from gpupool.ipykernel_private import NO_EXECUTE_SLEEP
from gpupool.kernelcmd import WORKER_KERNEL_APP, with_launcher

from .spec import WorkerLaunch

_CONNECTION_KEYS = ("ip", "transport", "shell_port", "iopub_port", "stdin_port", "control_port", "hb_port",
                    "signature_scheme")


class WorkerKernelManager(AsyncKernelManager):
    """jupyter_client's kernel manager; ``owner`` (uid, gid), when set, gets
    the connection file as soon as it is written, before the kernel starts."""

    owner: tuple[int, int] | None = None
    #: The worker environment's interpreter (None: this one, as jupyter_client picks it).
    python: str | None = None

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        cmd = super().format_kernel_cmd(extra_arguments)
        cmd = with_launcher(cmd, WORKER_KERNEL_APP) or cmd  # no shell-channel thread (gpupool.kernelapp)
        if self.python:
            cmd = [self.python, *cmd[1:]]
        return cmd

    def client(self, **kwargs: Any) -> Any:
        """A client in a Jupyter session of its own (a fresh session id).

        jupyter_client hands each client a clone of the manager's Session,
        whose message counter starts again at 0: two clients' first requests
        then share one msg_id (``SESSION_PID_0``). The agent tells requests
        apart by msg_id (:class:`~gpupool.node.activity.WorkerActivity`),
        so a re-adopted worker's late IOPub ``idle`` of the control channel's
        ``kernel_info`` ended the tracking ``kernel_info`` of the running cell."""
        client = super().client(**kwargs)
        client.session.session = new_id()
        return client

    def write_connection_file(self, **kwargs: Any) -> None:
        # The data plane's port (gpupool.dataplane), picked like jupyter_client's own: free now, on ``ip``.
        kwargs.setdefault("transfer_port", _free_port(self.ip))
        super().write_connection_file(**kwargs)
        if self.owner is not None:
            os.chown(self.connection_file, *self.owner)


#: A kind of :class:`WorkerKernelManager` (the local launcher's gated one: :mod:`.launchers.local.gate`).
M = TypeVar("M", bound=WorkerKernelManager)


class KernelManagers:
    """Makes the kernel managers of one node's workers, all on one ZMQ
    ``context`` and never with a user's kernelspec."""

    def __init__(self, settings: WorkerLaunch, log: logging.Logger) -> None:
        self.settings = settings
        self.log = log
        self.context = zmq.asyncio.Context()
        # No kernel dirs: always the native ipykernel of this interpreter, never
        # a "python3" kernelspec that a user installed elsewhere on the node.
        self._kernel_specs = KernelSpecManager(kernel_dirs=[])

    def __call__(self, connection_file: Path, kind: type[M] = WorkerKernelManager) -> M:  # type: ignore[assignment]
        """A manager (a ``kind``) for the worker whose connection file is (or will be) ``connection_file``."""
        settings = self.settings
        return kind(
            kernel_name=NATIVE_KERNEL_NAME, kernel_spec_manager=self._kernel_specs, context=self.context,
            connection_file=str(connection_file), ip=settings.ip, shutdown_wait_time=settings.stop_timeout,
            log=self.log, transport_encryption="required" if settings.encryption == "curve" else "disabled")

    def existing(self, connection_file: Path) -> WorkerKernelManager:
        """A manager for a kernel that runs already (re-adopted): its connection file read.
        OSError or ValueError when that file cannot be."""
        manager = self(connection_file)
        manager.load_connection_file()
        return manager

    def close(self) -> None:
        """Release the ZMQ context; call once every worker is stopped."""
        self.context.destroy(linger=0)


#: Cells a worker's IPython history keeps before it writes them (:func:`kernel_arguments`).
HISTORY_CACHE = 1000


def kernel_arguments(extensions: Sequence[str], history: Path | None = None) -> list[str]:
    """ipykernel command-line options that load ``extensions``, make the
    kernel exit when one fails to load, leave out ipykernel's sleep before
    each reply, write IPython's history every :data:`HISTORY_CACHE` cells,
    and (``history``) keep it in a file of the worker's own.

    IPython commits each cell's history by default, and its saving thread
    holds the cache's lock through the commit's fsync: the next cell's
    store waits for it, inside the cell, before its reply. The notebook's
    history is its notebook kernel's, which stores every cell, forwarded
    ones too; the worker's may lag (a worker's own file goes with it).

    A worker running as the agent's own account would otherwise share
    ``~/.ipython``'s history database with the notebook kernel when both run
    as one user on one host (a local pool, the demo): the two then fight
    over session numbers, and IPython prints "Session/line number was not
    unique in database" into the user's cells. A worker account has a home
    of its own and needs none.

    ``extra_extensions`` is IPython's option for extensions named on the
    command line; unlike ``extensions`` it adds to, rather than replaces, a
    ``c.InteractiveShellApp.extensions`` list from the user's profile. Without
    ``reraise_ipython_extension_failures`` IPython only logs a failing
    extension, and a worker without its extension would look healthy.
    """
    args = [f"--IPKernelApp.extra_extensions={name}" for name in extensions]
    # ipykernel sleeps 0.5 ms before each execute_reply so that a front end sees a cell's output
    # before its reply; a worker's front end is the gpupool kernel, which waits for its idle.
    if history is not None:
        args.append(f"--HistoryManager.hist_file={history}")
    return [*args, f"--HistoryManager.db_cache_size={HISTORY_CACHE}",
            "--IPKernelApp.reraise_ipython_extension_failures=True", NO_EXECUTE_SLEEP]


def history_path(log_path: Path) -> Path:
    """Where a worker whose log is ``log_path`` keeps IPython's history (:func:`kernel_arguments`)."""
    return log_path.with_name(f"{log_path.stem}.history.sqlite")


def connection_info(manager: AsyncKernelManager, advertise_ip: str) -> dict[str, Any]:
    """The Jupyter connection info of ``manager``'s kernel for ``POST
    /workers``, reached at ``advertise_ip`` (``key`` as str)."""
    info = manager.get_connection_info()
    wire = {name: info[name] for name in _CONNECTION_KEYS}
    wire["ip"] = advertise_ip
    key = info["key"]
    wire["key"] = key.decode() if isinstance(key, bytes) else key
    if info.get("curve_publickey"):  # the public half only: the secret key stays with the worker
        wire["curve_publickey"] = info["curve_publickey"]
    port = _transfer_port(manager.connection_file)
    if port:  # bulk bytes of push/pull (gpupool.dataplane)
        wire["transfer_port"] = port
    return wire


def _free_port(ip: str) -> int:
    """A TCP port free on ``ip`` now (the kernel binds it a moment later)."""
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as probe:
        probe.bind((ip, 0))
        return probe.getsockname()[1]


def _transfer_port(connection_file: str) -> int | None:
    """The data plane's port in a worker's connection file (None: none, an older agent's worker)."""
    try:
        with open(connection_file, encoding="utf-8") as handle:
            return json.load(handle).get("transfer_port")
    except (OSError, ValueError):
        return None
