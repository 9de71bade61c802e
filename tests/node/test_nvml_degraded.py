"""A node whose agent cannot read its GPUs because NVML fails (GPU faults).

The agent keeps running and keeps its workers, reports ``inventory_error``,
and the service marks the node ``degraded``: its GPUs stay as last known,
its leases go on, nothing new is placed there; NVML is tried again with
exponential backoff, and once it works the node is ``up`` with its GPUs.

Real agent and service processes; only NVML is fake: the agent runs with
``pynvml`` replaced by :class:`fakenvml.ControlledNVML`, which raises the
real binding's error classes (``NVMLError_LibRmVersionMismatch``...) while
its control file says so.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import psutil
import pytest

from fakenvml import AGENT_GPUS, ControlledNVML, FakeGPU, FakeNVML, helper_command, set_error
from agent_api import call
from nvml_agents import NODE, REFUSED_FOR_NVML, active, node_in_state, refused_for_nvml, start_nvml_agent
from gpupool.hub_plugin.rules.reclaim import lost_nodes
from gpupool.demo_pool import AgentProcess, wait_for
from workercell import run_worker_cell
from gpupool.node.inventory import InventoryError, select_inventory
from gpupool.node.inventory.retrying import RetryingInventory, backoff_delay
from gpupool.node.inventory.nvml.inventory import NVMLInventory
from gpupool.wire.leases import LeaseRequest

MISMATCH_WORDS = "NVML could not start (RM has detected an NVML/RM version mismatch.)"
# -- helpers -------------------------------------------------------------------------------------------------

def retries_logged(agent: AgentProcess, at_least: int) -> None:
    """Wait until the agent has logged ``at_least`` failed NVML retries."""
    wait_for(lambda: agent.log.read_text().count("NVML still fails") >= at_least, 60, "NVML retries",
             agent.proc, agent.log)


# -- an agent restarted into a driver/library version mismatch -------------------------------------------------

def test_agent_restarted_into_a_version_mismatch_runs_degraded_then_registers_its_gpus(tmp_path, service):
    control = tmp_path / "nvml.json"
    client = service.client()
    agent = start_nvml_agent(tmp_path, service, control)
    try:
        node = node_in_state(client, agent, "up")
        assert [g["uuid"] for g in node["gpus"]] == list(AGENT_GPUS) and node["state_reason"] is None
        assert agent.stop() == 0
        # the driver is upgraded without a reboot: the library no longer matches the kernel module
        set_error(control, "LIB_RM_VERSION_MISMATCH")
        agent = start_nvml_agent(tmp_path, service, control, port=int(agent.url.rsplit(":", 1)[1]))
        node = node_in_state(client, agent, "degraded")
        assert node["state_reason"] == MISMATCH_WORDS and node["inventory"] == "nvml"
        # its GPUs are kept as last known, their readings unknown; none counts as free
        assert [g["uuid"] for g in node["gpus"]] == list(AGENT_GPUS)
        assert all(g["memory_used"] is None and g["utilization"] is None for g in node["gpus"])
        assert client.pool()["totals"]["free"] == 0
        message = refused_for_nvml(client)
        assert REFUSED_FOR_NVML in message, message
        assert client.list_leases(active=False) == []  # the refusal created nothing
        status = subprocess.run([sys.executable, "-m", "gpupool.cli", "status", f"--url={service.url}",
                                 f"--token={service.user_token}"], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert f"{NODE} is degraded: {MISMATCH_WORDS}; its leases go on, nothing new is placed there" in status.stdout
        # it keeps trying, warning once rather than at every retry
        retries_logged(agent, 2)
        set_error(control, None)
        node = node_in_state(client, agent, "up")
        assert node["state_reason"] is None and [g["uuid"] for g in node["gpus"]] == list(AGENT_GPUS)
        lease = active(client, client.create_lease(LeaseRequest(fraction=0.5)).id)
        assert lease.node == NODE and lease.gpus[0]["uuid"] in AGENT_GPUS
        client.release(lease.id)
        log = agent.log.read_text()
        assert log.count("this node reports it cannot read its GPUs") == 1, log
        assert log.count("NVML works again") == 1, log
    finally:
        agent.stop()


# -- NVML fails under a running agent with an active lease ----------------------------------------------------

def test_node_losing_nvml_mid_run_keeps_its_lease_and_worker_and_takes_nothing_new(tmp_path, service):
    control = tmp_path / "nvml.json"
    client = service.client()
    agent = start_nvml_agent(tmp_path, service, control)
    try:
        node_in_state(client, agent, "up")
        lease = active(client, client.create_lease(LeaseRequest(fraction=0.5)).id)
        pid = lease.worker["pid"]
        # the driver is unloaded under the running agent: every NVML call fails from now on
        set_error(control, "DRIVER_NOT_LOADED")
        node = node_in_state(client, agent, "degraded")
        assert node["state_reason"].startswith("NVML ") and "(Driver Not Loaded)" in node["state_reason"]
        retries_logged(agent, 2)  # several heartbeats and retries later...
        kept = client.get_lease(lease.id)
        assert kept.state.value == "active" and kept.node_state == "degraded" and psutil.pid_exists(pid)
        assert asyncio.run(run_worker_cell(kept.connection, "print(6 * 7)")).strip() == "42"
        message = refused_for_nvml(client)
        assert REFUSED_FOR_NVML in message, message
        # the agent itself refuses to start a worker while it cannot read its GPUs
        status, reply = call(f"{agent.url}/workers", "POST", {"lease_id": "L-000000000001", "owner": "tester",
                                                              "gpus": [AGENT_GPUS[1]], "fraction": 0.5},
                             service.agent_token)
        assert status == 503 and reply["error"] == "inventory_unavailable" and "Driver Not Loaded" in reply["message"]
        set_error(control, None)
        node = node_in_state(client, agent, "up")
        assert node["state_reason"] is None
        assert client.get_lease(lease.id).state.value == "active" and psutil.pid_exists(pid)
        second = active(client, client.create_lease(LeaseRequest(fraction=0.5)).id)
        assert second.node == NODE
        for held in (lease, second):
            assert client.release(held.id).state.value == "released"
        wait_for(lambda: not psutil.pid_exists(pid), 30, "the first lease's worker gone")
    finally:
        agent.stop()  # raises if a worker survived


# -- the service refuses bad inventory_error values and changes nothing ----------------------------------------

@pytest.mark.parametrize("bad", [5, "", "   ", "x" * 501, "broken\nline", ["NVML"]])
def test_bad_inventory_error_is_refused_and_changes_nothing(service, bad):
    token = service.agent_token
    body = {"name": "bad-node", "url": "http://127.0.0.1:9", "inventory": "nvml", "gpus": [],
            "inventory_error": bad}
    status, reply = call(f"{service.url}/api/v1/nodes", "POST", body, token)
    assert status == 400 and "'inventory_error' must be null or words" in reply["message"], reply
    assert service.client().pool()["nodes"] == []
    # a good registration, then a heartbeat with the bad value: the node stays as it was
    status, _ = call(f"{service.url}/api/v1/nodes", "POST", {**body, "inventory_error": "NVML could not start"}, token)
    assert status == 200
    status, reply = call(f"{service.url}/api/v1/nodes/bad-node/heartbeat", "POST", {"inventory_error": bad}, token)
    assert status == 400, reply
    (node,) = service.client().pool()["nodes"]
    assert (node["state"], node["state_reason"]) == ("degraded", "NVML could not start")


# -- the retry schedule (pure) and the inventory that follows it ------------------------------------------------

@pytest.mark.parametrize("failures, first, longest, delay", [
    (1, 5, 300, 5), (2, 5, 300, 10), (3, 5, 300, 20), (4, 5, 300, 40), (5, 5, 300, 80), (6, 5, 300, 160),
    (7, 5, 300, 300), (8, 5, 300, 300), (10_000, 5, 300, 300),
    (1, 0.2, 0.4, 0.2), (2, 0.2, 0.4, 0.4), (3, 0.2, 0.4, 0.4), (1, 10, 5, 5),
])
def test_backoff_doubles_from_first_to_longest(failures, first, longest, delay):
    assert backoff_delay(failures, first, longest) == delay


@pytest.mark.parametrize("failures, first", [(0, 5), (-1, 5), (1, 0), (1, -5)])
def test_backoff_refuses_what_has_no_schedule(failures, first):
    with pytest.raises(ValueError, match="backoff_delay needs"):
        backoff_delay(failures, first)


class Clock:
    """Monotonic seconds that a test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_retrying_inventory_follows_the_schedule_warns_once_and_resets_on_success(tmp_path, caplog):
    control = tmp_path / "nvml.json"
    set_error(control, "LIB_RM_VERSION_MISMATCH")
    fake = ControlledNVML([FakeGPU(AGENT_GPUS[0])], control)
    attempts: list[float] = []
    clock = Clock()

    def open_nvml() -> NVMLInventory:
        attempts.append(clock.now)
        return NVMLInventory(fake)

    with caplog.at_level(logging.DEBUG, "gpupool.agent"):
        inv = RetryingInventory(open_nvml, clock=clock)
        assert inv.error == MISMATCH_WORDS
        assert (inv.discover(), inv.metrics(), inv.process_usage(), inv.health()) == ([], [], [], {})
        for second in range(1, 700):
            clock.now = float(second)
            assert inv.refresh() is False
        assert attempts == [0, 5, 15, 35, 75, 155, 315, 615]  # waits 5, 10, 20, 40, 80, 160, 300 s
        set_error(control, None)
        clock.now = 915.0
        assert inv.refresh() is True
        assert inv.error is None and [g.uuid for g in inv.discover()] == [AGENT_GPUS[0]]
        # NVML stops answering under it: found at the next check, first retry 5 s later again
        set_error(control, "DRIVER_NOT_LOADED")
        assert inv.refresh() is False and inv.error == "NVML stopped working (Driver Not Loaded)"
        assert [g.uuid for g in inv.discover()] == [AGENT_GPUS[0]]  # last known
        clock.now = 919.0
        inv.refresh()
        assert attempts[-1] == 615 + 300
        clock.now = 920.0
        inv.refresh()
        assert attempts[-1] == 920.0 and inv.error == "NVML could not start (Driver Not Loaded)"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings  # failed, works again, failed again: not one per attempt
    assert "RM has detected an NVML/RM version mismatch" in warnings[0] and "--simulate" in warnings[0]
    assert warnings[1].startswith("NVML works again after 8 failed attempt(s)")
    inv.close()


