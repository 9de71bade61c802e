"""The worker side of ``gpupool run``, seen from the terminal: connect to an
active lease's worker, run a script there (gpupool.scriptmain), stream its
output here, forward Ctrl-C, heartbeat the lease, return the exit status.
"""

from __future__ import annotations

import inspect
import os
import re
import signal
import sys
from typing import Any, Callable

from . import scriptmain
from .api import ServiceClient
from .errors import GPUPoolError, Reason
from .heartbeat import LeaseHeartbeat, beat_interval, ended_message
from .leasewait import RESUME_STATES
from .remote import RemoteKernel
from .tables import parked_for, resumed_words
from .wire.leases import Lease
from .wire.transfer import TARGET, Attach

#: The worker-namespace name that holds the script's exit status after the run.
STATUS_NAME = "_gpupool_exit"
#: Seconds the worker may take to answer once it is running.
READY_TIMEOUT = 30.0
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class Abandoned(BaseException):
    """The run was given up here (a second Ctrl-C, SIGTERM): ``why`` in words,
    ``status`` the exit status. A BaseException, so that no wait inside the
    run swallows it."""

    def __init__(self, why: str, status: int) -> None:
        super().__init__(why)
        self.why, self.status = why, status


def script_cell(source: str, path: str, argv: list[str]) -> str:
    """The code the worker executes: gpupool.scriptmain's source, then
    ``_gpupool_exit = run_as_main(source, path, argv)``. One line each, the
    texts as literals, so no IPython input transformation can touch them."""
    module = inspect.getsource(scriptmain)
    return f"exec({module!r})\n{STATUS_NAME} = run_as_main({source!r}, {path!r}, {argv!r})\n"


def exit_status(reply: dict[str, Any]) -> int:
    """The script's exit status from the worker's ``execute_reply`` content:
    the value of :data:`STATUS_NAME`; 130 when the cell itself was interrupted
    (before the script began or after it ended), 1 for any other failure."""
    if reply.get("status") != "ok":
        return 130 if reply.get("ename") == "KeyboardInterrupt" else 1
    value = reply.get("user_expressions", {}).get("status", {})
    try:
        return int(value["data"]["text/plain"])
    except (KeyError, TypeError, ValueError):
        return 1


class TerminalOutput:
    """Callable for :meth:`RemoteKernel.execute`: one IOPub message of the
    script in, the same output on this process's stdout or stderr out
    (``text/plain`` of displays; an ``error``'s traceback without colour)."""

    def __init__(self, stdout=None, stderr=None) -> None:
        self.stdout, self.stderr = stdout or sys.stdout, stderr or sys.stderr

    def __call__(self, msg: dict[str, Any]) -> None:
        kind, content = msg["header"]["msg_type"], msg["content"]
        if kind == "stream":
            stream = self.stderr if content.get("name") == "stderr" else self.stdout
            stream.write(content.get("text", ""))
            stream.flush()
        elif kind in ("display_data", "execute_result", "update_display_data"):
            text = content.get("data", {}).get("text/plain")
            if text:
                print(text, file=self.stdout, flush=True)
        elif kind == "error":
            lines = content.get("traceback") or [f"{content.get('ename')}: {content.get('evalue')}"]
            print(_ANSI.sub("", "\n".join(lines)), file=self.stderr, flush=True)


class Interrupts:
    """SIGINT while the script runs: the first asks the worker to interrupt
    the script; the next raises :class:`Abandoned` (status 130). A context
    manager that restores the previous handler."""

    def __init__(self, remote: RemoteKernel) -> None:
        self.remote, self.count, self._previous = remote, 0, None

    def __enter__(self) -> "Interrupts":
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count > 1:
            raise Abandoned("interrupted twice", 130)
        print("\ngpupool: interrupting the script (Ctrl-C again releases the GPU and exits)", file=sys.stderr,
              flush=True)
        self.remote.interrupt()


