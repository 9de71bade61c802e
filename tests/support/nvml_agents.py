"""A real agent whose NVML is the fake (fakenvml.ControlledNVML, driven by a
control file), and what the service then says of its node."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpupool.demo_pool import AgentProcess, free_port, wait_for
from gpupool.errors import GPUPoolError
from gpupool.wire.leases import LeaseRequest


FAKENVML = Path(__file__).with_name("fakenvml.py")


NODE = "gpu-node"


REFUSED_FOR_NVML = "2 GPUs ruled out: node cannot read its GPUs (NVML)"


def start_nvml_agent(root: Path, service: Any, control: Path, port: int | None = None,
                     extra: tuple[str, ...] = ()) -> AgentProcess:
    """``gpupool agent`` in NVML mode on the fake driven by ``control``, retrying
    NVML after 0.2 s, then every 0.4 s; it logs at DEBUG (each failed retry).
    Restart one on its ``port``: the same URL is the same agent to the service.
    ``extra``: more command-line options."""
    state_dir = root / f"agent-{NODE}"
    state_dir.mkdir(exist_ok=True)
    port = port or free_port("127.0.0.1")
    log = state_dir / "agent.log"
    args = [sys.executable, str(FAKENVML), str(control), f"--service-url={service.url}",
            f"--token-file={service.process.agent_token_file}", f"--name={NODE}", "--ip=127.0.0.1",
            f"--port={port}", f"--state-dir={state_dir}", "--warm-workers=0", "--log-level=DEBUG",
            "--AgentInventory.nvml_retry_min=0.2", "--AgentInventory.nvml_retry_max=0.4", *extra]
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return AgentProcess(proc, NODE, f"http://127.0.0.1:{port}", state_dir, log)


def node_in_state(client: Any, agent: AgentProcess, state: str) -> dict[str, Any]:
    """The node's ``GET /pool`` entry once it is in ``state`` (the wait is a bound only)."""
    def found() -> dict[str, Any] | None:
        node = next((n for n in client.pool()["nodes"] if n["name"] == NODE), None)
        return node if node is not None and node["state"] == state else None
    return wait_for(found, 60, f"node {NODE} {state}", agent.proc, agent.log)


def refused_for_nvml(client: Any) -> str:
    """Ask for half a GPU; the 409's message (nothing may be created)."""
    with pytest.raises(GPUPoolError) as refused:
        client.create_lease(LeaseRequest(fraction=0.5))
    assert refused.value.status == 409, refused.value.to_json()
    return refused.value.message


def active(client: Any, lease_id: str) -> Any:
    lease = client.get_lease(lease_id, wait=30, state="starting")
    assert lease.state.value == "active", (lease.state, lease.reason)
    return lease
