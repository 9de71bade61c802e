"""NVML queries that fail softly: the one way :mod:`.inventory` and its parts call NVML.

Each query is guarded on its own: a GPU that does not support one (e.g.
utilization of a MIG instance: ``NVMLError_NotSupported``) reports ``None``
(unknown, never 0) for that value, and one warning is logged per GPU and
metric, not one per heartbeat. A query failing with ``NVMLError_GpuIsLost``
marks the GPU lost, which stays until the agent restarts.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("gpupool.agent")


class GuardedNVML:
    """The NVML binding ``nvml`` (the ``pynvml`` module or a stand-in), asked
    through :meth:`query`; ``lost`` holds physical GPU UUID -> why NVML lost it."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.lost: dict[str, str] = {}
        # Pool UUID -> physical GPU UUID, as of the last enumeration: a lost
        # MIG instance marks its whole GPU lost.
        self.parents: dict[str, str] = {}
        self._warned: set[tuple[str, str]] = set()

    def query(self, device: str, metric: str, function: str, *args: Any, quiet: tuple = (),
              missing: Any = None) -> Any:
        """``nvml.<function>(*args)``, or ``missing`` (None) when it fails.

        ``device`` and ``metric`` name the value for the one warning logged per
        pair. Errors of the classes in ``quiet`` (by name, e.g. ``"NotFound"``)
        return None without a warning: they are expected answers there.
        ``NVMLError_GpuIsLost`` marks the device's GPU lost. A function the
        installed binding lacks counts as not supported.
        """
        nvml = self.nvml
        fn = getattr(nvml, function, None)
        if fn is None:
            self.warn(device, metric, f"the installed nvidia-ml-py has no {function}")
            return missing
        try:
            return fn(*args)
        except nvml.NVMLError as exc:
            if isinstance(exc, nvml.NVMLError_GpuIsLost):
                self._mark_lost(device, str(exc))
            if any(isinstance(exc, getattr(nvml, f"NVMLError_{name}")) for name in quiet):
                return missing
            self.warn(device, metric, str(exc))
            return missing

    def memory(self, device: str, handle: Any) -> Any:
        """The memory info of ``handle`` (``total``, ``used`` and, with v2,
        ``reserved``, in bytes), or None when unreadable."""
        # v2 memory info (driver >= 510) separates the driver's reservation from
        # "used"; older drivers and some MIG handles only have v1.
        version = getattr(self.nvml, "nvmlMemory_v2", None)
        info = None
        if version is not None:
            info = self.query(device, "memory (v2)", "nvmlDeviceGetMemoryInfo", handle, version,
                              quiet=("NotSupported", "FunctionNotFound", "ArgumentVersionMismatch", "InvalidArgument"))
        return info if info is not None else self.query(device, "memory", "nvmlDeviceGetMemoryInfo", handle)

    def quietly(self, function: str, *args: Any) -> None:
        """``nvml.<function>(*args)``, ignoring NVML's errors: for freeing what
        a driver that stopped answering already dropped."""
        try:
            getattr(self.nvml, function)(*args)
        except self.nvml.NVMLError:
            pass

    def warn(self, device: str, metric: str, why: str) -> None:
        if (device, metric) not in self._warned:
            self._warned.add((device, metric))
            log.warning("NVML cannot read the %s of GPU %s (%s); it is reported as unknown", metric, device, why)

    def _mark_lost(self, device: str, why: str) -> None:
        parent = self.parents.get(device, device)
        if parent not in self.lost:
            log.error("GPU %s is lost (%s): marking it unhealthy; it needs a reset or a reboot", parent, why)
            self.lost[parent] = why


def text(value: str | bytes) -> str:
    """NVML's string ``value`` as str (nvidia-ml-py < 11.515 returned bytes)."""
    return value.decode() if isinstance(value, bytes) else value