def test_nvml_that_starts_but_cannot_read_a_gpu_is_still_failed_and_shut_down_again():
    gpu = FakeGPU(AGENT_GPUS[0], errors={"nvmlDeviceGetUUID": "UNKNOWN"})
    fake = FakeNVML([gpu], init_error="DRIVER_NOT_LOADED")
    clock = Clock()
    inv = RetryingInventory(lambda: NVMLInventory(fake), clock=clock)
    assert inv.error == "NVML could not start (Driver Not Loaded)"
    fake.init_error = None  # the driver loads, but the GPU does not answer yet
    clock.now = 5.0
    assert inv.refresh() is False
    assert inv.error == "NVML cannot read the UUID of GPU 0" and inv.discover() == [] and not fake.initialised
    gpu.errors.clear()
    clock.now = 15.0
    assert inv.refresh() is True and inv.error is None and [g.uuid for g in inv.discover()] == [AGENT_GPUS[0]]
    inv.close()
    assert not fake.initialised


def test_select_inventory_runs_degraded_where_nvml_may_heal_and_exits_where_it_cannot(tmp_path):
    control = tmp_path / "nvml.json"
    set_error(control, "DRIVER_NOT_LOADED")
    inv = select_inventory(None, "node-1", helper=helper_command(control))
    assert inv.kind == "nvml" and inv.error == "NVML could not start (Driver Not Loaded)" and inv.discover() == []
    inv.close()
    set_error(control, "LIBRARY_NOT_FOUND")
    with pytest.raises(InventoryError, match="--simulate"):  # no driver at all: pass --simulate
        select_inventory(None, "node-1", helper=helper_command(control))
    set_error(control, None)
    with pytest.raises(InventoryError, match="NVML found no GPU"):
        select_inventory(None, "node-1", helper=helper_command(control, ()))
    simulated = select_inventory("1xA100-80GB", "node-1")
    assert simulated.error is None and simulated.refresh() is False


def test_check_raises_a_retryable_error_with_nvmls_words(tmp_path):
    control = tmp_path / "nvml.json"
    inv = NVMLInventory(ControlledNVML([FakeGPU(AGENT_GPUS[0])], control))
    inv.check()  # NVML answers: nothing to say
    set_error(control, "LIB_RM_VERSION_MISMATCH")
    with pytest.raises(InventoryError) as info:
        inv.check()
    assert info.value.retryable
    assert info.value.reason == "NVML stopped working (RM has detected an NVML/RM version mismatch.)"


def test_a_degraded_node_is_alive_while_it_heartbeats_and_lost_when_it_stops():
    now = datetime(2026, 11, 29, 12, tzinfo=timezone.utc)
    beating = SimpleNamespace(name="a", state="degraded", last_heartbeat_at=now - timedelta(seconds=5))
    silent = SimpleNamespace(name="b", state="degraded", last_heartbeat_at=now - timedelta(seconds=60))
    assert lost_nodes([beating, silent], now, node_ttl=30) == ["b"]
