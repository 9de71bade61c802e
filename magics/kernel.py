"""The gpupool kernel: an IPython kernel that forwards to its worker while attached.

Detached, :class:`GPUPoolKernel` is a plain ipykernel ``IPythonKernel`` with
the ``%gpu`` magics. Attached (``%gpu acquire``), it forwards the front end's
requests to the lease's worker as Jupyter messages, headers kept, and relays
the worker's IOPub back re-signed (:class:`~gpupool.magics.remote.IOPubRelay`),
so every output, widget, completion, tooltip and debugger reply is the
worker's own, parented to the front end's request; each cell runs once, on
the worker. What stays here:

- cells made only of ``%gpu`` lines, and ``%%local`` cells;
- ``%gpu`` lines inside a forwarded cell: the worker's ``%gpu`` asks this
  kernel over its stdin channel (:data:`gpupool.kernelcmd.MAGIC_PROMPT`);
- comms of gpupool's own targets (``gpupool.*``); all other comms go to the worker;
- ``kernel_info``, history (forwarded cells are stored here too), shutdown.

Idle warnings and "parked", "node lost", "resumed" are events
(:mod:`gpupool.magics.events`) and are said once at the top of the next cell.

Started by the gpupool kernelspec through :mod:`gpupool.magics.kernelapp`,
which the kernel provisioner runs in place of ``ipykernel_launcher``.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import zmq
from ipykernel.ipkernel import IPythonKernel
from IPython.core.error import UsageError
from jupyter_client.session import DELIM
from traitlets import Float

from gpupool.errors import GPUPoolError
from gpupool.kernelcmd import MAGIC_PROMPT, STDIN_KEY

from .events import Events, Requests, kernel_state
from .magics import GPUMagics
from .relay import OutputBudget

#: Comm targets of the notebook kernel itself; every other comm is the worker's.
OWN_TARGET_PREFIX = "gpupool."
#: Seconds a forwarded complete/inspect/is_complete/comm_info request waits for the worker.
REQUEST_TIMEOUT = 10.0


def _malformed(content: dict[str, Any], fields: tuple[str, ...]) -> str:
    """Words for what is wrong with a request's ``fields`` ("" when nothing):
    ``code`` must be a string, ``cursor_pos`` a whole number."""
    for name in fields:
        value = content.get(name)
        kind = str if name == "code" else int
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{name} must be {'a string' if kind is str else 'a whole number'}, not {value!r}"
    return ""


class GPUPoolKernel(IPythonKernel):
    """IPythonKernel that forwards the front end's messages to the attached worker."""

    # Forwarded cells skip ipykernel's execute_request, and with it this sleep;
    # a local cell's output is flushed before its reply anyway.
    _execute_sleep = Float(0.0).tag(config=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.events = Events(self.comm_manager)
        self._reply_gate = threading.Lock()
        self.budget = OutputBudget()
        self.gpu = GPUMagics(self.shell, kernel=self)
        self.shell.register_magics(self.gpu)
        # The gpupool.status comm (JupyterLab extension): state snapshots and requests.
        self.events.snapshot = lambda: kernel_state(self.gpu)
        self.events.answer = Requests(self.gpu)
        for msg_type in ("comm_open", "comm_msg", "comm_close"):
            self.shell_handlers[msg_type] = getattr(self, f"_{msg_type}")

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
        cell runs here: detached, a ``%%local`` cell, or only ``%gpu`` lines
        (and blanks and comments). A ``%%gpu`` cell while attached runs its
        body there."""
        if self.gpu.attachment is None:
            return None
        lines = [line.strip() for line in code.splitlines() if line.strip() and not line.strip().startswith("#")]
        if not lines or lines[0].startswith("%%local"):
            return None
        if lines[0] == "%%gpu":
            return code.lstrip().partition("\n")[2]
        if lines[0].startswith("%%gpu"):  # %%gpu AMOUNT while attached: the magic says why not
            return None
        if all(line == "%gpu" or line.startswith("%gpu ") for line in lines):
            return None
        return code

    # -- execute ------------------------------------------------------------------------

    async def execute_request(self, stream, ident, parent) -> None:
        """Run the cell on the worker while attached (see :meth:`forwarded_code`),
        else here; notices come first either way."""
        self._say_notices()
        content = parent.get("content", {})
        code = self.forwarded_code(str(content.get("code", "")))
        if code is None:
            await super().execute_request(stream, ident, parent)
            return
        try:
            attachment = self.gpu.prepare_forward(code)
        except UsageError as exc:
            self._say_status_here(parent)
            self._refuse_cell(stream, ident, parent, str(exc))
            return
        reply, lost = self._forward_execute(attachment, stream, ident, parent, code)
        if reply is None:
            self._say_status_here(parent)
            return self._refuse_cell(stream, ident, parent, lost)
        if lost:  # after its reply: the worker's idle will not come, this kernel says it (the next cell says why)
            self._status_by_worker = None
        self._after_forwarded(reply["content"], content, code)

    def _forward_execute(self, attachment, stream, ident, parent: dict[str, Any],
                         code: str) -> tuple[dict[str, Any] | None, str]:
        """Send the front end's execute_request to the worker (stdin always
        allowed there, for the worker's ``%gpu``; the front end's own choice
        rides in the metadata), pass the worker's reply on to the front end
        the moment it comes (its idle comes through the relay), and wait for
        the cell's end. Returns the reply message (None when none came) and
        the words for a lease or worker lost meanwhile ("" when not)."""
        # stop_on_error is this kernel's to apply (it holds the front end's queue); the worker
        # only ever has this one request, and aborting there would abort the next cell forwarded
        # right after an error while its own abort window is still open.
        content = dict(parent["content"], code=code, allow_stdin=True, stop_on_error=False)
        self._allow_stdin = bool(parent["content"].get("allow_stdin"))
        msg = {**parent, "content": content, "metadata": {**(parent.get("metadata") or {}),
                                                          STDIN_KEY: self._allow_stdin}}
        replies: list[dict[str, Any]] = []

        def pass_on(reply: dict[str, Any]) -> None:
            # The requests queued behind a failed cell are aborted, as ipykernel does, but not
            # one the front end sends after hearing of the error.
            if reply["content"].get("status") == "error" and parent["content"].get("stop_on_error", True):
                self._abort_queues(parent["header"].get("subshell_id"))
            self.session.send(stream, "execute_reply", reply["content"], parent,
                              metadata=reply.get("metadata") or {}, ident=ident)
            if hasattr(stream, "flush"):  # a ZMQStream sends from its event loop, which waits for this handler
                stream.flush(zmq.POLLOUT)
            replies.append(reply)
            self._replied_now()

        self.budget.reset(self.gpu.max_output_bytes)
        with self._reply_gate:  # no reply yet: the worker's idle waits for it
            self._replied, self._held_idle = False, None
        with attachment.lock:
            attachment.heartbeat.running(True)
            self._running = parent["header"]
            try:
                attachment.remote.forward(msg, self._answer_stdin, attachment.check_alive, on_reply=pass_on)
                return replies[0], ""
            except GPUPoolError as exc:
                if exc.code == "lease_lost" and not replies:  # after a reply the next cell says it, and drops
                    self.gpu.drop()
                return (replies[0] if replies else None), exc.message
            finally:
                self._running = None
                attachment.heartbeat.running(False)

    def _after_forwarded(self, reply: dict[str, Any], request: dict[str, Any], code: str) -> None:
        """Keep this kernel's execution count and history with the worker's,
        so numbering goes on after a release."""
        count = reply.get("execution_count")
        if isinstance(count, int) and not request.get("silent"):
            self.shell.execution_count = count + 1
            if request.get("store_history", True):
                self.shell.history_manager.store_inputs(count, code)

    def _refuse_cell(self, stream, ident, parent, words: str) -> None:
        """End a cell that could not be forwarded as IPython ends a cell whose
        magic raised UsageError: the words on stderr, an error reply."""
        self.execution_count += 1
        count = self.execution_count
        self._publish_execute_input(parent["content"].get("code", ""), parent, count)
        self.shell.execution_count = count + 1
        print(f"UsageError: {words}", file=sys.stderr, flush=True)
        self.session.send(stream, "execute_reply", {"status": "error", "ename": "UsageError", "evalue": words,
                                                    "traceback": [], "execution_count": count}, parent, ident=ident)
        self._abort_queues(parent["header"].get("subshell_id"))

    def _answer_stdin(self, request: dict[str, Any]) -> str:
        """An ``input_request`` from the worker: a ``%gpu`` line to run here, or
        the user's ``input()``, asked of the front end as a local one would be."""
        prompt = str(request.get("prompt", ""))
        if prompt.startswith(MAGIC_PROMPT):
            line = json.loads(prompt[len(MAGIC_PROMPT):]).get("line", "")
            return json.dumps(self.gpu.run_for_worker(line))
        if not self._allow_stdin:  # the worker checks this itself; a stray request gets EOF
            return "\x04"
        ask = self.getpass if request.get("password") else self.raw_input
        return ask(prompt)

    def publish_relayed(self, idents: list, parts: list, msg: dict[str, Any]) -> None:
        """Publish one worker IOPub message (``parts``: signature, header,
        parent, metadata, content, buffers) re-signed with this kernel's key,
        unless the cell's output budget is spent (called on the relay thread;
        the IOPub socket is ipykernel's thread-safe background socket)."""
        size = sum(len(part) for part in parts[4:])
        if self.budget.cut and msg["header"]["msg_type"] == "status" and self._is_running(msg["parent_header"]):
            # Output was cut, so this is the cell's idle (its busy came first): say how much, before it.
            self._publish_note(msg["parent_header"], self.budget.finish_words())
            self.budget.cut = 0
        if not self.budget.admit(msg["header"]["msg_type"], size):
            if self.budget.cut_started():
                self._publish_note(msg["parent_header"], self.budget.cut_words())
            return
        frames = [bytes(i) for i in idents] + [DELIM, self.session.sign(parts[1:5]), *parts[1:]]
        if msg["header"]["msg_type"] == "status" and self._is_running(msg["parent_header"]) \
                and self.session.unpack(bytes(parts[4])).get("execution_state") == "idle" and self._hold_idle(frames):
            return
        self.iopub_socket.send_multipart(frames)

    def _hold_idle(self, frames: list) -> bool:
        """Keep the forwarded cell's idle until its reply has gone to the front
        end (True: kept): a front end stops listening at idle, so a cell whose
        worker is lost before its reply must end with this kernel's words and
        idle instead (the held one is then dropped)."""
        with self._reply_gate:
            if self._replied:
                return False
            self._held_idle = frames
            return True

    def _replied_now(self) -> None:
        """The forwarded cell's reply went out: its idle may follow (now, if it came first)."""
        with self._reply_gate:
            self._replied, held, self._held_idle = True, self._held_idle, None
        if held is not None:
            self.iopub_socket.send_multipart(held)

    def _is_running(self, header: dict[str, Any]) -> bool:
        """Whether ``header`` is the forwarded cell's that runs now."""
        running = self._running
        return running is not None and header.get("msg_id") == running.get("msg_id")

    def _publish_note(self, parent: dict[str, Any], text: str) -> None:
        self.session.send(self.iopub_socket, "stream", {"name": "stderr", "text": text}, parent=parent)

    # -- requests with a reply ----------------------------------------------------------

    async def complete_request(self, stream, ident, parent) -> None:
        await self._forward_or_local(stream, ident, parent, super().complete_request, ("code", "cursor_pos"))

    async def inspect_request(self, stream, ident, parent) -> None:
        await self._forward_or_local(stream, ident, parent, super().inspect_request, ("code", "cursor_pos"))

    async def is_complete_request(self, stream, ident, parent) -> None:
        await self._forward_or_local(stream, ident, parent, super().is_complete_request, ("code",))

    async def _forward_or_local(self, stream, ident, parent, local, fields: tuple[str, ...]) -> None:
        """Relay the worker's reply to ``parent`` while attached; answer here
        when detached or when the worker cannot answer in REQUEST_TIMEOUT (a
        completion is better local than none). A request whose ``fields``
        are missing or of the wrong type gets an error reply, the protocol's
        shape for a failed request, instead of silence."""
        wrong = _malformed(parent.get("content", {}), fields)
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
                self._send_reply(stream, ident, parent, reply)
                return
        result = local(stream, ident, parent)
        if result is not None:
            await result

    def _send_reply(self, stream, ident, parent, reply: dict[str, Any]) -> None:
        self.session.send(stream, reply["header"]["msg_type"], reply["content"], parent,
                          metadata=reply.get("metadata") or {}, ident=ident, buffers=reply.get("buffers"))

    async def comm_info_request(self, stream, ident, parent) -> None:
        """Both sides' comms: this kernel's own and, while attached, the worker's."""
        comms = {cid: {"target_name": comm.target_name} for cid, comm in self.comm_manager.comms.items()}
        remote = self._remote()
        if remote is not None:
            try:
                reply = remote.forward(parent, wait_idle=False, timeout=REQUEST_TIMEOUT)
                comms.update(reply["content"].get("comms", {}))
            except GPUPoolError as exc:
                self.log.warning("gpupool: the worker's comms are unknown: %s", exc.message)
        target = parent["content"].get("target_name")
        if target:
            comms = {cid: info for cid, info in comms.items() if info["target_name"] == target}
        self.session.send(stream, "comm_info_reply", {"status": "ok", "comms": comms}, parent, ident=ident)

    # -- comms --------------------------------------------------------------------------

    def _comm_open(self, stream, ident, parent) -> None:
        self._comm_route(stream, ident, parent, self.comm_manager.comm_open)

    def _comm_msg(self, stream, ident, parent) -> None:
        self._comm_route(stream, ident, parent, self.comm_manager.comm_msg)

    def _comm_close(self, stream, ident, parent) -> None:
        self._comm_route(stream, ident, parent, self.comm_manager.comm_close)

    def _comm_route(self, stream, ident, parent, local) -> None:
        """A comm of this kernel's is handled here; any other goes to the
        worker while attached (the worker logs unknown ids, as ipykernel does)."""
        remote = self._remote()
        if remote is not None and self._comm_for_worker(parent):
            remote.send(parent)
        else:
            local(stream, ident, parent)

    def _comm_for_worker(self, msg: dict[str, Any]) -> bool:
        """Whether the front end's comm message ``msg`` is the worker's (while
        attached): a ``comm_open`` of a target not gpupool's own, a
        ``comm_msg``/``comm_close`` of a comm this kernel does not have."""
        msg_type = (msg.get("header") or {}).get("msg_type")
        content = msg.get("content") or {}
        if msg_type == "comm_open":
            return not str(content.get("target_name", "")).startswith(OWN_TARGET_PREFIX)
        return msg_type in ("comm_msg", "comm_close") and content.get("comm_id") not in self.comm_manager.comms

    def _publish_status(self, status, channel, parent=None) -> None:
        """ipykernel's busy/idle, but none for a message whose busy and idle
        the worker says (the relay passes them): a comm message that goes to
        the worker, so the front end hears idle only after the worker ran the
        comm's callbacks (JupyterLab shows a comm message's output, e.g. an
        ``@interact`` function's, until then); and a forwarded cell, whose
        idle then follows its last output with no hop through this kernel's
        main thread (:meth:`_say_status_here` takes it back when the cell is
        not forwarded after all)."""
        msg = parent or self.get_parent(channel) or {}
        if channel == "shell" and self._worker_says_status(msg, status):
            return
        super()._publish_status(status, channel, parent)

    def _worker_says_status(self, msg: dict[str, Any], status: str) -> bool:
        if self._remote() is None:
            return False
        header = msg.get("header") or {}
        if header.get("msg_type") == "execute_request":
            if status == "busy":  # said before execute_request runs: decide here, for both
                code = self.forwarded_code(str((msg.get("content") or {}).get("code", "")))
                # A cell aborted behind a failed one never reaches the worker: this kernel says both.
                forwarded = code is not None and not self._aborting
                self._status_by_worker = header.get("msg_id") if forwarded else None
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
        """JupyterLab's debugger, against the worker while attached. When the
        worker does not answer, the reply is a DAP error response that says
        why (never this kernel's state)."""
        remote = self._remote()
        if remote is None:
            await super().debug_request(stream, ident, parent)
            return
        try:
            reply = remote.control_request(parent)
        except GPUPoolError as exc:
            request = parent.get("content", {})
            self.session.send(stream, "debug_reply", {
                "type": "response", "request_seq": request.get("seq"), "success": False,
                "command": request.get("command"), "seq": 0,
                "message": f"gpupool: the debugger runs on the worker, which did not answer: {exc.message}"},
                parent, ident=ident)
            return
        self._send_reply(stream, ident, parent, reply)

    # -- notices ------------------------------------------------------------------------

    def notify(self, kind: str, message: str) -> None:
        """A lease notice from the heartbeat thread: an event for listening
        front ends, and words in the cell that runs on the worker now, or
        else at the top of the next cell (never under an old one)."""
        running = self._running
        if running is not None:
            self._publish_note(running, f"gpupool: {message}\n")
        self.events.notify(kind, message, keep=running is None)

    def _say_notices(self) -> None:
        """Say the notices that came since the last cell at the top of this one."""
        pending = self.events.take_pending()
        for text in pending:
            print(f"gpupool: {text}", file=sys.stderr)
        if pending:  # before the worker's output; a flush costs a round trip to the IOPub thread
            sys.stderr.flush()

    _status_by_worker: str | None = None  # msg_id of the forwarded cell whose busy/idle the worker says
    _replied = True  # the forwarded cell's reply went out (its idle is held until then)
    _held_idle: list | None = None  # the worker's idle of it, signed, while held
    _running: dict[str, Any] | None = None  # header of the forwarded cell running now
