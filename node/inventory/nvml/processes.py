"""The compute processes on the pool's GPUs, as NVML reports them.

``nvmlDeviceGetComputeRunningProcesses`` gives bytes per process (PIDs of the
host namespace, mapped by :mod:`gpupool.node.attribution`);
``nvmlDeviceGetProcessUtilization`` gives SM % (samples newer than the
last-seen timestamp, in microseconds; NotFound means no new sample, not an
error).
"""

from __future__ import annotations

from typing import Any

from ...attribution import GPUProcess, PidMapper
from .calls import GuardedNVML
from .devices import Device


class ProcessReader:
    """Reads the processes of a list of :class:`~.devices.Device`
    through ``calls``, mapping NVML's PIDs with ``pids``; remembers, per GPU,
    the newest utilization sample it has seen."""

    def __init__(self, calls: GuardedNVML, pids: PidMapper) -> None:
        self._calls, self._pids = calls, pids
        self._last_sample: dict[str, int] = {}  # pool UUID -> newest utilization timestamp (us)
        self.known: set[str] = set()

    def usage(self, devices: list[Device]) -> list[GPUProcess]:
        """Every compute process on ``devices`` but the lost ones (see
        :meth:`~.inventory.NVMLInventory.process_usage`); sets ``known`` to the
        UUIDs of the GPUs whose process list could be read."""
        found: list[tuple[str, Any, int | None]] = []
        self.known = set()
        for device in devices:
            uuid = device.info.uuid
            if device.parent in self._calls.lost:
                continue
            procs = self._calls.query(uuid, "processes", "nvmlDeviceGetComputeRunningProcesses", device.handle)
            if procs is None:
                continue
            self.known.add(uuid)
            samples = {} if device.mig else self.utilization(device)
            found.extend((uuid, proc, samples.get(proc.pid)) for proc in procs)
        local = self._pids.to_local({proc.pid for _uuid, proc, _sm in found})
        if found and self._pids.problem:
            self._calls.warn("all", "process PIDs", self._pids.problem)
        return [GPUProcess(uuid, int(proc.pid), local.get(proc.pid),
                           None if proc.usedGpuMemory is None else int(proc.usedGpuMemory), sm)
                for uuid, proc, sm in found]

    def utilization(self, device: Device) -> dict[int, int]:
        """NVML pid -> SM utilization (percent) of its newest sample since the
        last call for this GPU. NVML keeps a ring of samples; asking with the
        last-seen timestamp (microseconds) returns only newer ones, and
        ``NVMLError_NotFound`` when there is none (idle GPU), which is {}."""
        uuid = device.info.uuid
        samples = self._calls.query(uuid, "process utilization", "nvmlDeviceGetProcessUtilization", device.handle,
                                    self._last_sample.get(uuid, 0), quiet=("NotFound",))
        latest: dict[int, tuple[int, int]] = {}
        for sample in samples or ():
            stamp = int(sample.timeStamp)
            if sample.pid not in latest or stamp >= latest[sample.pid][0]:
                latest[sample.pid] = (stamp, int(sample.smUtil))
            self._last_sample[uuid] = max(self._last_sample.get(uuid, 0), stamp)
        return {pid: sm for pid, (_stamp, sm) in latest.items()}
