"""A new GPU inventory from tests/ alone: tests/support/inventory_demo.py, made known
by one entry point, is picked by name (``--inventory=demo``) by a real agent,
whose GPUs a real service then places leases on.

The entry point is registered the way an installed plugin package registers
it, with a ``*.dist-info/entry_points.txt`` on ``sys.path``; nothing in
gpupool names the inventory.
"""

from __future__ import annotations


import pytest
from traitlets import TraitError

from gpupool.node.inventory import InventoryError, available, inventory_class, select_inventory
from gpupool.node.inventory.simulated import SimulatedInventory
from gpupool.wire.leases import LeaseRequest
from plugins import install_plugin, use_plugin
from procs import start_agent, start_service

GROUP = "gpupool.inventory"


@pytest.fixture
def demo_plugin(tmp_path, monkeypatch):
    """``demo`` in the ``gpupool.inventory`` group, in this process and in its children."""
    yield from use_plugin(monkeypatch, install_plugin(tmp_path, GROUP, "demo = inventory_demo:DemoInventory"),
                          "inventory_demo")


def test_the_built_ins_and_auto_are_as_before():
    assert available() == ("nvml", "simulated")
    assert inventory_class("simulated") is SimulatedInventory
    assert isinstance(select_inventory("1xA100-80GB", "node-1"), SimulatedInventory)  # auto, with --simulate
    assert isinstance(select_inventory("1xA100-80GB", "node-1", source="simulated"), SimulatedInventory)
    with pytest.raises(InventoryError, match="none is set"):
        select_inventory(None, "node-1", source="simulated")
    with pytest.raises(InventoryError, match="drop one of them"):
        select_inventory("1xA100-80GB", "node-1", source="nvml")
    with pytest.raises(InventoryError, match="unknown inventory 'dcgm'; choose one of auto, nvml, simulated"):
        select_inventory(None, "node-1", source="dcgm")
    from gpupool.node.settings import AgentInventory

    with pytest.raises(TraitError, match=r"'inventory_source' .* any of \['auto', 'nvml', 'simulated'\], not 'dcgm'"):
        AgentInventory(inventory_source="dcgm")


def test_a_plugin_is_listed_and_selected_by_name(demo_plugin):
    from gpupool.node.settings import AgentInventory

    assert available() == ("nvml", "simulated", "demo")
    inventory = select_inventory(None, "node-7", source="demo")
    assert type(inventory).__name__ == "DemoInventory" and inventory.kind == "simulated"
    assert [g.name for g in inventory.discover()] == ["Demo GPU (node-7)"]
    assert AgentInventory(inventory_source="demo").inventory_source == "demo"
    help_text = " ".join(AgentInventory.class_traits()["inventory_source"].help.split())
    assert "one of auto, nvml, simulated" in help_text and "gpupool.inventory" in help_text


def test_an_entry_point_that_names_no_inventory_is_refused(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(install_plugin(tmp_path, GROUP, "broken = os.path:join")))
    with pytest.raises(InventoryError, match="names no Inventory subclass"):
        select_inventory(None, "node-1", source="broken")


def test_an_agent_reads_its_gpus_from_the_plugin_and_the_service_places_on_them(tmp_path, demo_plugin):
    service = start_service(tmp_path)  # knows nothing of the plugin: it places on what the node registers
    agent = start_agent(tmp_path, service, name="node-demo", simulate=None, extra_args=["--inventory=demo"])
    try:
        client = service.client()
        [node] = client.pool()["nodes"]
        assert node["name"] == "node-demo" and node["inventory"] == "simulated"
        [gpu] = node["gpus"]
        assert gpu["name"] == "Demo GPU (node-demo)"
        lease = client.get_lease(client.create_lease(LeaseRequest(fraction=0.5)).id, wait=60, state="starting")
        assert lease.state.value == "active" and lease.node == "node-demo"
        client.release(lease.id)
    finally:
        agent.stop()
        service.stop()
