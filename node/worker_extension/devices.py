"""Where a value lives: off an accelerator before it travels, back onto the
same device when a push asks for it (a release brings GPU tensors home on the CPU)."""

from __future__ import annotations

import itertools
import sys
from typing import Any


def _framework(value: Any) -> str:
    return type(value).__module__.split(".")[0]


def device_of(value: Any) -> str | None:
    """The accelerator ``value`` lives on, or None for CPU values and
    everything without a device: ``"cuda:0"`` for a PyTorch tensor or module
    (its first parameter's device) and for any object with a ``device``
    attribute and a ``to(device)`` method (the duck type tests use without a
    GPU); ``"cupy:cuda:N"`` for a CuPy array; ``"jax:PLATFORM:N"`` for a JAX
    array on an accelerator; ``"simgpu:N"`` for an array in simulated GPU
    memory (:mod:`gpupool.node.simgpu`). A PyTorch tensor (or module)
    that the ``framework`` checkpointer moved to host memory while its worker
    is parked says the device it came off (:mod:`.offload`). The prefix says
    which library puts it back."""
    simgpu = sys.modules.get("gpupool.node.simgpu")
    if simgpu is not None and _framework(value) == "numpy" and (index := simgpu.device_of(value)) is not None:
        return f"simgpu:{index}"
    if _framework(value) == "cupy" and hasattr(value, "get"):
        return f"cupy:cuda:{value.device.id}"
    if _framework(value) in ("jax", "jaxlib") and callable(getattr(value, "devices", None)):
        first = next(iter(value.devices()))
        return None if first.platform == "cpu" else f"jax:{first.platform}:{first.id}"
    torch = sys.modules.get("torch")
    device: Any = None
    first = value
    if torch is not None and isinstance(value, torch.nn.Module):
        first = next(itertools.chain(value.parameters(), value.buffers()), None)
        device = None if first is None else first.device
    elif callable(getattr(value, "to", None)) and not isinstance(value, type):
        device = getattr(value, "device", None)
    offload = sys.modules.get(f"{__package__}.offload")
    parked = offload.parked_device(first) if offload is not None and first is not None else None
    if parked is not None:  # in host memory while its worker is parked: it belongs on that device
        return parked
    if device is None:
        return None
    text = str(device)
    return None if text == "cpu" or text.startswith("cpu:") else text


def to_cpu_with_device(value: Any) -> tuple[Any, str | None]:
    """``(value on the CPU, device it was on or None)``; values not on an
    accelerator come back as they are."""
    device = device_of(value)
    if device is None:
        return value, None
    if device.startswith("cupy:"):
        return value.get(), device  # a NumPy array in host memory
    if device.startswith("simgpu:"):
        return sys.modules["gpupool.node.simgpu"].to_host(value), device
    if device.startswith("jax:"):
        import numpy

        return numpy.asarray(value), device
    return value.to("cpu"), device


def place_on_devices(values: dict[str, Any], devices: dict[str, str]) -> dict[str, str]:
    """Move ``values[name]`` to ``devices[name]`` in place in ``values`` (what
    a pull recorded); returns ``{name: why}`` for each that stays where it is
    (no such device here, say). Values without a device entry are untouched."""
    errors: dict[str, str] = {}
    for name, device in devices.items():
        if name not in values or not device:
            continue
        try:
            values[name] = _to_device(values[name], device)
        except Exception as exc:  # one value's failure is its own; it still arrives, on the CPU
            errors[name] = f"stays on the CPU: {device} not usable on the worker ({type(exc).__name__}: {exc})"
    return errors


def _to_device(value: Any, device: str) -> Any:
    """Put a CPU value back where :func:`device_of` said it was; raises when
    that device (or its library) is not usable here."""
    library, _, where = device.partition(":")
    if library == "simgpu":
        from gpupool.node import simgpu

        return simgpu.asarray(value, int(where))
    if library == "cupy":
        import cupy

        with cupy.cuda.Device(int(where.rpartition(":")[2])):
            return cupy.asarray(value)
    if library == "jax":
        import jax

        platform, _, index = where.partition(":")
        return jax.device_put(value, next(d for d in jax.devices(platform) if d.id == int(index)))
    return value.to(device)  # PyTorch raises itself when CUDA is missing
