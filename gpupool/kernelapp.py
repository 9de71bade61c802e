"""ipykernel's application without its shell-channel thread, for kernels
that have no subshells: the gpupool kernel and the workers.

ipykernel 7 reads the shell socket on a thread of its own and hands every
request to the main thread over an inproc socket pair, and every reply back
the same way, so that kernel subshells can run requests on other threads.
A kernel without subshells only pays for it: two thread hand-offs per
request. Without that thread, ipykernel reads the shell socket on the main
thread's event loop, as ipykernel 6 did (its code keeps that path).

A worker runs ``python -m gpupool.kernelapp -f CONNECTION_FILE``: an IPython
kernel (:class:`WorkerKernel`) that numbers a forwarded cell as the notebook
kernel in front of it says (the front end never asks a worker for a
subshell, since the gpupool kernel in front of it says it has none).
"""

from __future__ import annotations

import os
from typing import Any

import zmq
from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelapp import IPKernelApp
from traitlets import Type

from . import ipykernel_private

#: Metadata key of a forwarded ``execute_request``: the execution count the
#: cell takes (int), the notebook kernel's, so that one counter numbers the
#: notebook's cells wherever they run.
COUNT_KEY = "gpupool_execution_count"


class NoSubshellKernel(IPythonKernel):
    """An IPythonKernel without subshells, its shell socket read on the main
    thread (:class:`NoSubshellKernelApp`): ipykernel asks this to pick that path."""

    _supports_kernel_subshells = False  # ipykernel's property: a shell-channel thread is there


class NoSubshellKernelApp(IPKernelApp):
    """IPKernelApp whose shell socket is read on the main thread; its kernel a :class:`NoSubshellKernel`."""

    #: The private ipykernel names its kernel uses, checked at start.
    private_names = ipykernel_private.WORKER_NAMES

    def initialize(self, argv=None) -> None:
        ipykernel_private.check(self.private_names)  # an ipykernel without one stops here, with words
        super().initialize(argv)
        # traitlets leaves the logger at DEBUG and filters in its handler, so each of ipykernel's
        # debug lines per message still built a record (a twentieth of a forwarded cell's time here).
        self.log.setLevel(self.log_level)

    def init_sockets(self) -> None:
        try:
            super().init_sockets()
        except zmq.ZMQError:
            # ipykernel (7.4) leaves a socket that failed to bind open, and its
            # atexit close() then waits for it on the context for ever: the
            # kernel would hang, not exit, and its manager (Jupyter Server's
            # restarter, the agent) could not start it again with new ports.
            self.context.destroy(linger=0)
            raise
        ipykernel_private.read_shell_on_main_thread(self)


#: The ``ename`` of a cell a worker refused (:meth:`WorkerKernel.refuse_cells`).
REFUSED_ENAME = "WorkerSavedForPark"
#: The most empty In[] entries one cell pads (a count far ahead of this worker's history is not followed there).
MAX_PAD = 100_000


class WorkerKernel(NoSubshellKernel):
    """A worker's kernel: an IPythonKernel whose cell takes the execution
    count named in its request's metadata (:data:`COUNT_KEY`), so In[n],
    Out[n] and ``Cell In[n]`` in tracebacks follow the notebook's numbering
    (cells of ``%gpu`` lines and ``%%local`` cells take numbers there).
    Once its namespace is saved for a park to disk (:meth:`refuse_cells`), a
    cell that still reaches it is refused in words, not run: what it did would
    be lost with this process."""

    #: Why cells are refused (:meth:`refuse_cells`); None: they run.
    refusing: str | None = None
    #: The file whose existence keeps them refused (:meth:`refuse_cells`).
    refusing_while: str | None = None

    def refuse_cells(self, words: str, while_exists: str | None = None) -> None:
        """From now on answer every ``execute_request`` with an error of ``words`` (ename
        :data:`REFUSED_ENAME`) instead of running it; with ``while_exists`` (a path), only
        while that file exists: a spill the agent gave up (it removes the file: failed, or
        left unfinished by an agent killed meanwhile, whose successor re-adopts this worker)
        lets cells run here again. Called on the main thread, between requests."""
        self.refusing, self.refusing_while = words, while_exists

    async def execute_request(self, stream, ident, parent: dict[str, Any]) -> None:
        if self.refusing is not None and self.refusing_while is not None and not os.path.exists(self.refusing_while):
            self.refusing = self.refusing_while = None
        if self.refusing is not None:
            self._refuse(stream, ident, parent)
            return
        count = (parent.get("metadata") or {}).get(COUNT_KEY)
        if isinstance(count, int) and not isinstance(count, bool) and count > 0 \
                and not (parent.get("content") or {}).get("silent"):
            self.shell.execution_count = count
            history = self.shell.history_manager
            for cells in (history.input_hist_parsed, history.input_hist_raw):
                # In[n] is cell n here too (the others ran there); a count far ahead pads nothing
                cells.extend([""] * (count - len(cells) if count - len(cells) <= MAX_PAD else 0))
        await super().execute_request(stream, ident, parent)


    def _refuse(self, stream, ident, parent: dict[str, Any]) -> None:
        """An error reply and its IOPub ``error`` for ``parent``, as a failed cell's (the
        busy and idle around it are ipykernel's dispatch's)."""
        error = {"ename": REFUSED_ENAME, "evalue": self.refusing, "traceback": [f"{REFUSED_ENAME}: {self.refusing}"]}
        self.session.send(self.iopub_socket, "error", error, parent, ident=self._topic("error"))
        self.session.send(stream, "execute_reply", {"status": "error", "execution_count": self.shell.execution_count,
                                                    **error}, parent, ident=ident)


class WorkerKernelApp(NoSubshellKernelApp):
    """A worker's application: :class:`WorkerKernel`, no shell-channel thread."""

    kernel_class = Type(WorkerKernel, klass=NoSubshellKernel,
                        help="The kernel class (default: gpupool's worker kernel).").tag(config=True)


if __name__ == "__main__":
    WorkerKernelApp.launch_instance()
