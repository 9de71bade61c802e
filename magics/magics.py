"""The ``%gpu`` magics.

A session::

    In [1]: %load_ext gpupool.magics
    In [2]: %gpu acquire 0.5
    gpupool: attached L-3f2a9c1e07b4: 0.50 of NVIDIA A100-SXM4-80GB (GPU 0) on node-1 in environment
             default, 39.6 GiB; idle timeout 30m. Cells now run on the worker; %gpu release detaches.
    In [3]: import os; os.environ["GPUPOOL_LEASE_ID"]
    Out[3]: 'L-3f2a9c1e07b4'
    In [4]: %gpu release
    gpupool: released L-3f2a9c1e07b4 after 1m 2s (0.01 GPU-hours); brought back 1 variable: os (module)

While attached, a routed cell first sends along the local variables it reads
that the worker lacks (``gpupool: sent along x (ndarray, 8.0 MiB)``); at its
idle timeout the service parks the lease in place (the worker frozen on its
node with everything it holds, its GPU back in the pool) and the next cell
resumes it (docs/parking.md)::

    gpupool: lease L-3f2a9c1e07b4 was parked (idle for 30m): its worker is frozen on node-1 with its
             variables in host memory (2.1 GiB) and its GPU is back in the pool; the next cell resumes it
    In [5]: loss
    gpupool: resumed L-3f2a9c1e07b4 on node-1 GPU 0 in 1.1s (parked 2h 5m)

In the gpupool kernel (:mod:`gpupool.magics.kernel`) an attached notebook's
cells are forwarded to the worker by the kernel itself. Loaded into any other
IPython (``%load_ext gpupool.magics``) the magics still acquire, move
variables and release, but cells stay local: ``%%gpu`` runs one cell on the
worker, its output replayed through this kernel (no widgets, completion or
debugger there; docs/api.md, "Plain IPython kernels").
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from traitlets import Float, Int, TraitError, Unicode, validate

from gpupool.dataplane import MAX_STREAMS
from gpupool.errors import GPUPoolError
from gpupool.traits import ByteSize

from .attach import Attacher, Forwarding, own_lease_request
from gpupool.dataplane import AUTO_STREAMS
from .attachment import Attachment
from .commands import COMMANDS, PARSERS, acquire_request, names, no_arguments, release_discards, split_line
from .lifecycle import Lifecycle
from .routing import gpu_lines
from .service import Service
from .status import Status
from .tell import Tell
from .transfers import Transfers
from .variables import Variables
from .wait import QueueWait
from .words import dedent

log = logging.getLogger("gpupool.magics")

#: %gpu commands that a cell running on the worker may not call mid-cell.
NOT_MID_CELL = {"acquire": "a second %gpu acquire", "release": "%gpu release", "restart": "%gpu restart",
                "push": "%gpu push", "pull": "%gpu pull", "park": "%gpu park"}


def not_mid_cell(line: str) -> str:
    """Why ``%gpu LINE`` may not run inside a cell that runs on the worker
    (:data:`NOT_MID_CELL`), "" when it may. The worker's ``%gpu`` asks
    :meth:`GPUMagics.run_for_worker`, and the gpupool kernel refuses such a
    cell before it runs anything (:meth:`GPUMagics.refused_on_worker`)."""
    command = line.strip().partition(" ")[0]
    if command not in NOT_MID_CELL:
        return ""
    return f"{NOT_MID_CELL[command]} cannot run inside a cell that runs on the worker; put it in a cell of its own"


def refused(exc: GPUPoolError) -> UsageError:
    """The pool's refusal ``exc`` as a UsageError (IPython shows exactly that
    class in one line, no subclass), with its ``limit`` kept as an attribute
    (the service's name of what it is about: ``model``, ``max_gpus``...; None:
    not said), which the Acquire dialog turns into its field."""
    error = UsageError(exc.message)
    limit = exc.extra.get("limit")
    error.limit = limit if isinstance(limit, str) else None  # type: ignore[attr-defined]
    return error


@magics_class
class GPUMagics(Magics):
    """``%gpu acquire|release|status|pool|push|pull``, ``%%gpu`` and ``%%local``.

    Holds the settings and reads each line (:mod:`gpupool.magics.commands`);
    what a line asks is done by one object per concern: :attr:`lifecycle`
    (the attachment, :class:`~.lifecycle.Lifecycle`), :attr:`transfers`
    (variables, :class:`~.transfers.Transfers`) and :attr:`status`
    (:class:`~.status.Status`). ``kernel`` is the gpupool kernel, whose
    events, forwarded cell and notices they use; None in any other IPython.
    """

    release_state_cap = ByteSize(
        2 * 1024**3,
        help="""Most bytes of worker variables brought back by `%gpu release` (default 2GiB).
        Larger state stays listed by name. Example: c.GPUMagics.release_state_cap = "8GiB".""",
    ).tag(config=True)
    start_timeout = Float(
        300.0, help="Seconds `%gpu acquire` waits for the worker to start (default 300).").tag(config=True)
    max_output_bytes = ByteSize(
        16 * 1024**2,
        help="""Most output one routed cell relays into the notebook (stream text and display
        data), default 16MiB; the rest is cut with a note. Example: c.GPUMagics.max_output_bytes = "64MiB".""",
    ).tag(config=True)
    cell_lease = Unicode(
        "0.25",
        help="""What `%%gpu` acquires for one cell when not attached: a fraction of one GPU ("0.25")
        or a count of whole GPUs ("1"), default "0.25". Example: c.GPUMagics.cell_lease = "0.5".""",
    ).tag(config=True)

    transfer_streams = Int(
        0,
        help=f"""Most TCP connections one transfer of many MiB (push, pull, release, a move) runs on
        at once, each sealing its share of the chunks on a core of its own; one per 16 MiB
        moved at most. 0 (default): one per CPU core of this kernel, at most {AUTO_STREAMS}.
        Example: c.GPUMagics.transfer_streams = 8.""",
    ).tag(config=True)

    @validate("transfer_streams")
    def _transfer_streams_valid(self, proposal: Any) -> int:
        if isinstance(proposal["value"], bool) or not 0 <= proposal["value"] <= MAX_STREAMS:
            raise TraitError(f"transfer_streams must be 0 (by cores) to {MAX_STREAMS}, not {proposal['value']}")
        return proposal["value"]

    def __init__(self, shell, kernel=None, **kwargs) -> None:
        super().__init__(shell, **kwargs)
        log_to_process_stderr()
        tell = self._tell = Tell(getattr(kernel, "events", None))
        forwarding = Forwarding(kernel.cell, kernel.notices, shell, tell) if kernel is not None else None
        self.service = Service()
        # The settings are read when used: %config may change them between cells.
        wait = QueueWait(self.service, tell, timeout=lambda: self.start_timeout)
        self.transfers = Transfers(Variables(shell), cap=lambda: self.release_state_cap)
        attacher = Attacher(self.service, wait, tell, forwarding, streams=lambda: self.transfer_streams)
        self.lifecycle = Lifecycle(self.service, attacher, wait, self.transfers, tell)
        self.status = Status(self.service, self.lifecycle, getattr(kernel, "cell", None))
        self._commands = {name: getattr(self, f"_{name}") for name in COMMANDS}  # %gpu NAME -> self._NAME

    @property
    def attachment(self) -> Attachment | None:
        """The notebook's attachment (:attr:`.lifecycle.Lifecycle.attachment`), None while detached."""
        return self.lifecycle.attachment

    # -- %gpu ---------------------------------------------------------------------

    @line_magic
    def gpu(self, line: str) -> Any:
        """Attach to a pooled GPU and manage the attachment.

        %gpu acquire 0.5 [--memory 20GiB] [--model A100] [--idle-timeout 30m] [--env torch] [--batch] [--preemptible]
        %gpu acquire 0.5 --cpus 4 --host-memory 32GiB   host cores and RAM (default: the GPU share's part of the node)
        %gpu acquire 2               two whole GPUs on one node
        %gpu acquire 0.5 --wait 10m  nothing free: wait in the queue (place in line, ETA)
        %gpu acquire 0.5 --on-idle release   at the idle timeout release (default: park in place)
        (while attached, %gpu acquire with another size, --model or --env moves there, variables and all)
        %gpu release [--discard]     variables come back unless --discard
        %gpu restart                 a fresh worker of the same size (the old one's variables are lost)
        %gpu status                  lease, environment, GPU, memory, idle countdown, names holding GPU memory
        %gpu pool                    nodes, GPUs and worker environments of the pool
        %gpu quota                   your limits and GPU-hours used
        %gpu park                    give the GPU back now; the next cell resumes where it was
        %gpu push NAME...            copy local variables to the worker
        %gpu pull NAME...            copy worker variables here
        %%gpu [0.25]                 (a cell) run it on a lease of its own when not attached
        %%local                      (a cell) run it in this kernel while attached
        """
        command, *words = split_line(line) or [""]  # split once, shell-style: quotes group a value
        if command in ("", "help", "-h", "--help"):
            print(dedent(self.gpu.__doc__))
            return None
        if command not in COMMANDS:
            raise UsageError(f"unknown %gpu command {command!r}; use one of: {', '.join(COMMANDS)} "
                             "(%gpu help shows what each does)")
        if {"-h", "--help"} & set(words):
            parser = PARSERS.get(command)
            print(parser.format_help() if parser else dedent(self.gpu.__doc__))
            return None
        try:
            return self._commands[command](words)
        except GPUPoolError as exc:
            if command == "acquire":  # quota, pool full, bad size: the front end says so too
                self._tell("refused", exc.message, code=exc.code)
            raise refused(exc) from None
        except KeyboardInterrupt:  # where no command says more: one line, never gpupool's frames (logged)
            log.debug("%%gpu %s interrupted", command, exc_info=True)
            raise UsageError(f"%gpu {command} interrupted; it did nothing more") from None

    # Each command takes the words after its name (split_line's).

    def _acquire(self, words: list[str]) -> None:
        self.lifecycle.acquire(acquire_request(words))

    def _release(self, words: list[str]) -> None:
        self.lifecycle.release(discard=release_discards(words))

    def _restart(self, words: list[str]) -> None:
        no_arguments("restart", words)
        self.lifecycle.restart()

    def _park(self, words: list[str]) -> None:
        no_arguments("park", words)
        self.lifecycle.park()

    def _push(self, words: list[str]) -> None:
        pushed = names("push", words, "X y")
        if self.lifecycle.attachment is None:  # detached: say that first, as the other commands needing a lease do
            raise UsageError("not attached to a GPU; run %gpu acquire 0.5 first")
        self.transfers.check_defined(pushed)
        self.transfers.push(self.lifecycle.attached(), pushed)

    def _pull(self, words: list[str]) -> None:
        self.transfers.pull(self.lifecycle.attached(), names("pull", words, "model history"))

    def _status(self, words: list[str]) -> None:
        no_arguments("status", words)
        self.status.show()

    def _pool(self, words: list[str]) -> None:
        no_arguments("pool", words)
        self.status.pool()

    def _quota(self, words: list[str]) -> None:
        if words:  # `%gpu quota set ...` would otherwise just show the caller's own quota
            raise UsageError("%gpu quota takes no arguments; admins change quotas with `gpupool quota set SCOPE "
                             "LIMIT=VALUE` in a terminal")
        self.status.quota()

    # -- the gpupool kernel's forwarded cells ---------------------------------------

    def prepare_forward(self, code: str) -> Attachment:
        """Before the gpupool kernel forwards cell ``code``: resume a parked
        lease, send along the local values the cell reads that the worker
        lacks. Raises UsageError with words when the cell cannot run there."""
        with self.lifecycle.on_worker() as attachment:
            self.transfers.send_along(attachment, code)
        return attachment

    def refused_on_worker(self, code: str) -> str:
        """Why the gpupool kernel may not forward cell ``code`` at all (a
        ``%gpu`` line in it that may not run mid-cell, :func:`not_mid_cell`),
        "" when it may: refused before anything of it runs, rather than
        half-run up to that line."""
        if "gpu" not in code:  # no %gpu line, and no call of the magic by name: no translation needed
            return ""
        for line in gpu_lines(self.shell.transform_cell(code)):
            refused = not_mid_cell(line)
            if refused:
                return refused
        return ""

    def run_for_worker(self, line: str) -> dict[str, Any]:
        """A ``%gpu LINE`` from a cell running on the worker: run it here (its
        output goes to that cell) unless it would detach or talk to the busy
        worker; ``{"ok": bool, "message": words}`` goes back to the worker."""
        refused = not_mid_cell(line)
        if refused:
            return {"ok": False, "message": refused}
        try:
            self.gpu(line)
        except UsageError as exc:
            return {"ok": False, "message": str(exc)}
        except Exception as exc:  # the cell on the worker shows it; this kernel goes on
            return {"ok": False, "message": f"{type(exc).__name__}: {exc}"}
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        return {"ok": True, "message": ""}

    # -- %%gpu and %%local --------------------------------------------------------

    @cell_magic("gpu")
    def gpu_cell(self, line: str, cell: str) -> None:
        """Run this cell on the worker: the attached one (what every cell does
        while attached), or, when not attached, on a lease of its own of
        ``AMOUNT`` (default c.GPUMagics.cell_lease) that is released after the
        cell, its variables coming back here.

        %%gpu 0.5
        import torch; x = torch.ones(3); torch.cuda.is_available()
        """
        if self.lifecycle.attachment is None:
            request = own_lease_request(" ".join(split_line(line)) or self.cell_lease)  # %%gpu '0.5' too
            self.lifecycle.run_on_own_lease(request, cell, self.max_output_bytes, _cell_number(self.shell))
            return
        if line.strip():
            raise UsageError("%%gpu takes an amount only when not attached; this kernel is attached")
        with self.lifecycle.on_worker() as attachment:
            self.transfers.send_along(attachment, cell)
            attachment.run_cell(cell, self.max_output_bytes)

    @cell_magic
    def local(self, line: str, cell: str) -> None:
        """Run this cell in the local CPU kernel while attached.

        %%local
        df.describe()
        """
        if line.strip():
            raise UsageError(f"%%local takes no arguments (it was given {line.strip()!r}); the cell below it runs "
                             "in this kernel")
        attached = self.lifecycle.attachment is not None
        before = self.transfers.variables.ids() if attached else {}
        result = _run_as_this_cell(self.shell, cell)
        if attached:
            self.transfers.variables.local_ran(before)
        if not result.success:  # already shown by run_cell: fail the cell without a second traceback
            raise _shown_error(result.error_in_exec or result.error_before_exec)


