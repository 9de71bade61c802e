"""The real GPU inventory, read through NVML (``nvidia-ml-py``, imported as
``pynvml``): GPUs and MIG instances, versions, per-process memory and SM use,
utilization and health. Its parts: the guarded calls (:mod:`.calls`), the
enumeration (:mod:`.devices`), the processes (:mod:`.processes`) and the Xid
events (:mod:`.events`). Each NVML call it makes: docs/code.md, "NVML: what it reads".
"""

from __future__ import annotations

from typing import Any

from gpupool.wire.nodes import GPUInfo

from ...attribution import GPUProcess, PidMapper, memory_by_pid
from ..base import Inventory, InventoryError
from .calls import GuardedNVML, text
from .devices import Device, enumerate_devices
from .events import APPLICATION_XIDS, XidEvents
from .processes import ProcessReader

_HINT = "pass --simulate=SPEC (for example --simulate=2xA100-80GB) to run this agent without GPUs"


class NVMLInventory(Inventory):
    """The GPUs NVML sees on this host.

    ``nvml``: the NVML binding to use (default: the ``pynvml`` module of
    nvidia-ml-py). ``pids``: how NVML's PIDs map to the agent's (default:
    :class:`~gpupool.node.attribution.PidMapper` with ``host_proc``).

    Initialises NVML on construction. Raises :class:`InventoryError` (telling
    to pass ``--simulate``, with NVML's own error text) when ``pynvml`` is not
    installed, the driver's library cannot be loaded, NVML does not start, or
    it finds no GPU; ``retryable`` when NVML failed to start or to list the
    GPUs for another reason than a missing library (see
    :class:`~gpupool.node.inventory.retrying.RetryingInventory`).
    """

    kind = "nvml"

    def __init__(self, nvml: Any = None, *, host_proc: str | None = None, pids: PidMapper | None = None) -> None:
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                raise InventoryError(f"nvidia-ml-py is not installed (pip install 'gpupool[agent]'), or {_HINT}") from None
        self._nvml = nvml
        self._calls = GuardedNVML(nvml)
        self._processes = ProcessReader(self._calls, pids or PidMapper(host_proc))
        self._events: XidEvents | None = None  # once the GPUs are listed
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
            self._enumerate()
        except InventoryError:
            self.close()
            raise
        if not self._devices:
            self.close()
            raise InventoryError(f"NVML found no GPU on this host; {_HINT}")
        self._events = XidEvents(self._calls, self._physical)

    def _enumerate(self) -> None:
        self._devices = enumerate_devices(self._calls, self._physical)
        self._calls.parents = {device.info.uuid: device.parent for device in self._devices}

    def devices(self) -> list[Device]:
        """The pool's GPUs with their handles, as of the last :meth:`discover`."""
        return list(self._devices)

    # -- the Inventory contract --------------------------------------------------------------------------------

    def discover(self) -> list[GPUInfo]:
        """Every GPU of the pool (whole GPUs and MIG instances), enumerated
        again (MIG instances may have been created or destroyed). Raises
        InventoryError when a GPU's UUID or memory cannot be read."""
        self._enumerate()
        return [device.info for device in self._devices]

    def check(self) -> None:
        """Raise a retryable :class:`InventoryError` when NVML stopped answering
        (its device count fails, as when the driver was unloaded or replaced
        under the running agent); per-GPU failures do not count (see
        :meth:`.calls.GuardedNVML.query`)."""
        try:
            self._nvml.nvmlDeviceGetCount()
        except self._nvml.NVMLError as exc:
            raise InventoryError(f"NVML stopped working ({exc})", retryable=True) from None

    def versions(self) -> dict[str, str | None]:
        """``{"driver": "550.54.15", "cuda": "12.4"}``: the driver's version and
        the newest CUDA version it supports; None where unknown."""
        driver = self._calls.query("system", "driver version", "nvmlSystemGetDriverVersion")
        cuda = self._calls.query("system", "CUDA version", "nvmlSystemGetCudaDriverVersion_v2")
        return {"driver": None if driver is None else text(driver),
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
            if device.parent not in self._calls.lost:
                memory = self._calls.memory(uuid, device.handle)
                reading["memory_used"] = None if memory is None else int(memory.used)
                # MIG instances have no utilization counters (NVML: not supported).
                rates = None if device.mig else self._calls.query(uuid, "utilization",
                                                                  "nvmlDeviceGetUtilizationRates", device.handle)
                reading["utilization"] = None if rates is None else int(rates.gpu)
            reading["healthy"] = health[uuid]["healthy"]
            result.append(reading)
        return result

    def health(self) -> dict[str, dict[str, Any]]:
        """GPU UUID -> ``{"healthy": bool, "reason": str | None, "xids": [int]}``.

        Unhealthy: the GPU is lost (``NVMLError_GpuIsLost``), or it reported a
        critical Xid other than :data:`~.events.APPLICATION_XIDS`. Both
        stay until the agent restarts, as in NVIDIA's k8s-device-plugin.
        Pending Xid events are read without waiting.
        """
        self._events.read(self._devices)
        result = {}
        for device in self._devices:
            uuid = device.info.uuid
            xids = self._events.xids.get(uuid, [])
            critical = [x for x in xids if x not in APPLICATION_XIDS]
            reason = None
            if device.parent in self._calls.lost:
                reason = f"GPU lost: {self._calls.lost[device.parent]}"
            elif critical:
                reason = f"Xid {critical[-1]}"
            result[uuid] = {"healthy": reason is None, "reason": reason, "xids": list(xids)}
        return result

    def process_usage(self) -> list[GPUProcess]:
        """Every compute process on every GPU: NVML's PID, the agent's PID
        (None when it maps to none, see :mod:`gpupool.node.attribution`), bytes (None when
        NVML cannot attribute memory, e.g. without permission to see another
        user's process) and the newest SM utilization sample in percent."""
        return self._processes.usage(self._devices)

    def process_known(self) -> set[str]:
        """UUIDs of the GPUs whose process list the last :meth:`process_usage` read."""
        return set(self._processes.known)

    def process_memory(self) -> dict[int, int]:
        """GPU bytes per *local* pid (the agent's namespace), summed over all
        GPUs; processes that map to no local pid or whose memory NVML cannot
        attribute are absent."""
        return memory_by_pid(self.process_usage())

    def close(self) -> None:
        """Free the Xid event set and shut NVML down. Idempotent; quiet when
        NVML already stopped answering (what :meth:`check` found)."""
        if getattr(self, "_open", False):
            self._open = False
            if self._events is not None:
                self._events.close()
            self._calls.quietly("nvmlShutdown")
