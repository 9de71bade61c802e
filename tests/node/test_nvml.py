"""The NVML inventory, driven through a fake ``pynvml`` at the NVML boundary."""

from __future__ import annotations

import inspect
import logging
import os
import re

import psutil
import pynvml
import pytest

from fakenvml import FakeEvent, FakeGPU, FakeNVML, FakeProcess, FakeSample, fake_functions, helper_command
from gpupool.node.attribution import PidMapper
from gpupool.node.inventory import InventoryError, select_inventory
from gpupool.node.inventory.nvml import calls as nvml_calls, devices as nvml_devices, events as nvml_events
from gpupool.node.inventory.nvml import inventory as nvml, processes as nvml_processes
from gpupool.node.inventory.nvml.inventory import NVMLInventory
from gpupool.node.inventory.nvml.watch import WatchedInventory
from gpupool.wire.nodes import GPUInfo

MiB = 1024**2
GiB = 1024**3
U0 = "GPU-11111111-2222-3333-4444-555555555555"
U1 = "GPU-66666666-7777-8888-9999-000000000000"
MIG_A = "MIG-aaaaaaaa-0000-0000-0000-000000000001"
MIG_B = "MIG-bbbbbbbb-0000-0000-0000-000000000002"


class IdentityPids(PidMapper):
    """NVML's pids are the agent's (an agent in the host PID namespace)."""

    def __init__(self) -> None:
        super().__init__(host_namespace=True)

    def to_local(self, pids):
        return {pid: pid for pid in pids}


def inventory(nvml: FakeNVML) -> NVMLInventory:
    return NVMLInventory(nvml, pids=IdentityPids())


# -- the fake keeps to the real binding ------------------------------------------------------------------------

def test_fake_functions_exist_in_real_pynvml_with_the_same_parameters():
    for name in fake_functions():
        real = getattr(pynvml, name, None)
        assert callable(real), f"pynvml has no {name}"
        fake_params = list(inspect.signature(getattr(FakeNVML, name)).parameters)[1:]  # without self
        assert fake_params == list(inspect.signature(real).parameters), name


def test_fake_raises_the_real_exception_classes():
    fake = FakeNVML([], init_error="DRIVER_NOT_LOADED")
    for name in ("NVMLError", "NVMLError_NotSupported", "NVMLError_NotFound", "NVMLError_GpuIsLost",
                 "NVMLError_Uninitialized", "NVMLError_DriverNotLoaded", "NVMLError_LibraryNotFound",
                 "NVMLError_Timeout", "NVMLError_NoPermission"):
        assert getattr(fake, name) is getattr(pynvml, name)
    assert fake.nvmlMemory_v2 == pynvml.nvmlMemory_v2
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        fake.nvmlInit()


def test_production_code_uses_only_names_of_the_real_binding_and_the_fake_covers_them():
    source = "".join(inspect.getsource(module) for module in (nvml, nvml_calls, nvml_devices, nvml_events,
                                                              nvml_processes))
    used = set(re.findall(r'"(nvml[A-Za-z0-9_]+)"', source))
    assert "nvmlDeviceGetComputeRunningProcesses" in used
    for name in used:
        assert hasattr(pynvml, name), f"the NVML inventory uses {name}, which pynvml lacks"
    assert {n for n in used if callable(getattr(pynvml, n))} <= set(fake_functions())


# -- inventory -------------------------------------------------------------------------------------------------

def test_two_whole_gpus_with_versions():
    fake = FakeNVML([FakeGPU(U0), FakeGPU(U1, name="NVIDIA H100 80GB HBM3", memory_total=81559 * MiB,
                                          memory_reserved=533 * MiB, capability=(9, 0))])
    inv = inventory(fake)
    assert inv.kind == "nvml"
    assert inv.discover() == [
        GPUInfo(U0, "NVIDIA A100-SXM4-80GB", 0, 81920 * MiB, 609 * MiB, "8.0"),
        GPUInfo(U1, "NVIDIA H100 80GB HBM3", 1, 81559 * MiB, 533 * MiB, "9.0")]
    assert inv.versions() == {"driver": "550.54.15", "cuda": "12.4"}
    inv.close()
    assert not fake.initialised
    inv.close()  # idempotent


