"""A new enforcement mode from tests/ alone: tests/support/enforcement_demo.py, made
known by one entry point, runs end to end in a real service and agent.

The entry point is registered the way an installed plugin package registers
it, with a ``*.dist-info/entry_points.txt`` on the agent's ``sys.path``;
nothing in gpupool names the mode, and the service never sees the plugin.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from gpupool.errors import GPUPoolError
from gpupool.wire.leases import LeaseRequest
from plugins import children_path, install_plugin
from procs import start_agent, start_service
from workercell import run_worker_cell

def test_a_plugin_mode_places_whole_gpu_leases_and_shapes_the_worker(tmp_path, monkeypatch):
    service = start_service(tmp_path)  # knows nothing of the plugin: it places by what the node registers
    site = install_plugin(tmp_path, "gpupool.enforcement", "demo = enforcement_demo:Demo")
    monkeypatch.setenv("PYTHONPATH", children_path(site))  # the agent's sys.path
    agent = start_agent(tmp_path, service, name="node-demo", simulate="1xA100-80GB",
                        extra_args=["--enforcement=demo"])
    try:
        client = service.client()
        [node] = client.pool()["nodes"]
        assert node["name"] == "node-demo" and node["enforcement"] == "demo"

        # its capacity rule, reported at registration: whole GPUs only
        with pytest.raises(GPUPoolError) as refused:
            client.create_lease(LeaseRequest(fraction=0.5))
        assert refused.value.code == "pool_full"
        assert list(refused.value.extra["reasons"]) == [
            "whole GPUs only on its node (its enforcement mode does not share a GPU)"]

        lease = client.get_lease(client.create_lease(LeaseRequest(fraction=1.0)).id, wait=60, state="starting")
        assert lease.state.value == "active" and lease.node == "node-demo"
        env = json.loads(asyncio.run(run_worker_cell(lease.connection,
                                                     "import os, json; print(json.dumps(dict(os.environ)))")))
        assert env["DEMO_ENFORCEMENT"] == f"node-demo/{lease.id}"
        assert env["GPUPOOL_LEASE_ID"] == lease.id
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env  # MPS variables come from the mps mode only
        client.release(lease.id)
    finally:
        agent.stop()
        service.stop()
