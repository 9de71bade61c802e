"""The cell the gpupool kernel forwards to its worker, while it runs.

The front end's ``execute_request`` goes to the worker with stdin always
allowed (for the worker's ``%gpu``, :mod:`gpupool.wire.magic`);
the worker's reply is passed on the moment it comes, and its IOPub is
re-signed onto this kernel's (on the relay thread) within the cell's output
budget. The worker's idle waits for the reply: a front end stops listening
at idle, so a cell whose worker is lost before its reply ends with this
kernel's words and idle instead (the held one is then dropped).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any

import zmq
from jupyter_client.session import DELIM

from gpupool import ipykernel_private as ipk
from gpupool.errors import GPUPoolError, Reason
from gpupool.kernelapp import COUNT_KEY
from gpupool.schema import parse_time
from gpupool.wire.magic import STDIN_KEY, answer_text, asked_line

from .attachment import CellNotSent
from .park import interrupted_words
from .relay import OutputBudget
from .words import CELL_DID_NOT_RUN, CELL_STOPPED, ended_words

#: Seconds a forwarded cell's end waits for the IOPub thread to send its idle.
IDLE_SEND_S = 1.0
#: Seconds a cell the worker ended in a KeyboardInterrupt not sent from here waits for the service to
#: show the park that interrupted it: a stopping agent interrupts the cell, saves every worker of its
#: node to disk, and only then says so (c.AgentParking.park_on_stop). Past it the cell ends as it was.
INTERRUPT_EXPLAINED_S = 15.0


class ForwardedCell:
    """The forwarded cell of :class:`~gpupool.magics.kernel.GPUPoolKernel` ``kernel``."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.budget = OutputBudget()
        self._reply_gate = threading.Lock()
        self._replied = True  # the forwarded cell's reply went out (its idle is held until then)
        self._held_idle: list | None = None  # the worker's idle of it, signed, while held
        self.running: dict[str, Any] | None = None  # header of the forwarded cell running now
        self.ended_at: float | None = None  # epoch seconds the last forwarded cell ended

    def forward(self, attachment, stream, ident, parent: dict[str, Any],
                code: str) -> tuple[dict[str, Any] | None, str]:
        """Send the front end's execute_request to the worker (stdin always
        allowed there, for the worker's ``%gpu``; the front end's own choice
        rides in the metadata, with the execution count the cell takes), pass the worker's reply on to the front end
        the moment it comes (its idle comes through the relay), and wait for
        the cell's end. Returns the reply message (None when none came) and
        the words for a lease or worker lost meanwhile ("" when not). Raises
        :class:`.attachment.CellNotSent` when the worker had ended before the
        cell was sent (nothing ran: the caller forwards it again)."""
        kernel = self.kernel
        # stop_on_error is this kernel's to apply (it holds the front end's queue); the worker
        # only ever has this one request, and aborting there would abort the next cell forwarded
        # right after an error while its own abort window is still open.
        content = dict(parent["content"], code=code, allow_stdin=True, stop_on_error=False)
        # The front end's choice, for the user's input() asked of it here.
        ipk.set_allow_stdin(kernel, bool(parent["content"].get("allow_stdin")))
        # The cell takes this kernel's next count (gpupool.kernelapp.WorkerKernel): one numbering
        # for the notebook, whichever kernel runs a cell.
        msg = {**parent, "content": content, "metadata": {**(parent.get("metadata") or {}),
                                                          STDIN_KEY: ipk.allow_stdin(kernel),
                                                          COUNT_KEY: kernel.shell.execution_count}}
        replies: list[dict[str, Any]] = []
        interrupts: list[float] = []  # the user's own, here (SIGINT), which the worker was sent
        watching = False  # whether they are noted (:func:`_noting_sigint`)
        held: list[dict[str, Any]] = []  # a reply kept until its cell says what interrupted it

        def pass_on(reply: dict[str, Any]) -> None:
            if watching and not interrupts and _interrupted(reply):
                held.append(reply)  # not by the user: a park, say; its idle waits for it (_hold_idle)
            else:
                send(reply)

        def send(reply: dict[str, Any]) -> None:
            # The requests queued behind a failed cell are aborted, as ipykernel does, but not
            # one the front end sends after hearing of the error.
            if reply["content"].get("status") == "error" and parent["content"].get("stop_on_error", True):
                ipk.abort_queued(kernel, parent)
            kernel.session.send(stream, "execute_reply", reply["content"], parent,
                                metadata=reply.get("metadata") or {}, ident=ident)
            if hasattr(stream, "flush"):  # a ZMQStream sends from its event loop, which waits for this handler
                stream.flush(zmq.POLLOUT)
            replies.append(reply)
            self._replied_now()

        self.budget.reset(kernel.gpu.max_output_bytes)
        with self._reply_gate:  # no reply yet: the worker's idle waits for it
            self._replied, self._held_idle = False, None
        with attachment.lock:
            attachment.heartbeat.running(True)
            self.running = parent["header"]
            sent = time.time()
            try:
                with _noting_sigint(interrupts) as watching:
                    attachment.remote.forward(msg, self._answer_stdin, lambda: attachment.check_alive(sent),
                                              on_reply=pass_on)
                if held:
                    self._say_what_interrupted(attachment, parent)
                    send(held.pop())
                self._idle_sent()
                return replies[0], ""
            except CellNotSent:
                raise
            except GPUPoolError as exc:
                if held:  # the wait on the worker failed after its reply: it goes out as it came
                    send(held.pop())
                if exc.code == Reason.lease_lost and not replies:  # after a reply the next cell says it, and drops
                    ended = attachment.ended
                    kernel.gpu.lifecycle.drop()
                    if ended is not None:
                        return None, ended_words(ended, _what_became_of_cell(ended, sent))
                return (replies[0] if replies else None), exc.message
            finally:
                if held:
                    send(held.pop())
                self.running, self.ended_at = None, time.time()
                attachment.heartbeat.running(False)

    def _say_what_interrupted(self, attachment, parent: dict[str, Any]) -> None:
        """The worker ended the cell of ``parent`` in a KeyboardInterrupt that this kernel did
        not send: when the service shows a park that did it (its node's agent stopping, say)
        within INTERRUPT_EXPLAINED_S, say so in the cell, once (docs/parking.md, "Agent restarts")."""
        try:
            lease = attachment.park_that_interrupted(INTERRUPT_EXPLAINED_S)
            if lease is None:
                return
            words = interrupted_words(lease)
            self.note(parent, f"gpupool: {words}\n")
            self.kernel.events.notify("parked", words)
        except KeyboardInterrupt:  # the user's, meanwhile: the cell ends now, as it came
            pass

    def _idle_sent(self) -> None:
        """Wait (at most IDLE_SEND_S) until the IOPub thread has sent the
        cell's idle, which is queued for it by now: that thread needs the GIL,
        which this one would otherwise hold through the cell's bookkeeping
        (history, counts) while the front end waits for the idle. ipykernel's
        own flush after each request waits the same way; the gpupool kernel's
        skips it when nothing was written (:mod:`.outstream`)."""
        io_thread = getattr(self.kernel.iopub_socket, "io_thread", None)
        if io_thread is None:
            return
        sent = threading.Event()
        io_thread.schedule(sent.set)
        sent.wait(IDLE_SEND_S)

    def _answer_stdin(self, request: dict[str, Any]) -> str:
        """An ``input_request`` from the worker: a ``%gpu`` line to run here, or
        the user's ``input()``, asked of the front end as a local one would be."""
        prompt = str(request.get("prompt", ""))
        line = asked_line(prompt)
        if line is not None:
            result = self.kernel.gpu.run_for_worker(line)
            return answer_text(result["ok"], result["message"])
        if not ipk.allow_stdin(self.kernel):  # the worker checks this itself; a stray request gets EOF
            return "\x04"
        ask = self.kernel.getpass if request.get("password") else self.kernel.raw_input
        return ask(prompt)

    def publish(self, idents: list, parts: list, msg: dict[str, Any]) -> None:
        """Publish one worker IOPub message (``parts``: signature, header,
        parent, metadata, content, buffers) re-signed with the kernel's key,
        unless the cell's output budget is spent (called on the relay thread;
        the IOPub socket is ipykernel's thread-safe background socket)."""
        session = self.kernel.session
        size = sum(len(part) for part in parts[4:])
        if self.budget.cut and msg["header"]["msg_type"] == "status" and self.is_running(msg["parent_header"]):
            # Output was cut, so this is the cell's idle (its busy came first): say how much, before it.
            self.note(msg["parent_header"], self.budget.finish_words())
            self.budget.cut = 0
        if not self.budget.admit(msg["header"]["msg_type"], size):
            if self.budget.cut_started():
                self.note(msg["parent_header"], self.budget.cut_words())
            return
        frames = [bytes(i) for i in idents] + [DELIM, session.sign(parts[1:5]), *parts[1:]]
        if msg["header"]["msg_type"] == "status" and self.is_running(msg["parent_header"]) \
                and session.unpack(bytes(parts[4])).get("execution_state") == "idle" and self._hold_idle(frames):
            return
        self.kernel.iopub_socket.send_multipart(frames)

    def _hold_idle(self, frames: list) -> bool:
        """Keep the forwarded cell's idle until its reply has gone to the front
        end (True: kept)."""
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
            self.kernel.iopub_socket.send_multipart(held)

    def is_running(self, header: dict[str, Any]) -> bool:
        """Whether ``header`` is the forwarded cell's that runs now."""
        running = self.running
        return running is not None and header.get("msg_id") == running.get("msg_id")

    def note(self, parent: dict[str, Any], text: str, stream: str = "stderr") -> None:
        """Words on ``stream`` (``stdout`` or ``stderr``) in the cell of ``parent`` (a request's header)."""
        self.kernel.session.send(self.kernel.iopub_socket, "stream", {"name": stream, "text": text}, parent=parent)


