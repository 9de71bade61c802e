"""Cold workers forked from a template (:mod:`gpupool.zygote`) instead of
booted: the agent's side of the template's socket (:class:`Templates`), and
the forked worker as the agent watches it (:class:`ForkedProcess`). Which
workers a template serves, and why: docs/code.md, "local/".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import subprocess
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

import psutil

from ....worker_user import WorkerUser
from ...handle import open_log, tail_lines
from ...process import AdoptedProcess, running

#: Variables an interpreter (sys.path, site) or the dynamic linker (the
#: library path of every later dlopen, CUDA's too) reads once, at start: a
#: worker whose values differ from its template's is booted.
FIXED_AT_START = ("PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONUSERBASE",
                  "PYTHONSTARTUP", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "LD_LIBRARY_PATH", "LD_PRELOAD")
#: Seconds a template may take to import its modules, and to answer a fork.
READY_TIMEOUT_S = 60.0
REPLY_TIMEOUT_S = 10.0
#: Seconds between two looks at a forked worker waited for from a thread.
WAIT_POLL_S = 0.02
#: Seconds after a template failed to start before one of that interpreter is tried again.
RETRY_S = 60.0


class TemplateError(Exception):
    """A template did not start, or did not fork; the message says why."""


class ForkedProcess(AdoptedProcess):
    """A worker the template forked: watched through psutil as an adopted
    worker is, its exit code as the template reports it (None, with words in
    :attr:`exit_note`, when the template ended first)."""

    def __init__(self, proc: psutil.Process, template: "WorkerTemplate") -> None:
        super().__init__(proc, proc.create_time())
        self.template = template
        self.code: int | None = None

    @property
    def exit_note(self) -> str | None:  # type: ignore[override]
        if self.code is not None or not self.exited():
            return None
        return "the worker process ended (its exit code is unknown: the template it was forked from ended first)"

    @property
    def returncode(self) -> int | None:  # type: ignore[override]
        return self.code

    def poll(self) -> int | None:  # type: ignore[override]
        return self.code

    def exited(self) -> bool:
        if self.code is not None:
            return True
        return not self.template.alive and not running(self.proc)  # else the template's word is awaited

    def wait(self, timeout: float | None = None) -> int | None:  # type: ignore[override]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.exited():
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(WAIT_POLL_S)
        return self.code


class WorkerTemplate:
    """One running template: interpreter ``python`` with ``environ``,
    ``modules`` imported; its own output in ``log_path``."""

    def __init__(self, python: str, environ: Mapping[str, str], modules: Sequence[str], log_path: Path,
                 log: logging.Logger) -> None:
        self.python, self.environ, self.modules = python, dict(environ), tuple(modules)
        self.log_path, self.log = log_path, log
        self.alive = False
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._replies: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._children: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}  # pid -> exit code said before its fork's reply was read
        self._exits = threading.Lock()  # the reader thread's exits against fork()'s registration
        self._lock = asyncio.Lock()  # one fork request in flight: replies come in order

    @property
    def pid(self) -> int | None:
        """The template's process id (None before :meth:`start`)."""
        return self._proc.pid if self._proc is not None else None

    def serves(self, python: str, env: Mapping[str, str]) -> bool:
        """Whether a worker of interpreter ``python`` with ``env`` can be forked from here."""
        return self.alive and python == self.python and \
            all(env.get(name) == self.environ.get(name) for name in FIXED_AT_START)

    async def start(self) -> None:
        """Start the template and wait until it imported its modules.
        TemplateError; nothing is left running then (nor when cancelled)."""
        self._loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        self._sock = ours
        with theirs, open_log(self.log_path) as out:
            try:  # not asyncio's subprocess: its start, cancelled, waits on the child watcher for ever
                self._proc = subprocess.Popen(
                    [self.python, "-m", "gpupool.zygote", str(theirs.fileno()), *self.modules],
                    pass_fds=(theirs.fileno(),), env=self.environ, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as exc:
                self._abort()
                raise TemplateError(f"could not run {self.python}: {exc}") from None
        # Whatever becomes of this object, the template does not outlive it.
        weakref.finalize(self, _end, self._proc, ours)
        ready: asyncio.Future[bool] = self._loop.create_future()
        threading.Thread(target=self._read, args=(ready,), name="gpupool-template", daemon=True).start()
        try:
            started = await asyncio.wait_for(ready, READY_TIMEOUT_S)
        except asyncio.TimeoutError:
            started = False
        except BaseException:  # cancelled (the agent stops)
            self._abort()
            raise
        if not started:
            self._abort()
            raise TemplateError(f"the worker template of {self.python} did not start; its output ends with: "
                                f"{_tail(self.log_path)}")

    async def fork(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: Path,
                   account: WorkerUser | None) -> ForkedProcess:
        """A child that waits, in a session of its own, writing to
        ``log_path``, until :meth:`go` (or :meth:`drop`). TemplateError."""
        request = {"argv": list(argv), "env": dict(env), "cwd": cwd, "log": str(log_path),
                   "uid": account.uid if account else None, "gid": account.gid if account else None,
                   "groups": list(account.groups) if account else []}
        async with self._lock:
            self._send({"fork": request})
            try:
                reply = await asyncio.wait_for(self._replies.get(), REPLY_TIMEOUT_S)
            except asyncio.TimeoutError:
                reply = {"error": f"no answer in {REPLY_TIMEOUT_S:g} s"}
        if reply is None:
            raise TemplateError("the worker template ended")
        if "error" in reply:
            raise TemplateError(f"the worker template could not fork: {reply['error']}")
        pid = int(reply["pid"])
        try:
            child = ForkedProcess(psutil.Process(pid), self)
        except psutil.Error:
            raise TemplateError(f"the worker template's child {pid} is gone") from None
        with self._exits:
            self._children[pid] = child
            if pid in self._early:
                child.code = self._early.pop(pid)
        return child

    async def go(self, child: ForkedProcess) -> None:
        """Let ``child`` run the kernel (it is in its cgroup now)."""
        self._send({"go": child.pid})

    async def drop(self, child: ForkedProcess) -> None:
        """Kill ``child`` before it ran anything."""
        self._send({"drop": child.pid})

    async def close(self) -> None:
        """Close the socket: the template exits (killed after 5 s); the
        workers it forked run on."""
        self.alive = False
        _hang_up(self._sock)
        deadline = time.monotonic() + 5
        while self._proc is not None and self._proc.poll() is None and time.monotonic() < deadline:
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                self._abort()
                raise
        self._abort()

    def _abort(self) -> None:
        """End the template now."""
        self.alive = False
        _end(self._proc, self._sock)

    def _send(self, message: dict[str, Any]) -> None:
        """One line to the template: a few KiB at most, which its socket's
        buffer takes at once (the template reads all the time)."""
        if not self.alive or self._sock is None:
            raise TemplateError("the worker template ended")
        try:
            self._sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError as exc:
            self.alive = False
            raise TemplateError(f"the worker template ended ({exc})") from None

    def _read(self, ready: "asyncio.Future[bool]") -> None:
        """On a thread of its own, so that a worker's exit code arrives while
        the event loop itself waits for it (:meth:`ForkedProcess.wait`): the
        template's lines, its ``ready``, then replies to forks and exits of
        children."""
        sock, buffered = self._sock, b""
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    return
                buffered += data
                while b"\n" in buffered:
                    line, buffered = buffered.split(b"\n", 1)
                    self._take(json.loads(line), ready)
        except OSError:
            return
        finally:
            was = self.alive
            self.alive = False
            self._to_loop(self._ended, was, ready)

    def _take(self, message: dict[str, Any], ready: "asyncio.Future[bool]") -> None:
        if "exit" in message:
            pid, code = int(message["exit"]), int(message["code"])
            with self._exits:
                child = self._children.pop(pid, None)
                if child is None:
                    self._early[pid] = code
                else:
                    child.code = code
        elif "ready" in message:
            self.alive = True
            self._to_loop(lambda: ready.done() or ready.set_result(True))
        else:
            self._to_loop(self._replies.put_nowait, message)

    def _ended(self, was_alive: bool, ready: "asyncio.Future[bool]") -> None:
        if not ready.done():
            ready.set_result(False)
        if was_alive:
            self.log.warning("the worker template of %s ended; cold workers boot until it is back. Its "
                             "output ends with: %s", self.python, _tail(self.log_path))
        self._replies.put_nowait(None)

    def _to_loop(self, call: Any, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(call, *args)
        except RuntimeError:  # the event loop is closed: nobody waits any more
            pass


def _hang_up(sock: socket.socket | None) -> None:
    """Shut ``sock`` down: the template sees its end, the reader thread wakes."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _end(proc: subprocess.Popen | None, sock: socket.socket | None) -> None:
    """Hang up on the template and kill and reap it (its workers run on)."""
    _hang_up(sock)
    if sock is not None:
        sock.close()
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


class Templates:
    """The templates of one node, one per worker interpreter, each started
    with ``environ`` and ``modules`` (the admin's heavy imports) imported,
    its output in ``log_dir`` (the agent's state dir: the workers' folder
    holds workers' files only)."""

    def __init__(self, environ: Mapping[str, str], modules: Sequence[str], extensions: Sequence[str],
                 log_dir: Path, log: logging.Logger) -> None:
        self.environ, self.log_dir, self.log = dict(environ), log_dir, log
        self.modules = (*extensions, *modules)
        self._templates: dict[str, WorkerTemplate] = {}
        self._starting: dict[str, asyncio.Task] = {}
        self._failed_at: dict[str, float] = {}  # python -> monotonic time its template last failed to start

    def running(self, python: str) -> WorkerTemplate | None:
        """The live template of ``python``, if any."""
        template = self._templates.get(python)
        return template if template is not None and template.alive else None

    def ready(self, python: str, env: Mapping[str, str]) -> WorkerTemplate | None:
        """The template that can fork this worker now; None (one of
        ``python`` starts meanwhile, for the next cold start) when none can."""
        template = self.running(python)
        if template is not None and template.serves(python, env):
            return template
        self.prepare(python)
        return None

    def prepare(self, python: str) -> None:
        """Start the template of ``python`` in the background, unless one runs or starts."""
        if self.running(python) is not None or python in self._starting \
                or time.monotonic() - self._failed_at.get(python, -RETRY_S) < RETRY_S:
            return
        self._starting[python] = asyncio.get_running_loop().create_task(self._start(python))

    async def _start(self, python: str) -> None:
        name = hashlib.sha256(python.encode()).hexdigest()[:12]
        template = WorkerTemplate(python, self.environ, self.modules, self.log_dir / f"template-{name}.log",
                                  self.log)
        try:
            started = time.monotonic()
            await template.start()
            self._templates[python] = template
            self.log.info("worker template of %s ready in %.0f ms (%s imported)", python,
                          (time.monotonic() - started) * 1000, ", ".join(self.modules) or "nothing more")
        except TemplateError as exc:
            said = python in self._failed_at  # once at WARNING: an environment without setproctitle fails each time
            self._failed_at[python] = time.monotonic()
            self.log.log(logging.DEBUG if said else logging.WARNING, "%s; cold workers of %s boot (tried again in "
                         "%g s at the next cold start)", exc, python, RETRY_S)
        finally:
            self._starting.pop(python, None)

    async def close(self) -> None:
        """Stop every template (the workers they forked run on)."""
        for task in self._starting.values():
            task.cancel()
        await asyncio.gather(*(t.close() for t in self._templates.values()), return_exceptions=True)
        self._templates.clear()


def _tail(path: Path) -> str:
    return " | ".join(tail_lines(path, 5)) or "(none)"