def test_mig_instances_are_gpus_of_their_own_and_empty_slots_are_skipped():
    a = FakeGPU(MIG_A, name="NVIDIA A100-SXM4-80GB MIG 3g.40gb", memory_total=40192 * MiB, memory_reserved=0,
                gpu_instance_id=1, unsupported={"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetProcessUtilization"})
    b = FakeGPU(MIG_B, name="NVIDIA A100-SXM4-80GB MIG 2g.20gb", memory_total=19968 * MiB, memory_reserved=0,
                gpu_instance_id=2)
    fake = FakeNVML([FakeGPU(U0, mig=[a, None, b]), FakeGPU(U1)])
    inv = inventory(fake)
    gpus = inv.discover()
    assert [(g.uuid, g.index, g.memory_total) for g in gpus] == [
        (MIG_A, 0, 40192 * MiB), (MIG_B, 1, 19968 * MiB), (U1, 2, 81920 * MiB)]
    assert gpus[0].compute_capability == "8.0"  # the parent's
    assert U0 not in {g.uuid for g in gpus}  # the parent's memory belongs to its instances
    a.memory_used = 5 * GiB
    readings = {r["uuid"]: r for r in inv.metrics()}
    assert readings[MIG_A] == {"uuid": MIG_A, "memory_used": 5 * GiB, "utilization": None, "healthy": True}
    assert fake.calls.get("nvmlDeviceGetUtilizationRates") == 1  # never asked of a MIG instance


def test_mig_enabled_without_instances_offers_nothing(caplog):
    inv_fake = FakeNVML([FakeGPU(U0, mig=[None, None]), FakeGPU(U1)])
    with caplog.at_level(logging.WARNING, "gpupool.agent"):
        assert [g.uuid for g in inventory(inv_fake).discover()] == [U1]
    assert "MIG enabled but no MIG instance" in caplog.text


def test_unsupported_queries_are_unknown_and_warn_once_per_gpu_and_metric(caplog):
    gpu = FakeGPU(U0, unsupported={"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetCudaComputeCapability",
                                   "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMigMode"}, memory_used=GiB)
    fake = FakeNVML([gpu])
    with caplog.at_level(logging.WARNING, "gpupool.agent"):
        inv = inventory(fake)
        (info,) = inv.discover()
        for _ in range(3):
            assert inv.metrics() == [{"uuid": U0, "memory_used": GiB, "utilization": None, "healthy": True}]
    assert info.compute_capability is None and info.memory_reserved == 0  # v1 memory has no reservation
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("utilization of GPU" in w for w in warnings) == 1
    assert sum("compute capability" in w for w in warnings) == 1
    assert not any("MIG mode" in w or "memory" in w for w in warnings)  # expected answers: no warning
    assert "Not Supported" in warnings[0] or "Not Supported" in warnings[1]


def test_processes_and_utilization_samples_with_last_seen_timestamp():
    gpu = FakeGPU(U0, processes=[FakeProcess(101, 3 * GiB), FakeProcess(202, None)],
                  samples=[FakeSample(101, 1_000, 40), FakeSample(101, 2_000, 60), FakeSample(202, 1_500, 5)])
    fake = FakeNVML([gpu])
    inv = inventory(fake)
    usage = inv.process_usage()
    assert [(p.gpu, p.pid, p.local_pid, p.memory, p.sm_util) for p in usage] == [
        (U0, 101, 101, 3 * GiB, 60), (U0, 202, 202, None, 5)]
    assert inv.process_memory() == {101: 3 * GiB}  # unknown amounts are absent, not 0
    assert inv.process_known() == {U0}
    # the next call asks only for samples newer than 2000 us: NVML answers NotFound, which is "no sample"
    assert [p.sm_util for p in inv.process_usage()] == [None, None]
    gpu.samples.append(FakeSample(202, 3_000, 90))
    assert [p.sm_util for p in inv.process_usage()] == [None, 90]


def test_not_found_samples_do_not_warn(caplog):
    fake = FakeNVML([FakeGPU(U0, processes=[FakeProcess(7, GiB)])])
    with caplog.at_level(logging.WARNING, "gpupool.agent"):
        inv = inventory(fake)
        inv.process_usage()
        inv.process_usage()
    assert caplog.records == []


def test_process_list_unsupported_is_unknown():
    fake = FakeNVML([FakeGPU(U0, unsupported={"nvmlDeviceGetComputeRunningProcesses"})])
    inv = inventory(fake)
    assert inv.process_usage() == [] and inv.process_known() == set()


