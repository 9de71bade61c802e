"""The pool's GPUs as NVML lists them: whole GPUs, and the instances of
MIG-enabled ones.

On a GPU with MIG enabled (``nvmlDeviceGetMigMode``) every MIG instance
(``GetMaxMigDeviceCount``, ``GetMigDeviceHandleByIndex``; an empty slot
answers NotFound) is a GPU of its own in the pool, with its own ``MIG-...``
UUID and memory; the parent is not offered (its memory belongs to its
instances).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from gpupool.wire.nodes import GPUInfo

from ..base import InventoryError
from .calls import GuardedNVML, text

log = logging.getLogger("gpupool.agent")


@dataclass
class Device:
    """One GPU of the pool as NVML sees it: ``info`` (what the agent
    registers), the NVML ``handle`` to query, the physical GPU's UUID
    (``parent``; its own UUID for a whole GPU), and ``mig``: whether it is a
    MIG instance."""

    info: GPUInfo
    handle: Any
    parent: str
    mig: bool = False


def enumerate_devices(calls: GuardedNVML, physical: list[Any]) -> list[Device]:
    """Every GPU of the pool on the physical GPUs' handles ``physical``, indexed
    in that order. Raises InventoryError when a GPU's UUID or memory is unreadable."""
    devices: list[Device] = []
    for index, handle in enumerate(physical):
        uuid = calls.query(f"{index}", "UUID", "nvmlDeviceGetUUID", handle)
        if not uuid:
            raise InventoryError(f"NVML cannot read the UUID of GPU {index}")
        uuid = text(uuid)
        mode = calls.query(uuid, "MIG mode", "nvmlDeviceGetMigMode", handle, quiet=("NotSupported",))
        capability = calls.query(uuid, "compute capability", "nvmlDeviceGetCudaComputeCapability", handle)
        capability = f"{capability[0]}.{capability[1]}" if capability else None
        if mode is not None and mode[0] == calls.nvml.NVML_DEVICE_MIG_ENABLE:
            instances = _mig_instances(calls, uuid, handle, capability, len(devices))
            if not instances:
                log.warning("GPU %s has MIG enabled but no MIG instance: it offers nothing to the pool "
                            "(create instances with nvidia-smi mig -cgi ... -C)", uuid)
            devices.extend(instances)
            continue
        memory = calls.memory(uuid, handle)
        if memory is None:
            raise InventoryError(f"NVML cannot read the memory of GPU {index} ({uuid})")
        name = text(calls.query(uuid, "name", "nvmlDeviceGetName", handle) or f"GPU {index}")
        devices.append(Device(_info(uuid, name, len(devices), memory, capability), handle, uuid))
    return devices


def _mig_instances(calls: GuardedNVML, parent: str, handle: Any, capability: str | None,
                   first: int) -> list[Device]:
    count = calls.query(parent, "MIG device count", "nvmlDeviceGetMaxMigDeviceCount", handle) or 0
    found = []
    for slot in range(count):
        mig = calls.query(parent, "MIG device", "nvmlDeviceGetMigDeviceHandleByIndex", handle, slot,
                          quiet=("NotFound",))  # an empty slot
        if mig is None:
            continue
        uuid = calls.query(f"{parent}/MIG {slot}", "UUID", "nvmlDeviceGetUUID", mig)
        memory = calls.memory(f"{parent}/MIG {slot}", mig) if uuid else None
        if not uuid or memory is None:
            raise InventoryError(f"NVML cannot read the UUID or memory of MIG instance {slot} of GPU {parent}")
        uuid = text(uuid)
        name = text(calls.query(uuid, "name", "nvmlDeviceGetName", mig) or f"MIG {slot} of {parent}")
        found.append(Device(_info(uuid, name, first + len(found), memory, capability), mig, parent, mig=True))
    return found


def _info(uuid: str, name: str, index: int, memory: Any, capability: str | None) -> GPUInfo:
    return GPUInfo(uuid=uuid, name=name, index=index, memory_total=int(memory.total),
                   memory_reserved=int(getattr(memory, "reserved", 0) or 0), compute_capability=capability)
