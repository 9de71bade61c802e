"""A fake NVML binding for hosts without a GPU: the one place a fake is right.

:class:`FakeNVML` stands in for the ``pynvml`` module at the NVML boundary.
It reuses the real module's exception classes and constants (so
``except pynvml.NVMLError_NotSupported`` in production code catches what the
fake raises) and provides only functions that exist in the real module with
the same parameters; ``tests/node/test_nvml.py`` checks both, so the fake cannot
drift from nvidia-ml-py silently.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

import psutil
import pynvml as real

MiB = 1024**2


def nvml_error(name: str) -> real.NVMLError:
    """The real binding's exception for NVML_ERROR_<NAME>, e.g. ``"NOT_SUPPORTED"``."""
    return real.NVMLError(getattr(real, f"NVML_ERROR_{name}"))


@dataclass
class FakeProcess:
    """What ``nvmlDeviceGetComputeRunningProcesses`` returns per process."""

    pid: int
    usedGpuMemory: int | None  # noqa: N815 - NVML's field name
    gpuInstanceId: int = 0xFFFFFFFF  # noqa: N815
    computeInstanceId: int = 0xFFFFFFFF  # noqa: N815


@dataclass
class FakeSample:
    """One ``c_nvmlProcessUtilizationSample_t``; ``timeStamp`` in microseconds."""

    pid: int
    timeStamp: int  # noqa: N815
    smUtil: int  # noqa: N815
    memUtil: int = 0  # noqa: N815
    encUtil: int = 0  # noqa: N815
    decUtil: int = 0  # noqa: N815


@dataclass
class FakeGPU:
    """A GPU (or MIG instance) and what NVML answers about it.

    ``unsupported``: names of NVML functions that raise NotSupported for it;
    ``errors``: function name -> NVML_ERROR_ name raised instead of answering.
    ``lost``: every query raises GpuIsLost. ``mig``: instances, when MIG is
    enabled (None slots are empty).
    """

    uuid: str
    name: str = "NVIDIA A100-SXM4-80GB"
    memory_total: int = 81920 * MiB
    memory_reserved: int = 609 * MiB
    memory_used: int = 0
    capability: tuple[int, int] = (8, 0)
    utilization: int = 0
    processes: list[FakeProcess] = field(default_factory=list)
    samples: list[FakeSample] = field(default_factory=list)
    mig: list["FakeGPU | None"] | None = None
    gpu_instance_id: int = 0
    unsupported: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)
    lost: bool = False


@dataclass
class FakeEvent:
    """One ``c_nvmlEventData_t``."""

    device: FakeGPU
    eventType: int  # noqa: N815
    eventData: int  # noqa: N815
    gpuInstanceId: int = 0xFFFFFFFF  # noqa: N815
    computeInstanceId: int = 0xFFFFFFFF  # noqa: N815


_Memory = types.SimpleNamespace


