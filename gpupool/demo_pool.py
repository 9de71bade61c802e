"""The pool ``gpupool demo`` starts on this machine: the service and agents
as child processes running the real commands.

Each start waits until the process answers and names its log when it does
not; each stop checks that nothing it started is left running. The tests
(``tests/support/procs.py``) and benchmarks start their pools with it too; the
client that runs a cell on a worker without a notebook kernel is theirs
(``tests/support/workercell.py``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from .api import ServiceClient
from .errors import GPUPoolError, Reason

GPUPOOL = [sys.executable, "-m", "gpupool.cli"]
T = TypeVar("T")


def free_port(ip: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``ip`` a moment ago."""
    with socket.socket() as sock:
        sock.bind((ip, 0))
        return sock.getsockname()[1]


def wait_for(predicate: Callable[[], T], timeout: float, what: str, proc: subprocess.Popen | None = None,
             log: Path | None = None) -> T:
    """Poll ``predicate`` every 50 ms until it returns something truthy.

    Raises GPUPoolError ``start_failed`` if ``proc`` exits first or after
    ``timeout`` seconds, with the tail of ``log``.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise GPUPoolError(Reason.start_failed, f"{what} exited with code {proc.returncode}; its log "
                               f"({log}) ends with:\n{_tail(log)}", 500)
        time.sleep(0.05)
    raise GPUPoolError(Reason.start_failed, f"{what} was not ready after {timeout:.0f}s; its log ({log}) ends "
                       f"with:\n{_tail(log)}", 504)


def _tail(log: Path | None, size: int = 3000) -> str:
    if log is None or not log.exists():
        return "(no log)"
    return log.read_text(errors="replace")[-size:]


def stop_process(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains ``text`` (a state
    directory, say: every worker's connection file lives under its agent's)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(text in p for p in proc.info["cmdline"] or ()):
                found.append(proc.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@dataclass
class ServiceProcess:
    """A running ``gpupool service``: its ``url`` and the tokens it wrote."""

    proc: subprocess.Popen
    url: str
    state_dir: Path
    log: Path

    @property
    def agent_token_file(self) -> Path:
        return self.state_dir / "agent_token"

    def client(self, token: str | None = None) -> ServiceClient:
        """A client with ``token``, or the generated user token."""
        return ServiceClient(self.url, token or (self.state_dir / "user_token").read_text().strip())

    def stop(self) -> int:
        return stop_process(self.proc)


@dataclass
class AgentProcess:
    """A running ``gpupool agent``."""

    proc: subprocess.Popen
    name: str
    url: str
    state_dir: Path
    log: Path

    def stop(self) -> int:
        """Stop the agent; raises GPUPoolError ``leak`` if any of its workers survived."""
        code = stop_process(self.proc)
        leftovers = processes_mentioning(str(self.state_dir))
        if leftovers:
            raise GPUPoolError(Reason.leak, f"agent {self.name} left processes running: {leftovers}", 500)
        return code


def start_service(state_dir: Path, *, config_file: Path | None = None, ip: str = "127.0.0.1",
                  port: int | None = None, env: dict[str, str] | None = None, timeout: float = 30,
                  launcher: Sequence[str] = ()) -> ServiceProcess:
    """Start ``gpupool service`` with its state (SQLite, tokens) in ``state_dir``.

    ``launcher``: words put before the command, e.g. ``["ip", "netns", "exec", "ns-a"]``
    to run it in a network namespace. ``port`` None: the service binds a free one itself
    (port 0) and says which in service.json, so no other process can take it in between.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    info_file = state_dir / "service.json"
    info_file.unlink(missing_ok=True)
    log = state_dir / "service.log"
    args = [*launcher, *GPUPOOL, "service", f"--ip={ip}", f"--port={port or 0}", f"--state-dir={state_dir}"]
    if config_file is not None:
        args.append(f"--config={config_file}")
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
    wait_for(info_file.exists, timeout, "gpupool service", proc, log)
    return ServiceProcess(proc, json.loads(info_file.read_text())["url"], state_dir, log)


def start_agent(state_dir: Path, service: ServiceProcess, *, name: str = "node-1", simulate: str | None = "2xA100-80GB",
                ip: str = "127.0.0.1", port: int | None = None, extra_args: list[str] | None = None,
                client: ServiceClient | None = None, timeout: float = 30,
                launcher: Sequence[str] = ()) -> AgentProcess:
    """Start ``gpupool agent`` (simulated GPUs unless ``simulate`` is None:
    then NVML) and wait until the service lists the node as up (asked with
    ``client``, by default one with the generated user token). ``launcher``
    and ``port``: as for :func:`start_service` (the agent says its address in
    agent.json once registered)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    info_file = state_dir / "agent.json"
    info_file.unlink(missing_ok=True)  # a stale one would name another agent's port
    log = state_dir / "agent.log"
    args = [*launcher, *GPUPOOL, "agent", f"--service-url={service.url}", f"--token-file={service.agent_token_file}",
            f"--name={name}", f"--ip={ip}", f"--port={port or 0}", f"--state-dir={state_dir}", *(extra_args or [])]
    if simulate:
        args.append(f"--simulate={simulate}")
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    client = client or service.client()

    def registered() -> bool:
        return info_file.exists() and any(n["name"] == name and n["state"] == "up" for n in client.pool()["nodes"])

    wait_for(registered, timeout, f"gpupool agent {name}", proc, log)
    return AgentProcess(proc, name, json.loads(info_file.read_text())["url"], state_dir, log)
