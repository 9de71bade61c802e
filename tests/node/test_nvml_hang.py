"""A GPU driver call that hangs is contained: the agent goes on
answering, the node is ``degraded``, and a release answers the user in time.

Real service and agent processes; the agent's NVML helper runs
:class:`fakenvml.ControlledNVML`, whose calls block while its control file
says ``hang`` (as a call stuck in a hung driver does). Before NVML moved
into a watched helper, the agent's event loop stopped in that call: it
answered nothing, the node went lost, and ``%gpu release`` gave up at the
client's 30 s while the service still waited for the worker to stop.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import psutil
import pytest

from fakenvml import hanging_pid, set_hang
from nvml_agents import REFUSED_FOR_NVML, active, node_in_state, refused_for_nvml, start_nvml_agent
from gpupool.demo_pool import processes_mentioning, wait_for
from workercell import run_worker_cell
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest
from procs import start_service
from service_api import register, silent_listener

def get(url: str, token: str | None = None) -> tuple[int, dict]:
    """``GET url``, with ``Authorization: token TOKEN`` when given; (status, JSON body)."""
    headers = {"Authorization": f"token {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
        return response.status, json.loads(response.read())


def answers_while_a_call_hangs(agent, control, token: str, lease_id: str) -> None:
    """``GET /health`` and ``GET /workers`` answered while an NVML call hangs in
    the agent's helper: asked once a call hangs, and that call still hangs
    after both answers (else the next hang is tried; helpers are replaced)."""
    for _ in range(20):
        pid = wait_for(lambda: hanging_pid(control), 60, "an NVML call hanging", agent.proc, agent.log)
        assert get(f"{agent.url}/health") == (200, {"status": "ok", "node": "gpu-node"})
        status, reply = get(f"{agent.url}/workers", token)
        assert status == 200 and [w["lease_id"] for w in reply["workers"]] == [lease_id]
        if hanging_pid(control) == pid:
            return
    pytest.fail("no answer came while an NVML call hung")


def test_a_hung_driver_call_leaves_the_agent_answering_the_node_degraded_and_release_in_time(tmp_path, service):
    control = tmp_path / "nvml.json"
    client = service.client()  # the magics' client: it gives up after 30 s
    agent = start_nvml_agent(tmp_path, service, control, extra=("--AgentInventory.nvml_timeout=1",))
    try:
        node_in_state(client, agent, "up")
        lease = active(client, client.create_lease(LeaseRequest(fraction=0.5)).id)
        pid = lease.worker["pid"]
        set_hang(control, True)  # the driver hangs: every NVML call blocks from now on
        answers_while_a_call_hangs(agent, control, service.agent_token, lease.id)
        node = node_in_state(client, agent, "degraded")
        assert node["state_reason"].startswith("the GPU driver stopped answering: "), node["state_reason"]
        assert [g["uuid"] for g in node["gpus"]] and all(g["memory_used"] is None for g in node["gpus"])
        message = refused_for_nvml(client)  # nothing new is placed on it
        assert REFUSED_FOR_NVML in message, message
        kept = client.get_lease(lease.id)
        assert kept.state is LeaseState.active and kept.node_state == "degraded"
        assert asyncio.run(run_worker_cell(kept.connection, "print(6 * 7)")).strip() == "42"
        released = client.release(lease.id, reason="done")  # within the client's 30 s
        assert released.state is LeaseState.released and released.reason == "released by its owner: done"
        wait_for(lambda: not psutil.pid_exists(pid), 30, "the worker gone")
        assert client.pool()["nodes"][0]["state"] == "degraded"  # heartbeats went on: never lost
        set_hang(control, False)
        node_in_state(client, agent, "up")
        second = active(client, client.create_lease(LeaseRequest(fraction=0.5)).id)
        assert client.release(second.id).state is LeaseState.released
        log = agent.log.read_text()
        assert log.count("this node reports it cannot read its GPUs") == 1, log
        assert log.count("the GPU driver answers again") == 1, log
    finally:
        set_hang(control, False)
        agent.stop()
    assert processes_mentioning(str(control)) == []  # every helper, hung ones too, ended with the agent


def test_release_on_a_node_that_does_not_answer_ends_within_the_stop_bound_and_says_so(tmp_path):
    svc = start_service(tmp_path, config={"worker_stop_timeout": 1, "node_ttl": 3600})
    try:
        with silent_listener() as silent:
            svc.silent_url = "http://127.0.0.1:%d" % silent.getsockname()[1]
            register(svc, "node-s", gpus=1)
            client = svc.client()
            held = client.create_lease(LeaseRequest(fraction=1.0))  # starting: its agent never answers
            released = client.release(held.id, reason="done")
            assert released.state is LeaseState.released
            assert released.reason == (
                f"released by its owner: done; its worker was not confirmed stopped (the node agent at "
                f"{svc.silent_url}/workers/{held.id} did not answer within 1s (Timeout during request)); "
                "the agent is told to stop it with its next heartbeat"), released.reason
            # its capacity is free again: the next request is placed there
            assert client.create_lease(LeaseRequest(fraction=1.0)).node == "node-s"
    finally:
        svc.stop()