def test_lost_gpu_is_unhealthy_and_no_longer_queried(caplog):
    lost = FakeGPU(U1)
    fake = FakeNVML([FakeGPU(U0), lost])
    inv = inventory(fake)
    lost.lost = True
    with caplog.at_level(logging.ERROR, "gpupool.agent"):
        first = inv.metrics()
    assert first[1]["memory_used"] is None and first[1]["utilization"] is None
    # the first query that meets the loss marks it; from the next heartbeat on it reads unhealthy
    calls = dict(fake.calls)
    second = inv.metrics()
    assert second[1] == {"uuid": U1, "memory_used": None, "utilization": None, "healthy": False}
    assert second[0]["healthy"] is True
    assert fake.calls.get("nvmlDeviceGetMemoryInfo") == calls.get("nvmlDeviceGetMemoryInfo") + 1  # only GPU 0
    assert inv.health()[U1]["reason"].startswith("GPU lost")
    assert "GPU " + U1 + " is lost" in caplog.text


def test_critical_xid_marks_unhealthy_application_xid_does_not():
    gpu0, gpu1 = FakeGPU(U0), FakeGPU(U1)
    fake = FakeNVML([gpu0, gpu1])
    inv = inventory(fake)
    fake.events += [FakeEvent(gpu0, pynvml.nvmlEventTypeXidCriticalError, 13),
                    FakeEvent(gpu1, pynvml.nvmlEventTypeXidCriticalError, 79)]
    health = inv.health()
    assert health[U0] == {"healthy": True, "reason": None, "xids": [13]}
    assert health[U1] == {"healthy": False, "reason": "Xid 79", "xids": [79]}
    assert [r["healthy"] for r in inv.metrics()] == [True, False]


def test_xid_on_a_mig_instance_marks_only_that_instance():
    a, b = FakeGPU(MIG_A, gpu_instance_id=1), FakeGPU(MIG_B, gpu_instance_id=2)
    parent = FakeGPU(U0, mig=[a, b])
    fake = FakeNVML([parent])
    inv = inventory(fake)
    fake.events.append(FakeEvent(parent, pynvml.nvmlEventTypeXidCriticalError, 48, gpuInstanceId=2))
    assert {u: h["healthy"] for u, h in inv.health().items()} == {MIG_A: True, MIG_B: False}


@pytest.mark.parametrize("error", ["DRIVER_NOT_LOADED", "LIBRARY_NOT_FOUND", "NO_PERMISSION"])
def test_initialisation_failure_names_nvml_error_and_the_fix(error):
    with pytest.raises(InventoryError) as info:
        NVMLInventory(FakeNVML([], init_error=error))
    text = str(pynvml.NVMLError(getattr(pynvml, f"NVML_ERROR_{error}")))
    assert f"NVML could not start ({text})" in info.value.message and "--simulate" in info.value.message


def test_no_gpu_and_unreadable_uuid_are_refused():
    with pytest.raises(InventoryError, match="NVML found no GPU"):
        NVMLInventory(FakeNVML([]))
    fake = FakeNVML([FakeGPU(U0, errors={"nvmlDeviceGetUUID": "UNKNOWN"})])
    with pytest.raises(InventoryError, match="cannot read the UUID of GPU 0"):
        NVMLInventory(fake)
    assert not fake.initialised  # shut down again


def test_select_inventory_reads_the_pynvml_module_in_a_helper_process(tmp_path):
    inv = select_inventory(None, "node-1", helper=helper_command(tmp_path / "nvml.json", (U0,)))
    assert isinstance(inv, WatchedInventory) and inv.helper_pid != os.getpid()
    assert inv.kind == "nvml" and inv.error is None and [g.uuid for g in inv.discover()] == [U0]
    helper = inv.helper_pid
    inv.close()
    assert inv.helper_pid is None and not psutil.pid_exists(helper)


def test_processes_in_another_pid_namespace_map_through_the_mapper():
    class Container(PidMapper):
        def __init__(self) -> None:
            super().__init__(host_namespace=True)

        def to_local(self, pids):  # host pid 5001 is the agent's pid 42; 6001 is a foreign container's
            return {5001: 42} if 5001 in set(pids) else {}

    fake = FakeNVML([FakeGPU(U0, processes=[FakeProcess(5001, GiB), FakeProcess(6001, 2 * GiB)])])
    inv = NVMLInventory(fake, pids=Container())
    assert [(p.pid, p.local_pid) for p in inv.process_usage()] == [(5001, 42), (6001, None)]
    assert inv.process_memory() == {42: GiB}