def _cell_number(shell) -> int:
    """The running cell's number (its ``In[n]``): IPython 9 counts a cell as it starts, so by then
    ``shell.execution_count`` is the next one's."""
    count = _running_count(shell)
    return shell.execution_count if count is None else count


def _running_count(shell) -> int | None:
    """The running cell's own ``In[n]`` as IPython's display hook holds it; None outside a cell."""
    count = getattr(getattr(shell.displayhook, "exec_result", None), "execution_count", None)
    return count if isinstance(count, int) else None


def _run_as_this_cell(shell, cell: str):
    """``shell.run_cell(cell)`` (history not stored: the ``%%local`` cell is) under the
    running cell's number, so its ``Cell In[n]`` and ``Out[n]`` are this cell's. IPython 9
    counts a cell as it starts: the nested run would take the next number for its name,
    and shows ``Out`` one below the count (``DisplayHook.prompt_count``), so the count is
    set back for the name and forward again once the nested run has taken it
    (``pre_run_cell`` comes between). Returns IPython's ``ExecutionResult``."""
    count = _running_count(shell)  # the %%local cell's own
    if count is None:
        return shell.run_cell(cell, store_history=False)
    saved = shell.execution_count
    lead = saved - shell.displayhook.prompt_count  # 1 where IPython counts a cell as it starts, else 0

    def numbered(info) -> None:
        shell.execution_count = count + lead

    shell.execution_count = count
    shell.events.register("pre_run_cell", numbered)
    try:
        return shell.run_cell(cell, store_history=False)
    finally:
        shell.events.unregister("pre_run_cell", numbered)
        shell.execution_count = saved