class FakeNVML(types.ModuleType):
    """A module object shaped like ``pynvml`` over ``gpus``.

    ``init_error``: NVML_ERROR_ name ``nvmlInit`` raises (e.g.
    ``"DRIVER_NOT_LOADED"``). ``calls`` counts calls per function name.
    """

    def __init__(self, gpus: list[FakeGPU], *, driver: str = "550.54.15", cuda: int = 12040,
                 init_error: str | None = None) -> None:
        super().__init__("pynvml")
        for name in dir(real):
            if name.startswith(("NVMLError", "NVML_", "nvmlMemory_v2", "nvmlEventType")):
                setattr(self, name, getattr(real, name))
        self.gpus, self.driver, self.cuda, self.init_error = gpus, driver, cuda, init_error
        self.initialised = False
        self.events: list[FakeEvent] = []
        self.calls: dict[str, int] = {}

    # helpers -----------------------------------------------------------------

    def _device(self, function: str, handle: FakeGPU) -> FakeGPU:
        self.calls[function] = self.calls.get(function, 0) + 1
        if not self.initialised:
            raise nvml_error("UNINITIALIZED")
        if handle.lost:
            raise nvml_error("GPU_IS_LOST")
        if function in handle.unsupported:
            raise nvml_error("NOT_SUPPORTED")
        if function in handle.errors:
            raise nvml_error(handle.errors[function])
        return handle

    # the binding's functions, with the real parameter names ------------------

    def nvmlInit(self) -> None:
        if self.init_error:
            raise nvml_error(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        if not self.initialised:
            raise nvml_error("UNINITIALIZED")
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        if not self.initialised:
            raise nvml_error("UNINITIALIZED")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGPU:
        if not self.initialised:
            raise nvml_error("UNINITIALIZED")
        if not 0 <= index < len(self.gpus):
            raise nvml_error("INVALID_ARGUMENT")
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: FakeGPU) -> str:
        return self._device("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: FakeGPU) -> str:
        return self._device("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGPU, version: Any = None) -> Any:
        gpu = self._device("nvmlDeviceGetMemoryInfo", handle)
        if version is None:
            return _Memory(total=gpu.memory_total, free=gpu.memory_total - gpu.memory_used, used=gpu.memory_used)
        if "nvmlDeviceGetMemoryInfo_v2" in gpu.unsupported:
            raise nvml_error("NOT_SUPPORTED")
        return _Memory(version=version, total=gpu.memory_total, reserved=gpu.memory_reserved,
                       free=gpu.memory_total - gpu.memory_reserved - gpu.memory_used, used=gpu.memory_used)

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeGPU) -> tuple[int, int]:
        return self._device("nvmlDeviceGetCudaComputeCapability", handle).capability

    def nvmlDeviceGetMigMode(self, device: FakeGPU) -> list[int]:
        gpu = self._device("nvmlDeviceGetMigMode", device)
        on = real.NVML_DEVICE_MIG_ENABLE if gpu.mig is not None else real.NVML_DEVICE_MIG_DISABLE
        return [on, on]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: FakeGPU) -> int:
        return len(self._device("nvmlDeviceGetMaxMigDeviceCount", device).mig or ())

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: FakeGPU, index: int) -> FakeGPU:
        gpu = self._device("nvmlDeviceGetMigDeviceHandleByIndex", device)
        slots = gpu.mig or []
        if not 0 <= index < len(slots):
            raise nvml_error("INVALID_ARGUMENT")
        if slots[index] is None:
            raise nvml_error("NOT_FOUND")
        return slots[index]

    def nvmlDeviceGetGpuInstanceId(self, device: FakeGPU) -> int:
        return self._device("nvmlDeviceGetGpuInstanceId", device).gpu_instance_id

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGPU) -> Any:
        gpu = self._device("nvmlDeviceGetUtilizationRates", handle)
        return types.SimpleNamespace(gpu=gpu.utilization, memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGPU) -> list[FakeProcess]:
        return list(self._device("nvmlDeviceGetComputeRunningProcesses", handle).processes)

    def nvmlDeviceGetProcessUtilization(self, handle: FakeGPU, timeStamp: int) -> list[FakeSample]:  # noqa: N803
        newer = [s for s in self._device("nvmlDeviceGetProcessUtilization", handle).samples if s.timeStamp > timeStamp]
        if not newer:  # what NVML answers when no sample is newer than timeStamp
            raise nvml_error("NOT_FOUND")
        return newer

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.cuda

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, handle: FakeGPU, eventTypes: int, eventSet: object) -> None:  # noqa: N803
        self._device("nvmlDeviceRegisterEvents", handle)

    def nvmlEventSetWait(self, eventSet: object, timeoutms: int) -> FakeEvent:  # noqa: N803
        if not self.events:
            raise nvml_error("TIMEOUT")
        return self.events.pop(0)

    def nvmlEventSetFree(self, eventSet: object) -> None:  # noqa: N803
        return None


def fake_functions() -> list[str]:
    """The NVML function names the fake provides."""
    return [name for name in vars(FakeNVML) if name.startswith("nvml")]


# -- a fake that another process drives: a real ``gpupool agent`` on fake GPUs -----------------------------------

#: The GPUs of an agent started by :func:`run_agent`.
AGENT_GPUS = ("GPU-aaaaaaaa-1111-2222-3333-444444444444", "GPU-bbbbbbbb-1111-2222-3333-444444444444")


