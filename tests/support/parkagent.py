"""A real ``gpupool agent`` on simulated GPUs, driven over its HTTP API, for the
park-in-place tests and ``bench/park_bench.py``: its workers hold simulated GPU
memory under a root folder of its own (``GPUPOOL_SIMGPU_ROOT`` on /dev/shm),
and their cells run through a jupyter_client (the agent runs without
transport encryption: jupyter_client's own CurveZMQ client needs the worker's
secret key).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from jupyter_client import BlockingKernelClient
from workercell import worker_client

from gpupool.demo_pool import free_port, processes_mentioning, stop_process, wait_for
from gpupool.node.inventory.simulated import SimulatedInventory, simulated_uuid

GiB = 1024**3
MiB = 1024**2
TOKEN = "agent-token-for-park-tests"


def call(url: str, method: str = "GET", body: Any = None, token: str | None = TOKEN,
         timeout: float = 120) -> tuple[int, Any]:
    """One HTTP call; returns (status, decoded JSON). ``body`` bytes go as they are."""
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, method=method, data=data)
    if token:
        request.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read() or b"null")


class ParkAgent:
    """``gpupool agent --simulate=2xA100-80GB`` under ``root`` with no service
    (it keeps retrying its registration and serves the calls all the same).
    ``args``: more command-line options (``--parked-memory=...``);
    ``simulate`` empty: the host's real GPUs (NVML), whose UUIDs ``gpus``
    names."""

    def __init__(self, root: Path, name: str | None = None, args: tuple[str, ...] = (), simulate: str = "2xA100-80GB",
                 env: dict[str, str] | None = None, gpus: list[str] | None = None) -> None:
        self.name = name or f"park-{secrets.token_hex(3)}"
        self.state_dir = root / f"agent-{self.name}"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.simgpu = Path("/dev/shm") / f"gpupool-test-{self.name}"
        self.args, self.simulate, self.extra_env = args, simulate, env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.state_dir / "agent.log"
        self.gpus = gpus or [simulated_uuid(self.name, i) for i in range(2)]
        self.clients: list[BlockingKernelClient] = []
        self.start()

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "GPUPOOL_AGENT_TOKEN": TOKEN, "GPUPOOL_SIMGPU_ROOT": str(self.simgpu), **self.extra_env}

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpupool.cli", "agent", f"--service-url=http://127.0.0.1:{free_port()}",
                 *([f"--simulate={self.simulate}"] if self.simulate else []), f"--name={self.name}", "--ip=127.0.0.1",
                 f"--port={self.port}",
                 f"--state-dir={self.state_dir}", "--transport-encryption=none", "--warm-workers=0", *self.args],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env)
        wait_for(self.healthy, 60, "the agent", self.proc, self.log)

    def healthy(self) -> bool:
        try:
            return call(f"{self.url}/health", token=None, timeout=5)[0] == 200
        except OSError:
            return False

    def call(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return call(f"{self.url}{path}", method, body, **kw)

    def request(self, lease: str, gpu: int = 0, memory: int = 8 * GiB, **more: Any) -> dict[str, Any]:
        return {"lease_id": lease, "owner": "ann", "gpus": [self.gpus[gpu]], "fraction": 0.5, "memory": memory, **more}

    def start_worker(self, lease: str, **kw: Any) -> dict[str, Any]:
        status, started = self.call("POST", "/workers", self.request(lease, **kw))
        assert status == 201, started
        return started

    def park(self, lease: str, **body: Any) -> tuple[int, Any]:
        return self.call("POST", f"/workers/{lease}/park", body)

    def resume(self, lease: str, **kw: Any) -> tuple[int, Any]:
        return self.call("POST", f"/workers/{lease}/resume", self.request(lease, **kw))

    def reports(self) -> dict[str, dict[str, Any]]:
        return {w["lease_id"]: w for w in self.call("GET", "/workers")[1]["workers"]}

    def client(self, connection: dict[str, Any]) -> BlockingKernelClient:
        """A jupyter_client to a worker, ready."""
        kc = worker_client(connection)
        self.clients.append(kc)
        return kc

    def inventory(self) -> "Readings":
        """The node's inventory as the agent reads it (the same files)."""
        return Readings(SimulatedInventory(self.simulate, self.name), self.simgpu)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        for kc in self.clients:
            kc.stop_channels()
        code = stop_process(self.proc)
        left = processes_mentioning(str(self.state_dir))
        shutil.rmtree(self.simgpu, ignore_errors=True)
        assert not left, f"the agent left processes behind: {left}"
        return code


@contextmanager
def agent_pair(root: Path, args: tuple[str, ...] = ()) -> Iterator[tuple[ParkAgent, ParkAgent]]:
    """Two agents under ``root``, each with ``args`` (two nodes on this host: their own state,
    spill folders and simulated GPUs, one agent token), for moves from one to the other; stopped after."""
    first = ParkAgent(root, args=args)
    try:
        second = ParkAgent(root, args=args)
    except BaseException:
        first.stop()
        raise
    try:
        yield first, second
    finally:
        try:
            second.stop()
        finally:
            first.stop()


class Readings:
    """A simulated inventory's readings of the simulated memory under ``root``
    (``GPUPOOL_SIMGPU_ROOT`` set only while it reads, so no later agent of
    this process inherits it)."""

    def __init__(self, inventory: SimulatedInventory, root: Path) -> None:
        self.inventory, self.root = inventory, root

    def _read(self, name: str) -> Any:
        before = os.environ.get("GPUPOOL_SIMGPU_ROOT")
        os.environ["GPUPOOL_SIMGPU_ROOT"] = str(self.root)
        try:
            return getattr(self.inventory, name)()
        finally:
            if before is None:
                del os.environ["GPUPOOL_SIMGPU_ROOT"]
            else:
                os.environ["GPUPOOL_SIMGPU_ROOT"] = before

    def process_memory(self) -> dict[int, int]:
        return self._read("process_memory")

    def process_usage(self) -> list:
        return self._read("process_usage")

    def metrics(self) -> list[dict[str, Any]]:
        return self._read("metrics")