class ShownError(Exception):
    """A failure whose traceback was already shown: IPython renders it as
    nothing, and the gpupool kernel's shell (:class:`~.kernel.GPUPoolShell`)
    sends no ``error`` message for it, so the cell fails (Run All stops) with
    the first traceback alone, which its reply carries too."""

    def _render_traceback_(self) -> list[str]:
        return []


def _shown_error(error: BaseException | None) -> ShownError:
    """A :class:`ShownError` of the same name as ``error`` (the reply's ``ename``)."""
    name = type(error).__name__ if error is not None else "Error"
    return type(name, (ShownError,), {})(str(error) if error is not None else "")


def _process_stderr():
    """A text stream on the kernel process's own stderr. Under Jupyter, ipykernel points file
    descriptor 2 into the cells too (``OutStream`` with ``watchfd``: what a C library or a
    subprocess writes), and ``sys.__stderr__`` writes there; the stream's ``fileno()`` is its copy
    of the process's original stderr."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return sys.__stderr__
    return open(fd, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)


def log_to_process_stderr() -> None:
    """Send gpupool's log lines (a heartbeat that failed, a comm that could not be asked) to the
    kernel process's own stderr, where Jupyter's server log shows them, never into a cell:
    without a handler, Python's last-resort one writes them to ``sys.stderr``, which ipykernel
    sends to the cell that ran last, however long ago (notices go atop the next cell instead:
    docs/api.md). Once per process."""
    logger = logging.getLogger("gpupool")
    if any(getattr(handler, "gpupool_process_stderr", False) for handler in logger.handlers):
        return
    handler = logging.StreamHandler(_process_stderr())
    handler.gpupool_process_stderr = True
    handler.setFormatter(logging.Formatter("[gpupool %(levelname)s %(asctime)s %(name)s] %(message)s"))
    logger.addHandler(handler)
