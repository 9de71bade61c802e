"""The real GPU inventory, read through NVML (``nvidia-ml-py``, imported as
``pynvml``).

Each query is guarded on its own: a GPU that does not support one (e.g.
utilization on some MIG or vGPU setups: ``NVMLError_NotSupported``) reports
``None`` for that value instead of failing the whole inventory. MIG instances
are not listed yet; whole GPUs are.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from gpupool.schema import GPUInfo

from .inventory import Inventory, InventoryError

T = TypeVar("T")

_HINT = "pass --simulate=SPEC (for example --simulate=2xA100-80GB) to run this agent without GPUs"


class NVMLInventory(Inventory):
    """The GPUs NVML sees on this host.

    Initialises NVML on construction. Raises :class:`InventoryError` (telling
    to pass ``--simulate``) when ``pynvml`` is not installed, the driver's
    library cannot be loaded, or NVML finds no GPU.
    """

    kind = "nvml"

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise InventoryError(f"nvidia-ml-py is not installed (pip install 'gpupool[agent]'), or {_HINT}") from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise InventoryError(f"NVML could not start ({exc}): is the NVIDIA driver installed? Or {_HINT}") from None
        self._open = True
        try:
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except pynvml.NVMLError as exc:
            self.close()
            raise InventoryError(f"NVML could not list the GPUs ({exc}); {_HINT}") from None
        if not self._handles:
            self.close()
            raise InventoryError(f"NVML found no GPU on this host; {_HINT}")

    def _query(self, fn: Callable[..., T], *args: Any) -> T | None:
        """``fn(*args)``, or None when NVML says it is not supported or failed."""
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def _memory(self, handle: Any) -> Any:
        # v2 memory info (driver >= 510) separates the driver's reservation from
        # "used"; older drivers only have v1 (total/free/used).
        info = self._query(self._nvml.nvmlDeviceGetMemoryInfo, handle, self._nvml.nvmlMemory_v2)
        return info if info is not None else self._query(self._nvml.nvmlDeviceGetMemoryInfo, handle)

    def discover(self) -> list[GPUInfo]:
        nvml = self._nvml
        gpus = []
        for index, handle in enumerate(self._handles):
            uuid = self._query(nvml.nvmlDeviceGetUUID, handle)
            memory = self._memory(handle)
            if not uuid or memory is None:
                raise InventoryError(f"NVML cannot read the UUID or memory of GPU {index}")
            capability = self._query(nvml.nvmlDeviceGetCudaComputeCapability, handle)
            gpus.append(GPUInfo(
                uuid=_text(uuid), name=_text(self._query(nvml.nvmlDeviceGetName, handle) or f"GPU {index}"),
                index=index, memory_total=int(memory.total),
                memory_reserved=int(getattr(memory, "reserved", 0) or 0),
                compute_capability=f"{capability[0]}.{capability[1]}" if capability else None))
        return gpus

    def metrics(self) -> list[dict[str, Any]]:
        nvml = self._nvml
        result = []
        for handle in self._handles:
            uuid = self._query(nvml.nvmlDeviceGetUUID, handle)
            if not uuid:
                continue
            memory = self._memory(handle)
            rates = self._query(nvml.nvmlDeviceGetUtilizationRates, handle)
            result.append({"uuid": _text(uuid),
                           "memory_used": None if memory is None else int(memory.used),
                           "utilization": None if rates is None else int(rates.gpu)})
        return result

    def process_memory(self) -> dict[int, int]:
        used: dict[int, int] = {}
        for handle in self._handles:
            for proc in self._query(self._nvml.nvmlDeviceGetComputeRunningProcesses, handle) or ():
                # usedGpuMemory is None where NVML cannot attribute it (e.g. under
                # Windows WDDM, or without permission to see other users' processes).
                if proc.usedGpuMemory is not None:
                    used[proc.pid] = used.get(proc.pid, 0) + int(proc.usedGpuMemory)
        return used

    def close(self) -> None:
        if getattr(self, "_open", False):
            self._open = False
            self._query(self._nvml.nvmlShutdown)


def _text(value: str | bytes) -> str:
    # nvidia-ml-py < 11.515 returned bytes.
    return value.decode() if isinstance(value, bytes) else value
