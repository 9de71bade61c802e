"""The private ipykernel names gpupool's kernels use, in one place.

Checked against ipykernel 7.4. :func:`check` runs when a gpupool kernel
application starts (:class:`gpupool.kernelapp.NoSubshellKernelApp`, with the
names its kernel uses), so an ipykernel without a required name stops the
kernel with words naming it, instead of a cell failing later. What each name
is for (optional ones: a kernel works without them, only slower):

``Kernel._allow_stdin``
    Whether the running request's front end allows ``input()``. The
    forwarding kernel sets it from the front end's request (a forwarded one
    always allows stdin); the worker's ``%gpu`` sets it around its ask.
``Kernel._aborting``
    True while requests queued behind a failed cell are being aborted: such
    a cell is not forwarded.
``Kernel._abort_queues``
    Aborts the requests queued behind a failed forwarded or refused cell
    (``stop_on_error``), as ipykernel does for a local one.
``Kernel._publish_execute_input``
    The ``execute_input`` of a cell refused before it could be forwarded.
``Kernel._publish_status``
    Overridden by the forwarding kernel: the worker says busy and idle of
    the messages forwarded to it.
``Kernel._execute_sleep``
    A configurable sleep after each execute; zero in gpupool's kernels,
    whose front end waits for idle (optional).
``Kernel.shell_handlers``
    The shell channel's handlers by message type; the forwarding kernel
    routes comm messages.
``IPKernelApp.shell_channel_thread``
    Replaced after ``init_sockets`` (:class:`MainThreadShell`) so that the
    shell socket is read on the main thread (optional).
``Kernel._supports_kernel_subshells``
    False in gpupool's kernels, which have no subshells (optional).
``OutStream._flush_pending``, ``_subprocess_flush_pending``, ``_buffer_lock``, ``_buffers``
    Whether a write waits to be flushed (optional: without them every flush
    makes its round trip, as ipykernel's own stream does).

A worker's kernel uses :data:`WORKER_NAMES`, the gpupool kernel all of :data:`NAMES`.

This module imports ipykernel only in :func:`missing`, so the agent may
import it for :data:`NO_EXECUTE_SLEEP`.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

#: The ipykernel versions these names were checked against.
CHECKED = "7.4"

#: The command-line option that zeroes ``_execute_sleep`` in a worker kernel.
NO_EXECUTE_SLEEP = "--IPythonKernel._execute_sleep=0"


class Name(NamedTuple):
    """A private name: its ipykernel class (module, class), the attribute,
    and whether a kernel cannot work without it."""

    module: str
    cls: str
    attr: str
    required: bool = True

    def __str__(self) -> str:
        return f"{self.module}.{self.cls}.{self.attr}"


def _kernel(*attrs: str, required: bool = True) -> tuple[Name, ...]:
    return tuple(Name("ipykernel.kernelbase", "Kernel", attr, required) for attr in attrs)


#: What a worker's kernel uses (``%gpu`` on the worker asks over stdin). The
#: sleep and the shell-channel thread only cost time: without them a kernel
#: still works.
WORKER_NAMES: tuple[Name, ...] = (
    *_kernel("_allow_stdin"),
    *_kernel("_execute_sleep", "_supports_kernel_subshells", required=False),
    Name("ipykernel.kernelapp", "IPKernelApp", "shell_channel_thread", required=False),
)

#: What the gpupool (forwarding) kernel uses: the worker's names and more.
NAMES: tuple[Name, ...] = (
    *WORKER_NAMES,
    *_kernel("_aborting", "_abort_queues", "_publish_execute_input", "_publish_status", "shell_handlers"),
    *(Name("ipykernel.iostream", "OutStream", attr, required=False) for attr in (
        "_flush_pending", "_subprocess_flush_pending", "_buffer_lock", "_buffers")),
)


class IpykernelMismatch(RuntimeError):
    """The installed ipykernel lacks a private name gpupool's kernels need."""


def missing(names: tuple[Name, ...] = NAMES) -> list[Name]:
    """The names of ``names`` that the installed ipykernel lacks: neither on
    the class nor assigned in its ``__init__`` (instance attributes)."""
    import importlib

    return [name for name in names if not _has(getattr(importlib.import_module(name.module), name.cls), name.attr)]


def _has(cls: type, attr: str) -> bool:
    init = getattr(cls.__init__, "__code__", None)
    return hasattr(cls, attr) or (init is not None and attr in init.co_names)


def check(names: tuple[Name, ...] = NAMES) -> None:
    """Raise :class:`IpykernelMismatch` naming every required name of
    ``names`` the installed ipykernel lacks (nothing when it has them all)."""
    lacking = [str(name) for name in missing(names) if name.required]
    if lacking:
        import ipykernel

        raise IpykernelMismatch(
            f"gpupool's kernels need ipykernel's private {', '.join(lacking)}, which ipykernel "
            f"{ipykernel.__version__} lacks (checked against ipykernel {CHECKED}): install ipykernel {CHECKED} "
            "in this environment")


# -- the kernel's request state -----------------------------------------------------------

def allow_stdin(kernel) -> bool:
    """Whether the running request may ask the front end for ``input()``."""
    return bool(kernel._allow_stdin)


def set_allow_stdin(kernel, allowed: bool) -> None:
    kernel._allow_stdin = allowed


def aborting(kernel) -> bool:
    """Whether requests queued behind a failed cell are being aborted now."""
    return bool(kernel._aborting)


def abort_queued(kernel, parent: dict[str, Any]) -> None:
    """Abort the requests queued behind the failed cell of request ``parent``."""
    kernel._abort_queues(parent["header"].get("subshell_id"))


def publish_execute_input(kernel, code: str, parent: dict[str, Any], count: int) -> None:
    kernel._publish_execute_input(code, parent, count)


def handle_shell(kernel, msg_type: str, handler) -> None:
    """Make ``handler(stream, ident, parent)`` the kernel's for ``msg_type``."""
    kernel.shell_handlers[msg_type] = handler


# -- the application and the output stream ------------------------------------------------

class MainThreadShell:
    """What stands for the shell-channel thread where the shell socket is read
    on the main thread: falsy, so ipykernel starts no thread and reads the
    socket on the main loop, with the ``parent_thread`` its ``do_execute``
    reads to cancel a cell of top-level ``await`` on an interrupt (with None
    there, such a cell raised AttributeError and got no reply). The kernel
    says it has no subshells (:class:`gpupool.kernelapp.NoSubshellKernel`)."""

    parent_thread = threading.main_thread()

    def __bool__(self) -> bool:
        return False


def read_shell_on_main_thread(app) -> None:
    """After ``init_sockets``: no shell-channel thread (made there, started by
    ``init_kernel``; :class:`MainThreadShell` instead), so ipykernel reads the
    shell socket on the main thread."""
    app.shell_channel_thread = MainThreadShell()


def nothing_pending(stream) -> bool:
    """Whether OutStream ``stream`` has no write waiting to be flushed; False
    when its state is not ipykernel 7's (so the stream always flushes)."""
    try:
        if stream._flush_pending or stream._subprocess_flush_pending or stream.echo is not None:
            return False
        with stream._buffer_lock:
            return not any(buffer.tell() for buffer in stream._buffers.values())
    except AttributeError:
        return False
