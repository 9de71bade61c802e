"""The real GPU inventory, read through NVML (``nvidia-ml-py``, imported as
``pynvml``).

What it reads, with the NVML call (NVML API Reference Guide,
https://docs.nvidia.com/deploy/nvml-api/):

- GPUs: ``nvmlDeviceGetCount``/``GetHandleByIndex``, ``GetUUID``, ``GetName``,
  ``GetMemoryInfo`` (v2 where the driver has it: total, reserved, used, in
  bytes), ``GetCudaComputeCapability``.
- MIG: ``nvmlDeviceGetMigMode``; on a GPU with MIG enabled every MIG
  instance (``GetMaxMigDeviceCount``, ``GetMigDeviceHandleByIndex``; an
  empty slot answers NotFound) is a GPU of its own in the pool, with its own
  ``MIG-...`` UUID and memory; the parent is not offered (its memory belongs
  to its instances).
- Versions: ``nvmlSystemGetDriverVersion``, ``nvmlSystemGetCudaDriverVersion_v2``.
- Per process: ``nvmlDeviceGetComputeRunningProcesses`` (bytes; PIDs of the
  host namespace, mapped by :mod:`.attribution`) and
  ``nvmlDeviceGetProcessUtilization`` (SM %, samples newer than the last-seen
  timestamp, in microseconds; NotFound means no new sample, not an error).
- Device utilization: ``nvmlDeviceGetUtilizationRates`` (percent).
- Health: a query failing with ``NVMLError_GpuIsLost`` marks the GPU lost;
  critical Xid events (``nvmlEventTypeXidCriticalError``) are read without
  blocking on each :meth:`~NVMLInventory.health` call.

Each query is guarded on its own: a GPU that does not support one (e.g.
utilization of a MIG instance: ``NVMLError_NotSupported``) reports ``None``
(unknown, never 0) for that value, and the agent logs one warning per GPU and
metric, not one per heartbeat.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from gpupool.wire.nodes import GPUInfo

from .attribution import GPUProcess, PidMapper, memory_by_pid
from .inventory import Inventory, InventoryError

log = logging.getLogger("gpupool.agent")

_HINT = "pass --simulate=SPEC (for example --simulate=2xA100-80GB) to run this agent without GPUs"

# Xids that user code causes (bad memory access, kernel exceptions...), which
# do not make a GPU unhealthy. The same list as NVIDIA's k8s-device-plugin
# (internal/rm/health.go): 13 graphics engine exception, 31 GPU memory page
# fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video
# processor exception, 109 context switch timeout.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


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


class NVMLInventory(Inventory):
    """The GPUs NVML sees on this host.

    ``nvml``: the NVML binding to use (default: the ``pynvml`` module of
    nvidia-ml-py). ``pids``: how NVML's PIDs map to the agent's (default:
    :class:`~.attribution.PidMapper` with ``host_proc``).

    Initialises NVML on construction. Raises :class:`InventoryError` (telling
    to pass ``--simulate``, with NVML's own error text) when ``pynvml`` is not
    installed, the driver's library cannot be loaded, NVML does not start, or
    it finds no GPU; ``retryable`` when NVML failed to start or to list the
    GPUs for another reason than a missing library (see
    :class:`~.inventory_retry.RetryingInventory`).
    """

    kind = "nvml"

    def __init__(self, nvml: Any = None, *, host_proc: str | None = None, pids: PidMapper | None = None) -> None:
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                raise InventoryError(f"nvidia-ml-py is not installed (pip install 'gpupool[agent]'), or {_HINT}") from None
        self._nvml = nvml
        self._warned: set[tuple[str, str]] = set()
        self._lost: dict[str, str] = {}  # physical UUID -> why
        self._xids: dict[str, list[int]] = {}  # pool UUID -> critical Xids seen
        self._last_sample: dict[str, int] = {}  # pool UUID -> newest utilization timestamp (us)
        self._events: Any = None
        self._process_known: set[str] = set()
        self._pids = pids or PidMapper(host_proc)
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            # Without the driver's library this host has no NVIDIA driver at all;
            # any other failure (not loaded yet, a version mismatch after an
            # upgrade) may heal, so the agent keeps running and tries again.
            raise InventoryError(f"NVML could not start ({exc}): is the NVIDIA driver installed? Or {_HINT}",
                                 reason=f"NVML could not start ({exc})",
                                 retryable=not isinstance(exc, nvml.NVMLError_LibraryNotFound)) from None
        self._open = True
        try:
            count = nvml.nvmlDeviceGetCount()
            self._physical = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except nvml.NVMLError as exc:
            self.close()
            raise InventoryError(f"NVML could not list the GPUs ({exc}); {_HINT}",
                                 reason=f"NVML could not list the GPUs ({exc})", retryable=True) from None
        try:
            self._devices = self._enumerate()
        except InventoryError:
            self.close()
            raise
        if not self._devices:
            self.close()
            raise InventoryError(f"NVML found no GPU on this host; {_HINT}")
        self._watch_xids()

    # -- guarded queries ---------------------------------------------------------------------------------------

    def _call(self, device: str, metric: str, function: str, *args: Any, quiet: tuple = (),
              missing: Any = None) -> Any:
        """``nvml.<function>(*args)``, or ``missing`` (None) when it fails.

        ``device`` and ``metric`` name the value for the one warning logged per
        pair. Errors of the classes in ``quiet`` (by name, e.g. ``"NotFound"``)
        return None without a warning: they are expected answers there.
        ``NVMLError_GpuIsLost`` marks the device's GPU lost. A function the
        installed binding lacks counts as not supported.
        """
        nvml = self._nvml
        fn = getattr(nvml, function, None)
        if fn is None:
            self._warn(device, metric, f"the installed nvidia-ml-py has no {function}")
            return missing
        try:
            return fn(*args)
        except nvml.NVMLError as exc:
            if isinstance(exc, nvml.NVMLError_GpuIsLost):
                self._mark_lost(device, str(exc))
            if any(isinstance(exc, getattr(nvml, f"NVMLError_{name}")) for name in quiet):
                return missing
            self._warn(device, metric, str(exc))
            return missing

    def _warn(self, device: str, metric: str, why: str) -> None:
        if (device, metric) not in self._warned:
            self._warned.add((device, metric))
            log.warning("NVML cannot read the %s of GPU %s (%s); it is reported as unknown", metric, device, why)

    def _mark_lost(self, device: str, why: str) -> None:
        parent = next((d.parent for d in getattr(self, "_devices", ()) if d.info.uuid == device), device)
        if parent not in self._lost:
            log.error("GPU %s is lost (%s): marking it unhealthy; it needs a reset or a reboot", parent, why)
            self._lost[parent] = why

    # -- enumeration -------------------------------------------------------------------------------------------

    def _memory(self, device: str, handle: Any) -> Any:
        # v2 memory info (driver >= 510) separates the driver's reservation from
        # "used"; older drivers and some MIG handles only have v1.
        version = getattr(self._nvml, "nvmlMemory_v2", None)
        info = None
        if version is not None:
            info = self._call(device, "memory (v2)", "nvmlDeviceGetMemoryInfo", handle, version,
                              quiet=("NotSupported", "FunctionNotFound", "ArgumentVersionMismatch", "InvalidArgument"))
        return info if info is not None else self._call(device, "memory", "nvmlDeviceGetMemoryInfo", handle)

    def _enumerate(self) -> list[Device]:
        """Every GPU of the pool: whole GPUs, and the instances of MIG-enabled
        ones. Raises InventoryError when a GPU's UUID or memory is unreadable."""
        nvml = self._nvml
        devices: list[Device] = []
        for index, handle in enumerate(self._physical):
            key = f"{index}"
            uuid = self._call(key, "UUID", "nvmlDeviceGetUUID", handle)
            if not uuid:
                raise InventoryError(f"NVML cannot read the UUID of GPU {index}")
            uuid = _text(uuid)
            mode = self._call(uuid, "MIG mode", "nvmlDeviceGetMigMode", handle, quiet=("NotSupported",))
            capability = self._call(uuid, "compute capability", "nvmlDeviceGetCudaComputeCapability", handle)
            capability = f"{capability[0]}.{capability[1]}" if capability else None
            if mode is not None and mode[0] == nvml.NVML_DEVICE_MIG_ENABLE:
                instances = self._mig_instances(uuid, handle, capability, len(devices))
                if not instances:
                    log.warning("GPU %s has MIG enabled but no MIG instance: it offers nothing to the pool "
                                "(create instances with nvidia-smi mig -cgi ... -C)", uuid)
                devices.extend(instances)
                continue
            memory = self._memory(uuid, handle)
            if memory is None:
                raise InventoryError(f"NVML cannot read the memory of GPU {index} ({uuid})")
            name = _text(self._call(uuid, "name", "nvmlDeviceGetName", handle) or f"GPU {index}")
            devices.append(Device(GPUInfo(uuid=uuid, name=name, index=len(devices), memory_total=int(memory.total),
                                          memory_reserved=int(getattr(memory, "reserved", 0) or 0),
                                          compute_capability=capability), handle, uuid))
        return devices

    def _mig_instances(self, parent: str, handle: Any, capability: str | None, first: int) -> list[Device]:
        count = self._call(parent, "MIG device count", "nvmlDeviceGetMaxMigDeviceCount", handle) or 0
        found = []
        for slot in range(count):
            mig = self._call(parent, "MIG device", "nvmlDeviceGetMigDeviceHandleByIndex", handle, slot,
                             quiet=("NotFound",))  # an empty slot
            if mig is None:
                continue
            uuid = self._call(f"{parent}/MIG {slot}", "UUID", "nvmlDeviceGetUUID", mig)
            memory = self._memory(f"{parent}/MIG {slot}", mig) if uuid else None
            if not uuid or memory is None:
                raise InventoryError(f"NVML cannot read the UUID or memory of MIG instance {slot} of GPU {parent}")
            uuid = _text(uuid)
            name = _text(self._call(uuid, "name", "nvmlDeviceGetName", mig) or f"MIG {slot} of {parent}")
            found.append(Device(GPUInfo(uuid=uuid, name=name, index=first + len(found),
                                        memory_total=int(memory.total),
                                        memory_reserved=int(getattr(memory, "reserved", 0) or 0),
                                        compute_capability=capability), mig, parent, mig=True))
        return found

    def devices(self) -> list[Device]:
        """The pool's GPUs with their handles, as of the last :meth:`discover`."""
        return list(self._devices)

    # -- the Inventory contract --------------------------------------------------------------------------------

    def discover(self) -> list[GPUInfo]:
        """Every GPU of the pool (whole GPUs and MIG instances), enumerated
        again (MIG instances may have been created or destroyed). Raises
        InventoryError when a GPU's UUID or memory cannot be read."""
        self._devices = self._enumerate()
        return [device.info for device in self._devices]

    def check(self) -> None:
        """Raise a retryable :class:`InventoryError` when NVML stopped answering
        (its device count fails, as when the driver was unloaded or replaced
        under the running agent); per-GPU failures do not count (see
        :meth:`_call`)."""
        try:
            self._nvml.nvmlDeviceGetCount()
        except self._nvml.NVMLError as exc:
            raise InventoryError(f"NVML stopped working ({exc})", retryable=True) from None

    def versions(self) -> dict[str, str | None]:
        """``{"driver": "550.54.15", "cuda": "12.4"}``: the driver's version and
        the newest CUDA version it supports; None where unknown."""
        driver = self._call("system", "driver version", "nvmlSystemGetDriverVersion")
        cuda = self._call("system", "CUDA version", "nvmlSystemGetCudaDriverVersion_v2")
        return {"driver": None if driver is None else _text(driver),
                "cuda": None if cuda is None else f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}"}

    def metrics(self) -> list[dict[str, Any]]:
        """One reading per GPU: ``uuid``, ``memory_used`` (bytes), ``utilization``
        (percent), ``healthy`` (False for a lost GPU or after a critical Xid);
        ``None`` for what is unknown. A lost GPU is not queried any more."""
        health = self.health()
        result = []
        for device in self._devices:
            uuid = device.info.uuid
            reading: dict[str, Any] = {"uuid": uuid, "memory_used": None, "utilization": None}
            if device.parent not in self._lost:
                memory = self._memory(uuid, device.handle)
                reading["memory_used"] = None if memory is None else int(memory.used)
                # MIG instances have no utilization counters (NVML: not supported).
                rates = None if device.mig else self._call(uuid, "utilization", "nvmlDeviceGetUtilizationRates",
                                                           device.handle)
                reading["utilization"] = None if rates is None else int(rates.gpu)
            reading["healthy"] = health[uuid]["healthy"]
            result.append(reading)
        return result

    def health(self) -> dict[str, dict[str, Any]]:
        """GPU UUID -> ``{"healthy": bool, "reason": str | None, "xids": [int]}``.

        Unhealthy: the GPU is lost (``NVMLError_GpuIsLost``), or it reported a
        critical Xid other than :data:`APPLICATION_XIDS`. Both stay until the
        agent restarts, as in NVIDIA's k8s-device-plugin. Pending Xid events
        are read without waiting.
        """
        self._read_xids()
        result = {}
        for device in self._devices:
            uuid = device.info.uuid
            xids = self._xids.get(uuid, [])
            critical = [x for x in xids if x not in APPLICATION_XIDS]
            reason = None
            if device.parent in self._lost:
                reason = f"GPU lost: {self._lost[device.parent]}"
            elif critical:
                reason = f"Xid {critical[-1]}"
            result[uuid] = {"healthy": reason is None, "reason": reason, "xids": list(xids)}
        return result

    def process_usage(self) -> list[GPUProcess]:
        """Every compute process on every GPU: NVML's PID, the agent's PID
        (None when it maps to none, see :mod:`.attribution`), bytes (None when
        NVML cannot attribute memory, e.g. without permission to see another
        user's process) and the newest SM utilization sample in percent."""
        found: list[tuple[str, Any]] = []
        self._process_known = set()
        for device in self._devices:
            uuid = device.info.uuid
            if device.parent in self._lost:
                continue
            procs = self._call(uuid, "processes", "nvmlDeviceGetComputeRunningProcesses", device.handle)
            if procs is None:
                continue
            self._process_known.add(uuid)
            samples = {} if device.mig else self.process_utilization(device)
            found.extend((uuid, (proc, samples.get(proc.pid))) for proc in procs)
        local = self._pids.to_local({proc.pid for _uuid, (proc, _s) in found})
        if found and self._pids.problem:
            self._warn("all", "process PIDs", self._pids.problem)
        return [GPUProcess(uuid, int(proc.pid), local.get(proc.pid),
                           None if proc.usedGpuMemory is None else int(proc.usedGpuMemory), sm)
                for uuid, (proc, sm) in found]

    def process_known(self) -> set[str]:
        """UUIDs of the GPUs whose process list the last :meth:`process_usage` read."""
        return set(self._process_known)

    def process_utilization(self, device: Device) -> dict[int, int]:
        """NVML pid -> SM utilization (percent) of its newest sample since the
        last call for this GPU. NVML keeps a ring of samples; asking with the
        last-seen timestamp (microseconds) returns only newer ones, and
        ``NVMLError_NotFound`` when there is none (idle GPU), which is {}."""
        uuid = device.info.uuid
        samples = self._call(uuid, "process utilization", "nvmlDeviceGetProcessUtilization", device.handle,
                             self._last_sample.get(uuid, 0), quiet=("NotFound",))
        latest: dict[int, tuple[int, int]] = {}
        for sample in samples or ():
            stamp = int(sample.timeStamp)
            if sample.pid not in latest or stamp >= latest[sample.pid][0]:
                latest[sample.pid] = (stamp, int(sample.smUtil))
            self._last_sample[uuid] = max(self._last_sample.get(uuid, 0), stamp)
        return {pid: sm for pid, (_stamp, sm) in latest.items()}

    def process_memory(self) -> dict[int, int]:
        """GPU bytes per *local* pid (the agent's namespace), summed over all
        GPUs; processes that map to no local pid or whose memory NVML cannot
        attribute are absent."""
        return memory_by_pid(self.process_usage())

    # -- Xid events --------------------------------------------------------------------------------------------

    def _watch_xids(self) -> None:
        nvml = self._nvml
        kind = getattr(nvml, "nvmlEventTypeXidCriticalError", None)
        if kind is None:
            return
        events = self._call("system", "Xid events", "nvmlEventSetCreate")
        if events is None:
            return
        registered = [self._call(f"{index}", "Xid events", "nvmlDeviceRegisterEvents", handle, kind, events,
                                 missing=False) is not False for index, handle in enumerate(self._physical)]
        if any(registered):
            self._events = events
        else:
            self._call("system", "Xid events", "nvmlEventSetFree", events)

    def _read_xids(self) -> None:
        if self._events is None:
            return
        for _ in range(1000):  # bounded: a storm of events must not stall a heartbeat
            data = self._call("system", "Xid events", "nvmlEventSetWait", self._events, 0, quiet=("Timeout",))
            if data is None:
                return
            parent = _text(self._call("system", "Xid device", "nvmlDeviceGetUUID", data.device) or "")
            xid = int(data.eventData)
            # A MIG instance's event names its GPU instance; 0xFFFFFFFF (or no
            # instance) means the whole GPU.
            instance = getattr(data, "gpuInstanceId", None)
            hit = [d for d in self._devices if d.parent == parent]
            if any(d.mig for d in hit) and instance not in (None, 0xFFFFFFFF):
                ids = {d.info.uuid: self._call(d.info.uuid, "GPU instance id", "nvmlDeviceGetGpuInstanceId", d.handle)
                       for d in hit}
                hit = [d for d in hit if ids[d.info.uuid] == instance] or hit
            level = logging.INFO if xid in APPLICATION_XIDS else logging.ERROR
            log.log(level, "Xid %d on GPU %s%s", xid, parent,
                    "" if xid in APPLICATION_XIDS else ": marking it unhealthy")
            for device in hit:
                self._xids.setdefault(device.info.uuid, []).append(xid)

    def close(self) -> None:
        """Free the Xid event set and shut NVML down. Idempotent; quiet when
        NVML already stopped answering (what :meth:`check` found)."""
        if getattr(self, "_open", False):
            self._open = False
            if self._events is not None:
                self._quietly("nvmlEventSetFree", self._events)
                self._events = None
            self._quietly("nvmlShutdown")

    def _quietly(self, function: str, *args: Any) -> None:
        try:
            getattr(self._nvml, function)(*args)
        except self._nvml.NVMLError:
            pass  # closing a session the driver already dropped: nothing left to free


def _text(value: str | bytes) -> str:
    # nvidia-ml-py < 11.515 returned bytes.
    return value.decode() if isinstance(value, bytes) else value