def enter_cwd(remote: RemoteKernel, owner: str) -> str | None:
    """Ask the worker to run in this process's folder, with its home as ``~``, as the
    notebook's attach does (the transfer comm's ``attach`` op): it does when its node
    sees that folder and may enter it, else it runs in a scratch folder of ``owner``'s
    there. Returns that other folder, in words; None when it runs in this one.
    GPUPoolError when the worker does not answer."""
    here = os.getcwd()
    attach = Attach(cwd=here, home=os.path.expanduser("~"), user=owner)
    answer, _ = remote.comm_request(TARGET, attach.to_json(), timeout=READY_TIMEOUT)
    cwd = answer.get("cwd")
    if not answer.get("ok") or not cwd:
        return "the worker's own folder (it could not be told this one)"
    if answer.get("notebook_dir") and cwd == here:
        return None
    if answer.get("notebook_dir"):
        return cwd
    return (f"{cwd}, a scratch folder of yours on the GPU node, which cannot enter {here} (copy the files the "
            "script needs there, or run it from a folder the node shares)")


def parked_words(lease: Lease) -> str:
    """What a script's terminal is told when its lease was parked under it:
    ``'lease L-1 was parked (preempted: 1 person is waiting for a GPU): the
    script is frozen where it is on node-1 and goes on when the pool resumes
    the lease'``."""
    why = (lease.parked or {}).get("reason")
    return (f"lease {lease.id} was parked{f' ({why})' if why else ''}: the script is frozen where it is on "
            f"{lease.node} and goes on when the pool resumes the lease")


def run_script(client: ServiceClient, lease: Lease, source: str, path: str, argv: list[str],
               ask: Callable[[dict[str, Any]], str],
               announce: Callable[[str | None], None] = lambda elsewhere: None) -> int:
    """Run ``source`` as script ``path`` with arguments ``argv`` on active
    ``lease``'s worker, in this process's folder where the node can enter it
    (:func:`enter_cwd`), heartbeating the lease; ``announce(folder)`` is
    called once the worker is ready, before the script starts, with the
    folder it runs in when that is not this one (else None); ``ask(input_request
    content)`` answers the script's ``input()``. A lease parked while the
    script runs (a ``--preemptible`` one told to yield, after the heartbeat's
    notice) is asked to resume at once, and the terminal is told of the park
    and of the resume; its frozen worker is not counted as unreachable
    meanwhile. Returns its exit status.

    Raises GPUPoolError ``worker_unreachable`` when the worker does not
    answer, ``lease_lost`` when the lease ends while the script runs;
    :class:`Abandoned` after a second Ctrl-C. The caller releases the lease.
    """
    remote = RemoteKernel(lease.connection or {})
    beat = LeaseHeartbeat(client, lease.id, beat_interval(lease))
    resume_asked = False
    parked_as: Lease | None = None  # the lease as first seen parked, for how long it stayed parked
    try:
        remote.wait_ready(READY_TIMEOUT)
        beat.start()
        beat.running(True)
        announce(enter_cwd(remote, lease.owner or "user"))

        def check() -> None:
            nonlocal resume_asked, parked_as
            if beat.ended is not None:
                raise GPUPoolError(Reason.lease_lost, f"{ended_message(beat.ended)}; the script was stopped", 410)
            parked = beat.last is not None and beat.last.state in RESUME_STATES
            remote.pause_liveness(parked)
            if parked and not resume_asked:
                try:  # idempotent: the service resumes it when room comes on its node
                    client.resume(lease.id)
                except GPUPoolError as exc:  # asked again at the next check
                    print(f"gpupool: could not ask to resume {lease.id}: {exc.message}", file=sys.stderr)
                    return
                parked_as = beat.last
                print(f"gpupool: {parked_words(beat.last)}", file=sys.stderr, flush=True)
            elif resume_asked and not parked:  # the notebook's words, and what the script does
                words = resumed_words(beat.last, None, parked_for(parked_as), parked_as.node if parked_as else None)
                print(f"gpupool: {words}; the script goes on", file=sys.stderr, flush=True)
            resume_asked = parked

        with Interrupts(remote):
            reply = remote.execute(script_cell(source, path, argv), TerminalOutput(), ask, check,
                                   user_expressions={"status": STATUS_NAME})
    finally:
        beat.stop()
        remote.close()
    return exit_status(reply)
