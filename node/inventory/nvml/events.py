"""Critical Xid events (``nvmlEventTypeXidCriticalError``), read without
blocking: the Xids each GPU of the pool reported since the agent started."""

from __future__ import annotations

import logging
from typing import Any

from .calls import GuardedNVML, text
from .devices import Device

log = logging.getLogger("gpupool.agent")

# Xids that user code causes (bad memory access, kernel exceptions...), which
# do not make a GPU unhealthy. The same list as NVIDIA's k8s-device-plugin
# (internal/rm/health.go): 13 graphics engine exception, 31 GPU memory page
# fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video
# processor exception, 109 context switch timeout.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


class XidEvents:
    """An NVML event set registered for critical Xids on the physical GPUs'
    handles ``physical``; none (and nothing read) when the binding, the driver
    or every GPU refuses one. ``xids``: pool UUID -> the Xids seen, oldest first."""

    def __init__(self, calls: GuardedNVML, physical: list[Any]) -> None:
        self._calls = calls
        self._set: Any = None
        self.xids: dict[str, list[int]] = {}
        kind = getattr(calls.nvml, "nvmlEventTypeXidCriticalError", None)
        if kind is None:
            return
        events = calls.query("system", "Xid events", "nvmlEventSetCreate")
        if events is None:
            return
        registered = [calls.query(f"{index}", "Xid events", "nvmlDeviceRegisterEvents", handle, kind, events,
                                  missing=False) is not False for index, handle in enumerate(physical)]
        if any(registered):
            self._set = events
        else:
            calls.query("system", "Xid events", "nvmlEventSetFree", events)

    def read(self, devices: list[Device]) -> None:
        """Add the pending events to ``xids`` of the ``devices`` they name,
        without waiting."""
        if self._set is None:
            return
        for _ in range(1000):  # bounded: a storm of events must not stall a heartbeat
            data = self._calls.query("system", "Xid events", "nvmlEventSetWait", self._set, 0, quiet=("Timeout",))
            if data is None:
                return
            xid = int(data.eventData)
            parent = text(self._calls.query("system", "Xid device", "nvmlDeviceGetUUID", data.device) or "")
            hit = self._hit(devices, parent, getattr(data, "gpuInstanceId", None))
            level = logging.INFO if xid in APPLICATION_XIDS else logging.ERROR
            log.log(level, "Xid %d on GPU %s%s", xid, parent,
                    "" if xid in APPLICATION_XIDS else ": marking it unhealthy")
            for device in hit:
                self.xids.setdefault(device.info.uuid, []).append(xid)

    def _hit(self, devices: list[Device], parent: str, instance: int | None) -> list[Device]:
        # A MIG instance's event names its GPU instance; 0xFFFFFFFF (or no
        # instance) means the whole GPU.
        hit = [d for d in devices if d.parent == parent]
        if any(d.mig for d in hit) and instance not in (None, 0xFFFFFFFF):
            ids = {d.info.uuid: self._calls.query(d.info.uuid, "GPU instance id", "nvmlDeviceGetGpuInstanceId",
                                                  d.handle) for d in hit}
            hit = [d for d in hit if ids[d.info.uuid] == instance] or hit
        return hit

    def close(self) -> None:
        """Free the event set (quietly: NVML may have stopped answering)."""
        if self._set is not None:
            self._calls.quietly("nvmlEventSetFree", self._set)
            self._set = None
