"""The gpupool kernel: an IPython kernel that forwards to its worker while attached.

Detached, :class:`GPUPoolKernel` is a plain ipykernel ``IPythonKernel`` with
the ``%gpu`` magics. Attached (``%gpu acquire``), it forwards the front end's
requests to the lease's worker as Jupyter messages, headers kept, and relays
the worker's IOPub back re-signed (:class:`~gpupool.iopubrelay.IOPubRelay`,
:class:`~gpupool.magics.cell.ForwardedCell`),
so every output, widget, completion, tooltip and debugger reply is the
worker's own, parented to the front end's request; each cell runs once, on
the worker. What stays here:

- cells made only of ``%gpu`` lines, and ``%%local`` cells;
- ``%gpu`` lines inside a forwarded cell: the worker's ``%gpu`` asks this
  kernel over its stdin channel (:mod:`gpupool.wire.magic`); a cell with a
  line that may not run mid-cell (``%gpu release``, ``acquire``, ...) is
  refused before any of it runs;
- comms of gpupool's own targets (``gpupool.*``); all other comms go to the worker;
- ``kernel_info``, history (forwarded cells are stored here too), shutdown.

Idle warnings and "parked", "node lost", "resumed" are events
(:mod:`gpupool.magics.events`) and are said once at the top of the next cell
(:mod:`gpupool.magics.notices`).

Started by the gpupool kernelspec through :mod:`gpupool.magics.kernelapp`,
which the kernel provisioner runs in place of ``ipykernel_launcher``.
"""

from __future__ import annotations

import sys
from typing import Any

from ipykernel.zmqshell import ZMQInteractiveShell
from IPython.core.error import UsageError
from traitlets import Float, Type

from gpupool import ipykernel_private as ipk
from gpupool.errors import GPUPoolError
from gpupool.kernelapp import NoSubshellKernel

from .attachment import CellNotSent
from .cell import ForwardedCell
from .debugvars import LocalNames
from .events import Events, Requests, kernel_state
from .magics import GPUMagics, ShownError
from .notices import Notices
from .routing import comm_for_worker, completed_object, forwarded_code, help_target, malformed

#: Seconds a forwarded complete/inspect/is_complete/comm_info request waits for the worker.
REQUEST_TIMEOUT = 10.0


class GPUPoolShell(ZMQInteractiveShell):
    """ipykernel's shell, which sends no second ``error`` for a failure whose
    traceback was already sent (a ``%%local`` cell's: :class:`.magics.ShownError`);
    the reply keeps the first one's traceback."""

    def _showtraceback(self, etype, evalue, stb) -> None:
        if not isinstance(evalue, ShownError):
            super()._showtraceback(etype, evalue, stb)


