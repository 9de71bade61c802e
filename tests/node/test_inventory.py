"""The simulated GPU inventory and the inventory lookup."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpupool.demo_pool import free_port

from gpupool.node.inventory import InventoryError, select_inventory
from gpupool.node.inventory.simulated import MODELS, SimulatedInventory, parse_spec, simulated_uuid
from gpupool.wire.nodes import GPUInfo

MiB = 1024**2
NVML_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@pytest.mark.parametrize("spec, names", [
    ("2xA100-80GB", ["NVIDIA A100-SXM4-80GB"] * 2),
    ("A100-40GB", ["NVIDIA A100-SXM4-40GB"]),
    ("1xH100-80GB,2xL4-24GB", ["NVIDIA H100 80GB HBM3", "NVIDIA L4", "NVIDIA L4"]),
    (" 2 x a100-80gb , t4 ", ["NVIDIA A100-SXM4-80GB"] * 2 + ["Tesla T4"]),
    ("H200,V100", ["NVIDIA H200", "Tesla V100-SXM2-32GB"]),
])
def test_spec_lists_gpus_in_order(spec, names):
    gpus = SimulatedInventory(spec, "node-1").discover()
    assert [g.name for g in gpus] == names
    assert [g.index for g in gpus] == list(range(len(names)))


def test_gpus_look_like_nvml_reports():
    a100, l4 = SimulatedInventory("1xA100-80GB,1xL4-24GB", "node-1").discover()
    assert a100.memory_total == 81920 * MiB
    assert l4.memory_total == 23034 * MiB
    assert a100.compute_capability == "8.0" and l4.compute_capability == "8.9"
    for gpu in (a100, l4):
        assert NVML_UUID.match(gpu.uuid)
        assert 100 * MiB <= gpu.memory_reserved <= 1024 * MiB  # a few hundred MiB, as drivers reserve
        assert GPUInfo.from_json(gpu.to_json()) == gpu  # valid for the service's schema


def test_model_table_matches_nvml_names():
    assert {m.name: m.memory_mib for m in MODELS.values()} == {
        "NVIDIA A100-SXM4-80GB": 81920, "NVIDIA A100-SXM4-40GB": 40960, "NVIDIA H100 80GB HBM3": 81559,
        "NVIDIA H200": 143771, "NVIDIA L4": 23034, "Tesla T4": 15360, "Tesla V100-SXM2-32GB": 32768}


def test_uuids_are_stable_per_node_and_index():
    first = SimulatedInventory("2xA100-80GB", "node-1").discover()
    again = SimulatedInventory("2xA100-80GB", "node-1").discover()
    other = SimulatedInventory("2xA100-80GB", "node-2").discover()
    assert [g.uuid for g in first] == [g.uuid for g in again]
    assert len({g.uuid for g in first + other}) == 4
    assert first[1].uuid == simulated_uuid("node-1", 1)


def test_simulated_metrics_read_simulated_memory_and_leave_utilization_unknown(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUPOOL_SIMGPU_ROOT", str(tmp_path))
    inventory = SimulatedInventory("2xA100-80GB", "node-1")
    assert inventory.kind == "simulated"
    assert inventory.metrics() == [{"uuid": g.uuid, "memory_used": 0, "utilization": None}
                                   for g in inventory.discover()]
    assert inventory.process_memory() == {} and inventory.process_usage() == []


@pytest.mark.parametrize("spec, words", [
    ("", "empty GPU spec"),
    ("2xB200", "unknown GPU model 'B200'; known models: A100-80GB"),
    ("A100", "unknown GPU model 'A100'"),  # ambiguous: 40 or 80 GB
    ("0xA100-80GB", "at least 1"),
    ("-1xA100-80GB", "GPU count must be at least 1 in '-1xA100-80GB'"),  # as --simulate=-1x... gives it
    ("2x", "unknown GPU model '2x'"),
    ("2xT4 extra", "cannot read '2xT4 extra'"),
    ("2xA100-80GB,,T4", "cannot read ''"),
    ("65xT4", "more than 64 GPUs"),
])
def test_bad_specs_say_what_is_wrong(spec, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_spec(spec)


@pytest.mark.parametrize("args", [["--simulate=-1xA100-80GB"], ["--simulate", "-1xA100-80GB"]], ids=["equals", "spaced"])
def test_a_negative_count_on_the_agents_command_line_says_what_is_wrong(args, tmp_path):
    """With a space as with '=': argparse (under traitlets) took '-1xA100-80GB' for an option and
    said 'expected one argument'."""
    env = {**os.environ, "GPUPOOL_AGENT_TOKEN": "agent-token-" + "0" * 16}
    argv = [str(Path(sys.executable).with_name("gpupool")), "agent", f"--service-url=http://127.0.0.1:{free_port()}",
            f"--state-dir={tmp_path}", *args]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "gpupool agent: bad --simulate value: GPU count must be at least 1 in '-1xA100-80GB'"), done.stderr


def test_the_agents_help_still_lists_simulate():
    shown = subprocess.run([str(Path(sys.executable).with_name("gpupool")), "agent", "--help"],
                           capture_output=True, text=True, timeout=60).stdout
    assert "--simulate=<Unicode>" in shown and "AgentInventory.simulate" in shown, shown


def test_select_inventory_simulated_and_bad_spec():
    inventory = select_inventory("2xA100-80GB", "node-1")
    assert isinstance(inventory, SimulatedInventory)
    assert inventory.node_name == "node-1"
    with pytest.raises(InventoryError, match="bad --simulate value: unknown GPU model 'X1'"):
        select_inventory("X1", "node-1")


def test_without_simulate_and_without_nvml_the_error_names_the_fix():
    try:
        inventory = select_inventory(None, "node-1")
    except InventoryError as exc:
        assert "--simulate" in exc.message
        assert exc.to_json()["error"] == "no_inventory"
    else:  # a host with a GPU and a driver
        assert inventory.kind == "nvml" and inventory.discover()
        inventory.close()
