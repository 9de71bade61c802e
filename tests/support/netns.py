"""Hosts of their own on one machine: Linux network namespaces on a bridge,
with links a test can cut and heal.

Layout (``N`` from this process's id, so concurrent runs do not meet)::

    root namespace (the test)  10.213.N.1 --+
    gpt<pid>-<role> namespaces 10.213.N.2.. --+-- bridge br0 in gpt<pid>-switch

Each host namespace has its loopback and one interface, ``eth0``, whose veth
peer is a port of the bridge; the bridge lives in a namespace of its own so
the root namespace's firewall never sees the traffic between hosts. The test
process has a port too, so it reaches every host (REST calls, kernel
channels). Cutting a host's link sets its bridge port down, as when its
cable is pulled: the host's interface loses its carrier, nothing gets in or
out (new connections fail with "no route to host", open ones stall), while
its address and open sockets stay; healing sets the port up again and TCP's
retransmissions carry on.

Needs root and iproute2 (``ip netns``); :func:`unavailable` says why not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

__all__ = ["Host", "Network", "unavailable"]


def _ip(*args: str) -> str:
    """Run ``ip ARGS``; returns stdout. Raises RuntimeError with ip's own words."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``, creation
    refused), or None when they can: tests skip with this reason."""
    if shutil.which("ip") is None:
        return "iproute2's 'ip' command is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces (ip netns add) needs root"
    probe = f"gpt{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as exc:
        return f"network namespaces are not available: {exc}"
    _ip("netns", "delete", probe)
    return None


@dataclass(frozen=True)
class Host:
    """One namespace: its ``name``, its address ``ip`` and the ``port``
    (bridge port name, in the switch namespace) that cutting sets down."""

    name: str
    ip: str
    port: str

    @property
    def launcher(self) -> list[str]:
        """Words that run a command inside this host: ``ip netns exec NAME``."""
        return ["ip", "netns", "exec", self.name]

    def owns(self, pid: int) -> bool:
        """Whether process ``pid`` lives in this host's network namespace."""
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{self.name}").st_ino


class Network:
    """A bridge with the test process on it; :meth:`add_host` plugs in hosts.

    Always :meth:`close` it (a fixture finalizer): it stops what still runs
    in its namespaces and removes them and their links. Raises RuntimeError
    (with ip's message) when a namespace or link cannot be made.
    """

    def __init__(self) -> None:
        pid = os.getpid()
        self.prefix = f"gpt{pid}"
        self.subnet = f"10.213.{pid % 250 + 1}"
        self.switch = f"{self.prefix}-switch"
        self.hosts: list[Host] = []
        self._outside = f"{self.prefix}h"  # the test process's end, in the root namespace
        _ip("netns", "add", self.switch)
        try:
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            _ip("link", "add", self._outside, "type", "veth", "peer", "name", "p-test", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", "p-test", "master", "br0", "up")
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", self._outside)
            _ip("link", "set", self._outside, "up")
        except RuntimeError:
            self.close()
            raise

    def add_host(self, role: str) -> Host:
        """A new namespace ``gpt<pid>-ROLE`` on the bridge with the next free
        address; ``role`` is a short word (letters and digits, 1 to 8)."""
        if not (role.isalnum() and 0 < len(role) <= 8):
            raise ValueError(f"a host role is 1 to 8 letters or digits, got {role!r}")
        host = Host(f"{self.prefix}-{role}", f"{self.subnet}.{len(self.hosts) + 2}", f"p-{role}")
        _ip("netns", "add", host.name)
        self.hosts.append(host)
        _ip("-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns", host.name)
        _ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
        _ip("-n", host.name, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", host.name, "link", "set", "eth0", "up")
        _ip("-n", host.name, "link", "set", "lo", "up")
        return host

    def set_link(self, host: Host, up: bool) -> None:
        """Heal (``up``) or cut the link between ``host`` and everyone else."""
        _ip("-n", self.switch, "link", "set", host.port, "up" if up else "down")

    @contextmanager
    def cut(self, host: Host) -> Iterator[None]:
        """``with net.cut(host):`` the host is unreachable inside the block,
        and healed after it, also when the block fails."""
        self.set_link(host, False)
        try:
            yield
        finally:
            self.set_link(host, True)

    def close(self) -> list[int]:
        """Kill (SIGKILL) whatever still runs in the hosts, remove every
        namespace and link; returns the PIDs that were still running (a test
        stops its own processes first, so any here is a leak)."""
        leftovers: list[int] = []
        for host in self.hosts:
            try:
                pids = [int(p) for p in _ip("netns", "pids", host.name).split()]
            except RuntimeError:
                continue
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                leftovers.append(pid)
        for name in [host.name for host in self.hosts] + [self.switch]:
            try:
                _ip("netns", "delete", name)  # takes its veth pairs along
            except RuntimeError:
                pass
        try:
            _ip("link", "delete", self._outside)
        except RuntimeError:
            pass  # already gone with the switch namespace
        return leftovers