class ControlledNVML(FakeNVML):
    """A :class:`FakeNVML` driven through the JSON file ``control`` (re-read at
    every call, so a test can drive an agent or NVML helper in another process):
    ``{"error": "LIB_RM_VERSION_MISMATCH"}`` makes every NVML function,
    ``nvmlInit`` included, raise the real binding's error for
    NVML_ERROR_<that name>, as when the driver is missing, unloaded or
    replaced under a running process; ``{"error": null}`` (or no file) heals it.
    ``{"hang": true}`` makes every NVML function block, as a call stuck in a
    hung driver does, until the file says otherwise (a list of function names
    hangs only those); while a call hangs, the file ``CONTROL.hanging`` holds
    the pid of the process it hangs in. Write the file with :func:`set_error`
    and :func:`set_hang`."""

    def __init__(self, gpus: list[FakeGPU], control: Path, **kwargs: Any) -> None:
        super().__init__(gpus, **kwargs)
        self.control = Path(control)

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if name.startswith("nvml") and callable(value):
            control = super().__getattribute__("control")

            def controlled(*args: Any, **kwargs: Any) -> Any:  # in the call, as the real binding's
                _hang_while(control, name)
                error = read_control(control).get("error")
                if error:
                    raise nvml_error(error)
                return value(*args, **kwargs)
            return controlled
        return value


def read_control(control: Path) -> dict[str, Any]:
    """What the control file says (``{}`` without one)."""
    return json.loads(control.read_text()) if control.exists() else {}


def _hangs(control: Path, function: str) -> bool:
    hang = read_control(control).get("hang")
    return hang is True or (isinstance(hang, list) and function in hang)


def _hang_while(control: Path, function: str) -> None:
    """Block while the control file says ``function`` hangs."""
    if not _hangs(control, function):
        return
    marker = hanging_marker(control)
    _write(marker, str(os.getpid()))
    while _hangs(control, function):
        time.sleep(0.02)
    if marker.exists() and marker.read_text() == str(os.getpid()):
        marker.unlink(missing_ok=True)


def hanging_marker(control: Path) -> Path:
    """The file naming the pid an NVML call hangs in now (see :class:`ControlledNVML`)."""
    return Path(control).with_suffix(".hanging")


def hanging_pid(control: Path) -> int | None:
    """The pid of the live process an NVML call of the fake hangs in now
    (a killed one not yet reaped is not live); None when none."""
    try:
        pid = int(hanging_marker(control).read_text())
        alive = psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except (FileNotFoundError, ValueError, psutil.NoSuchProcess):
        return None
    return pid if alive else None


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _set(control: Path, **values: Any) -> None:
    _write(Path(control), json.dumps({**read_control(Path(control)), **values}))


def set_error(control: Path, error: str | None) -> None:
    """Make the :class:`ControlledNVML` reading ``control`` fail with
    NVML_ERROR_<error> (None: work), atomically (the agent may be reading it)."""
    _set(control, error=error)


def set_hang(control: Path, hang: bool | list[str]) -> None:
    """Make the :class:`ControlledNVML` reading ``control`` hang in every
    NVML call (True), in the ones named, or not at all (False)."""
    _set(control, hang=hang)


def helper_command(control: Path, gpus: tuple[str, ...] = AGENT_GPUS) -> list[str]:
    """An NVML helper program (:mod:`gpupool.node.inventory.nvml.helper`) on a
    :class:`ControlledNVML` over ``gpus`` (UUIDs; none: NVML finds no GPU)
    driven by ``control``, for :class:`~gpupool.node.inventory.nvml.watch.WatchedInventory`."""
    return [sys.executable, str(Path(__file__).resolve()), "helper", str(control), ",".join(gpus)]


def run_helper(control: str, gpus: str, fd: str) -> int:
    """The NVML helper with ``pynvml`` replaced (see :func:`helper_command`)."""
    sys.modules["pynvml"] = ControlledNVML([FakeGPU(uuid) for uuid in gpus.split(",") if uuid], Path(control))
    from gpupool.node.inventory.nvml import helper as nvml_helper

    return nvml_helper.main([fd])


def run_agent(control: str, argv: list[str]) -> int:
    """``gpupool agent ARGV`` (no ``--simulate``: NVML) whose NVML helper
    runs a :class:`ControlledNVML` over two A100s (:data:`AGENT_GPUS`) driven
    by the file ``control``. Run as ``python tests/support/fakenvml.py CONTROL ARGV...``."""
    from gpupool.cli import main
    from gpupool.node.inventory.nvml import watch as nvml_watch

    nvml_watch.helper_command = lambda: helper_command(Path(control))
    return main(["agent", *argv])


if __name__ == "__main__":
    if sys.argv[1] == "helper":
        sys.exit(run_helper(*sys.argv[2:]))
    sys.exit(run_agent(sys.argv[1], sys.argv[2:]))
