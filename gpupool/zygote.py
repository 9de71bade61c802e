"""A worker template (a *zygote*, as Android's app processes come from one):
an interpreter of a worker environment that has imported the worker kernel,
its extensions and the modules the admin names, and forks a new worker from
that state instead of booting one. Run as ``python -m gpupool.zygote FD
MODULE...``; its protocol over the socket ``FD`` and what a child inherits:
docs/code.md, "The worker template".
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import shlex
import signal
import socket
import sys
import traceback
from typing import Any

import setproctitle  # gpupool[worker]: without it the template does not start, and workers boot

#: The kernel application a child runs (what ``python -m gpupool.kernelapp`` runs).
KERNEL_APP = "gpupool.kernelapp"


class Template:
    """The template's loop over the agent's socket ``sock``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.gates: dict[int, int] = {}  # child pid -> write end of its gate pipe
        self.wake = os.pipe()  # SIGCHLD's wakeup fd: a child ended
        os.set_blocking(self.wake[1], False)
        self.selector = selectors.DefaultSelector()

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def serve(self) -> None:
        wake_r, wake_w = self.wake
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(self.sock, selectors.EVENT_READ)
        self.selector.register(wake_r, selectors.EVENT_READ)
        buffered = b""
        while True:
            for key, _ in self.selector.select():
                if key.fileobj == wake_r:
                    os.read(wake_r, 4096)
                    self.reap()
                    continue
                data = self.sock.recv(65536)
                if not data:
                    return  # the agent is gone: its workers run on
                buffered += data
                while b"\n" in buffered:
                    line, buffered = buffered.split(b"\n", 1)
                    self.handle(json.loads(line))

    def handle(self, message: dict[str, Any]) -> None:
        if "fork" in message:
            self.fork(message["fork"])
        elif "go" in message:
            self.release(int(message["go"]), b"go\n")
        elif "drop" in message:
            pid = int(message["drop"])
            self.release(pid, b"")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def fork(self, request: dict[str, Any]) -> None:
        gate_r, gate_w = os.pipe()
        try:
            log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            os.close(gate_r)
            os.close(gate_w)
            self.send({"error": f"cannot open the worker's log {request['log']}: {exc.strerror}"})
            return
        pid = os.fork()
        if pid == 0:  # the child: none of the template's descriptors but its gate and log
            os.close(gate_w)
            self.selector.close()
            for fd in (*self.wake, *self.gates.values(), self.sock.detach()):
                os.close(fd)
            _child(gate_r, log, request)
        os.close(gate_r)
        os.close(log)
        self.gates[pid] = gate_w
        self.send({"pid": pid})

    def release(self, pid: int, word: bytes) -> None:
        gate = self.gates.pop(pid, None)
        if gate is None:
            return
        try:
            if word:
                os.write(gate, word)
        finally:
            os.close(gate)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.release(pid, b"")
            self.send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _child(gate: int, log: int, request: dict[str, Any]) -> None:
    """In the forked child: wait for the gate, become the worker, run its
    kernel, then exit as an interpreter does (atexit functions, thread
    joins: SystemExit unwinds the template's frames, none of which catches
    it); never returns."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    word = os.read(gate, 3)
    os.close(gate)
    if word != b"go\n":
        os._exit(1)  # dropped: the agent could not confine it
    code: Any = 1
    try:
        # Before the environment is replaced: setproctitle finds its room at the end of the original one.
        setproctitle.setproctitle(shlex.join([sys.executable, "-m", KERNEL_APP, *request["argv"]]))
        _become(request)
        module = importlib.import_module(KERNEL_APP)
        sys.argv = [module.__file__, *request["argv"]]  # as ``python -m`` sets it
        module.WorkerKernelApp.launch_instance()
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - said in the worker's log, as an uncaught error would be
        traceback.print_exc()
    raise SystemExit(code)


def _become(request: dict[str, Any]) -> None:
    """Take the worker's account, environment and folder (as ``subprocess``
    would have given them to a new interpreter)."""
    os.chdir(request["cwd"])  # first, as subprocess does: as the agent's account
    if request.get("uid") is not None:
        os.setgroups(request.get("groups") or [])
        os.setgid(request["gid"])
        os.setuid(request["uid"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(SET_BY_IMPORTS)
    os.environ["PWD"] = os.getcwd()  # as the shell of a booted worker's start gate sets it
    sys.path[0] = os.getcwd()  # what ``python -m`` puts first: the worker's folder
    _user_site()


def _user_site() -> None:
    """The user site-packages of the worker's account (its HOME), in place
    of the template's, as a new interpreter would find them."""
    import site

    if not site.ENABLE_USER_SITE:
        return
    old = site.USER_SITE
    if old in sys.path:
        sys.path.remove(old)
    site.USER_BASE = site.USER_SITE = None
    new = site.getusersitepackages()
    if os.path.isdir(new):
        site.addsitedir(new)


#: What the template's imports put into ``os.environ`` (ipykernel.debugger
#: sets ``PYDEVD_USE_FRAME_EVAL``): a child's environment gets it too, as
#: those imports in a booted worker would have set it.
SET_BY_IMPORTS: dict[str, str] = {}


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    before = dict(os.environ)
    # ipykernel.debugger (debugpy) is a tenth of a second of every kernel's start
    for module in (KERNEL_APP, "ipykernel.ipkernel", "ipykernel.kernelapp", "ipykernel.debugger", *argv[1:]):
        importlib.import_module(module)
    SET_BY_IMPORTS.update({k: v for k, v in os.environ.items() if before.get(k) != v})
    sock.sendall(b'{"ready": true}\n')
    Template(sock).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