def _interrupted(reply: dict[str, Any]) -> bool:
    """Whether the worker's execute_reply ``reply`` says its cell ended in a KeyboardInterrupt."""
    content = reply.get("content") or {}
    return content.get("status") == "error" and content.get("ename") == "KeyboardInterrupt"


@contextlib.contextmanager
def _noting_sigint(interrupts: list[float]):
    """Note in ``interrupts`` the time of each SIGINT (the user's interrupt: the front end's stop
    button, Ctrl-C), then handle it as before (the wait on the worker sends it an interrupt).
    Yields whether it notes them: only on the main thread (the one forwarding cells), and only
    over a handler Python can call again."""
    prior = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if not callable(prior):
        yield False
        return

    def noted(signum, frame) -> None:
        interrupts.append(time.monotonic())
        prior(signum, frame)

    signal.signal(signal.SIGINT, noted)
    try:
        yield True
    finally:
        signal.signal(signal.SIGINT, prior)


def _what_became_of_cell(ended, sent: float) -> str:
    """Whether the cell sent at ``sent`` (epoch seconds) ran before lease
    ``ended`` ended: it did not when the lease had ended before it was sent
    (the worker was stopped with it), else it was stopped partway."""
    at = parse_time(ended.ended_at)
    return CELL_DID_NOT_RUN if at is None or at.timestamp() <= sent else CELL_STOPPED