class GPUPoolKernel(NoSubshellKernel):
    """IPythonKernel that forwards the front end's messages to the attached worker."""

    shell_class = Type(GPUPoolShell)

    # Forwarded cells skip ipykernel's execute_request, and with it this sleep;
    # a local cell's output is flushed before its reply anyway (a private name: gpupool.ipykernel_private).
    _execute_sleep = Float(0.0).tag(config=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.events = Events(self.comm_manager)
        self.cell = ForwardedCell(self)
        self.notices = Notices(self.cell, self.events)
        self.gpu = GPUMagics(self.shell, kernel=self)
        self.notices.lifecycle = self.gpu.lifecycle
        self.debug_names = LocalNames(self.shell)
        self.shell.register_magics(self.gpu)
        # The gpupool.status comm (JupyterLab extension): state snapshots and requests.
        self.events.snapshot = lambda: kernel_state(self.gpu.attachment)
        self.events.answer = Requests(self.gpu.gpu, self.gpu.lifecycle, self.gpu.status, self.gpu.service)
        for msg_type in ("comm_open", "comm_msg", "comm_close"):
            ipk.handle_shell(self, msg_type, getattr(self, f"_{msg_type}"))

    @property
    def kernel_info(self) -> dict[str, Any]:
        """ipykernel's, without "kernel subshells": a subshell's requests would
        run on a thread of their own, and the worker's sockets belong to the
        main thread (the debugger's to the control thread)."""
        info = dict(super().kernel_info)
        info["supported_features"] = [f for f in info.get("supported_features", []) if f != "kernel subshells"]
        return info

    async def create_subshell_request(self, socket, ident, parent) -> None:
        self.session.send(socket, "create_subshell_reply", {
            "status": "error", "ename": "NotImplementedError", "traceback": [],
            "evalue": "the gpupool kernel has no subshells (its cells may run on a remote worker)"}, parent, ident)

    # -- routing ------------------------------------------------------------------------

    def _remote(self):
        """The attached worker's connection, or None while detached or parked."""
        attachment = self.gpu.attachment
        if attachment is None or attachment.parked is not None or attachment.ended is not None:
            return None
        return attachment.remote

    def forwarded_code(self, code: str) -> str | None:
        """The code to run on the worker for cell ``code``, or None when the
        cell runs here: detached, or what :func:`.routing.forwarded_code` keeps here."""
        return None if self.gpu.attachment is None else forwarded_code(code)

    # -- execute ------------------------------------------------------------------------

    async def execute_request(self, stream, ident, parent) -> None:
        """Run the cell on the worker while attached (see :meth:`forwarded_code`),
        else here; notices come first either way."""
        content = parent.get("content", {})
        decided, self._decided = self._decided, None
        if decided is not None and decided[0] == parent["header"].get("msg_id"):
            code = decided[1]  # decided when its busy was said, just before
        else:
            code = self.forwarded_code(str(content.get("code", "")))
        self.notices.say(forwarded=code is not None)
        if code is None:
            await super().execute_request(stream, ident, parent)
            return
        refused = self.gpu.refused_on_worker(code)
        if refused:  # before anything runs: no resume, nothing sent along, no line of it on the worker
            self._say_status_here(parent)
            self._refuse_cell(stream, ident, parent, refused)
            return
        for _ in range(2):  # again once when the lease was parked to disk before the cell was sent
            try:
                attachment = self.gpu.prepare_forward(help_target(code) or code)
            except UsageError as exc:
                self._say_status_here(parent)
                self._refuse_cell(stream, ident, parent, str(exc))
                return
            try:
                reply, lost = self.cell.forward(attachment, stream, ident, parent, code)
                break
            except CellNotSent as exc:
                reply, lost = None, exc.message
        if reply is None:
            self._say_status_here(parent)
            return self._refuse_cell(stream, ident, parent, lost)
        if lost:  # after its reply: the worker's idle will not come, this kernel says it (the next cell says why)
            self._status_by_worker = None
        self._after_forwarded(reply["content"], content, code)

    def _after_forwarded(self, reply: dict[str, Any], request: dict[str, Any], code: str) -> None:
        """Keep this kernel's execution count and history with the worker's,
        so numbering goes on after a release, and note the cell's count on the
        attachment, whose release brings its ``Out[n]`` home (:meth:`.transfers.Transfers.bring_back`)."""
        count = reply.get("execution_count")
        if isinstance(count, int) and not request.get("silent"):
            self.shell.execution_count = count + 1
            if request.get("store_history", True):
                self.shell.history_manager.store_inputs(count, code)
                if self.gpu.attachment is not None:  # its Out[count] comes home at a release
                    self.gpu.attachment.counts.append(count)

    def _refuse_cell(self, stream, ident, parent, words: str) -> None:
        """End a cell that could not be forwarded as IPython ends a cell whose
        magic raised UsageError: the words on stderr, an error reply."""
        self.execution_count += 1
        count = self.execution_count
        ipk.publish_execute_input(self, parent["content"].get("code", ""), parent, count)
        self.shell.execution_count = count + 1
        print(f"UsageError: {words}", file=sys.stderr, flush=True)
        self.session.send(stream, "execute_reply", {"status": "error", "ename": "UsageError", "evalue": words,
                                                    "traceback": [], "execution_count": count}, parent, ident=ident)
        ipk.abort_queued(self, parent)

    # -- requests with a reply ----------------------------------------------------------

    async def complete_request(self, stream, ident, parent) -> None:
        if self._completes_only_here(parent.get("content", {})):
            await super().complete_request(stream, ident, parent)
            return
        await self._forward_or_local(stream, ident, parent, super().complete_request, ("code", "cursor_pos"))

    def _completes_only_here(self, content: dict[str, Any]) -> bool:
        """Whether a completion asks for an attribute or item of an object only this kernel holds
        (defined before the attach, not sent along yet: ``localdata['`` then Tab): the worker would
        answer with its own names. One ``have`` round trip, for a name this kernel holds."""
        code, cursor = content.get("code"), content.get("cursor_pos")
        if not isinstance(code, str) or not isinstance(cursor, int) or self._remote() is None:
            return False
        name = completed_object(code, cursor)
        if name is None or name not in self.shell.user_ns or name in self.shell.user_ns_hidden:
            return False
        try:
            return name not in self.gpu.attachment.have([name])
        except GPUPoolError:
            return False  # the worker's answer, or this kernel's when it gives none

    async def inspect_request(self, stream, ident, parent) -> None:
        await self._forward_or_local(stream, ident, parent, super().inspect_request, ("code", "cursor_pos"))

    async def is_complete_request(self, stream, ident, parent) -> None:
        await self._forward_or_local(stream, ident, parent, super().is_complete_request, ("code",))

    async def _forward_or_local(self, stream, ident, parent, local, fields: tuple[str, ...]) -> None:
        """Relay the worker's reply to ``parent`` while attached; answer here
        when detached, when the worker cannot answer in REQUEST_TIMEOUT (a
        completion is better local than none), or when it knows nothing of
        the name (one only this kernel holds yet: a cell reading it sends it
        along first, see :meth:`GPUMagics.prepare_forward`). A request whose ``fields``
        are missing or of the wrong type gets an error reply, the protocol's
        shape for a failed request, instead of silence."""
        wrong = malformed(parent.get("content", {}), fields)
        if wrong:
            reply_type = parent["header"]["msg_type"].replace("_request", "_reply")
            self.session.send(stream, reply_type, {"status": "error", "ename": "ValueError", "evalue": wrong,
                                                   "traceback": []}, parent, ident=ident)
            return
        remote = self._remote()
        if remote is not None:
            try:
                reply = remote.forward(parent, wait_idle=False, timeout=REQUEST_TIMEOUT)
            except GPUPoolError as exc:
                self.log.warning("gpupool: the worker did not answer %s (%s); answered here",
                                 parent["header"]["msg_type"], exc.message)
            else:
                if not _found_nothing(reply):
                    self._send_reply(stream, ident, parent, reply)
                    return
        result = local(stream, ident, parent)
        if result is not None:
            await result

    def _send_reply(self, stream, ident, parent, reply: dict[str, Any]) -> None:
        self.session.send(stream, reply["header"]["msg_type"], reply["content"], parent,
                          metadata=reply.get("metadata") or {}, ident=ident, buffers=reply.get("buffers"))

    async def comm_info_request(self, stream, ident, parent) -> None:
        """Both sides' comms: this kernel's own and, while attached, the worker's. A reply whose worker did
        not answer, or is parked, says ``"gpupool_worker_comms": "unknown"`` (the JupyterLab extension then
        marks no widget dead)."""
        comms = {cid: {"target_name": comm.target_name} for cid, comm in self.comm_manager.comms.items()}
        content: dict[str, Any] = {"status": "ok"}
        remote = self._remote()
        attachment = self.gpu.attachment
        if remote is None and attachment is not None and attachment.is_parked:
            content["gpupool_worker_comms"] = "unknown"  # frozen: its comms live on, unlisted
        if remote is not None:
            try:
                reply = remote.forward(parent, wait_idle=False, timeout=REQUEST_TIMEOUT)
                comms.update(reply["content"].get("comms", {}))
            except GPUPoolError as exc:
                self.log.warning("gpupool: the worker's comms are unknown: %s", exc.message)
                content["gpupool_worker_comms"] = "unknown"
        target = parent["content"].get("target_name")
        if target:
            comms = {cid: info for cid, info in comms.items() if info["target_name"] == target}
        self.session.send(stream, "comm_info_reply", {**content, "comms": comms}, parent, ident=ident)

    # -- comms --------------------------------------------------------------------------

    def _comm_open(self, stream, ident, parent) -> None:
        self._comm_route(stream, ident, parent, self.comm_manager.comm_open)

    def _comm_msg(self, stream, ident, parent) -> None:
        self._comm_route(stream, ident, parent, self.comm_manager.comm_msg)

    def _comm_close(self, stream, ident, parent) -> None:
        self._comm_route(stream, ident, parent, self.comm_manager.comm_close)

    def _comm_route(self, stream, ident, parent, local) -> None:
        """A comm of this kernel's is handled here; any other goes to the
        worker while attached (the worker logs unknown ids, as ipykernel does).
        While the lease is parked the worker's widgets stay alive: a message
        for one waits in the frozen worker's socket and resumes the lease."""
        attachment = self.gpu.attachment
        parked = attachment is not None and attachment.is_parked
        remote = attachment.remote if parked else self._remote()
        if remote is not None and self._comm_for_worker(parent):
            remote.send(parent)
            if parked:
                attachment.ask_resume()
        else:
            local(stream, ident, parent)

    def _comm_for_worker(self, msg: dict[str, Any]) -> bool:
        return comm_for_worker(msg, self.comm_manager.comms)

    def _publish_status(self, status, channel, parent=None) -> None:
        """ipykernel's busy/idle (a private name, :mod:`gpupool.ipykernel_private`),
        but none for a message whose busy and idle the worker says (the relay
        passes them): a comm message that goes to the worker, so the front end
        hears idle only after the worker ran the comm's callbacks (JupyterLab shows a comm message's output, e.g. an
        ``@interact`` function's, until then); and a forwarded cell, whose
        idle then follows its last output with no hop through this kernel's
        main thread (:meth:`_say_status_here` takes it back when the cell is
        not forwarded after all)."""
        msg = parent or self.get_parent(channel) or {}
        if channel == "shell" and status == "busy":
            self._record_route(msg)
        if channel == "shell" and self._worker_says_status(msg):
            return
        super()._publish_status(status, channel, parent)

    def _record_route(self, msg: dict[str, Any]) -> None:
        """At a cell's busy, said before execute_request runs: set where the
        cell of ``msg`` runs (``_decided``, which execute_request takes next) and
        so who says its status (``_status_by_worker``)."""
        header = msg.get("header") or {}
        if self._remote() is None or header.get("msg_type") != "execute_request":
            return
        code = self.forwarded_code(str((msg.get("content") or {}).get("code", "")))
        self._decided = (header.get("msg_id"), code)
        # A cell aborted behind a failed one never reaches the worker: this kernel says both.
        forwarded = code is not None and not ipk.aborting(self)
        self._status_by_worker = header.get("msg_id") if forwarded else None

    def _worker_says_status(self, msg: dict[str, Any]) -> bool:
        """Whether the worker says busy and idle of request ``msg`` (the relay passes them)."""
        if self._remote() is None:
            return False
        header = msg.get("header") or {}
        if header.get("msg_type") == "execute_request":
            return header.get("msg_id") == self._status_by_worker
        return self._comm_for_worker(msg)

    def _say_status_here(self, parent: dict[str, Any]) -> None:
        """The cell that was to be forwarded ends here (refused, or its worker
        lost): this kernel says busy now and idle at the end, as for a local cell."""
        if self._status_by_worker == parent["header"].get("msg_id"):
            self._status_by_worker = None
            super()._publish_status("busy", "shell", parent)

    # -- control: the debugger ----------------------------------------------------------

    async def debug_request(self, stream, ident, parent) -> None:
        """JupyterLab's debugger, against the worker while attached, its
        Variables listing this kernel's own names too, marked ``(local)``
        (:mod:`.debugvars`). When the worker does not answer, the reply is a
        DAP error response that says why (never this kernel's state)."""
        remote = self._remote()
        if remote is None:
            await super().debug_request(stream, ident, parent)
            return
        request = parent.get("content", {})
        local = self.debug_names.rich_inspect(request)
        if local is not None:  # a name of this kernel's, marked in the Variables panel
            self.session.send(stream, "debug_reply", local, parent, ident=ident)
            return
        try:
            reply = remote.control_request(parent)
        except GPUPoolError as exc:
            self.session.send(stream, "debug_reply", {
                "type": "response", "request_seq": request.get("seq"), "success": False,
                "command": request.get("command"), "seq": 0,
                "message": f"gpupool: the debugger runs on the worker, which did not answer: {exc.message}"},
                parent, ident=ident)
            return
        reply["content"] = self.debug_names.merge(request, reply.get("content") or {})
        self._send_reply(stream, ident, parent, reply)

    _status_by_worker: str | None = None  # msg_id of the forwarded cell whose busy/idle the worker says
    _decided: tuple[str | None, str | None] | None = None  # (msg_id, forwarded code) from its busy


def _found_nothing(reply: dict[str, Any]) -> bool:
    """Whether the worker's complete or inspect reply is empty-handed (no
    matches; not found), so that this kernel's own names may answer instead."""
    content = reply.get("content") or {}
    if content.get("status") != "ok":
        return False
    kind = (reply.get("header") or {}).get("msg_type")
    return (kind == "complete_reply" and not content.get("matches")) or (kind == "inspect_reply"
                                                                         and not content.get("found"))
