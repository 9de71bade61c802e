"""Simulated GPU memory, for workers on a node with a simulated inventory:
NumPy arrays whose pages live in a file of the GPU's folder
(:mod:`.simgpu_store`), limited to the slice's memory, so that parking and
the per-process readings run on hosts without a GPU (docs/parking.md,
"Simulated GPU memory")::

    from gpupool.node import simgpu
    x = simgpu.zeros((1024, 1024, 512), "float32")   # 2 GiB on GPU 0 of the slice
    simgpu.memory_allocated()                          # 2147483648
    simgpu.device_of(x)                                # 0
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import threading
import weakref
from typing import Any, Sequence

from gpupool.units import format_bytes

from . import simgpu_store as store

PAGE = mmap.PAGESIZE


class OutOfMemoryError(MemoryError):
    """An allocation the slice (or the host) cannot hold; the words are CUDA's."""


class _Block(mmap.mmap):
    """The shared mapping of one allocation file (the base of its arrays)."""

    device: int
    name: str


_numbers = itertools.count()
_lock = threading.Lock()
_held: dict[int, int] = {}  # device index -> bytes this process holds there
_owner = os.getpid()


def _reset_after_fork() -> None:
    global _owner
    _owner = os.getpid()
    _held.clear()  # the child holds nothing of its own


os.register_at_fork(after_in_child=_reset_after_fork)


def binding() -> tuple[list[str], int | None]:
    """``(GPU UUIDs this process sees, memory limit per GPU or None)``: the
    agent's binding file when it wrote one, else ``CUDA_VISIBLE_DEVICES`` and
    ``GPUPOOL_MEMORY_LIMIT``."""
    bound = store.read_binding(os.getpid())
    if bound is not None:
        return [str(u) for u in bound.get("gpus") or []], bound.get("limit")
    visible = [u.strip() for u in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if u.strip()]
    limit = os.environ.get("GPUPOOL_MEMORY_LIMIT", "")
    return visible, int(limit) if limit.isdigit() else None


def device_count() -> int:
    """How many simulated GPUs this process sees."""
    return len(binding()[0])


def memory_allocated(device: int = 0) -> int:
    """Bytes this process holds on ``device``."""
    return _held.get(device, 0)


def _gpu(device: int, visible: list[str]) -> str:
    if not visible:
        raise RuntimeError("CUDA error: no CUDA-capable device is detected (cudaErrorNoDevice): this process sees "
                           "no GPU (CUDA_VISIBLE_DEVICES is empty)")
    if not 0 <= device < len(visible):
        raise RuntimeError(f"CUDA error: invalid device ordinal (cudaErrorInvalidDevice): device {device} of "
                           f"{len(visible)}")
    try:
        store.gpu_dir(visible[device])
    except ValueError:
        raise RuntimeError(f"simulated GPUs need GPU UUIDs in CUDA_VISIBLE_DEVICES, got {visible[device]!r}") from None
    return visible[device]


def _allocate(nbytes: int, device: int) -> _Block:
    """A new mapping of ``nbytes`` (rounded up to a page) on ``device``; OutOfMemoryError."""
    visible, limit = binding()
    uuid = _gpu(device, visible)
    size = max(PAGE, -(-nbytes // PAGE) * PAGE)
    with _lock:
        held = _held.get(device, 0)
        if limit is not None and held + size > limit:
            raise OutOfMemoryError(
                f"CUDA error: out of memory (cudaErrorMemoryAllocation): tried to allocate {format_bytes(size)} on "
                f"GPU {device} ({uuid}); this slice allows {format_bytes(limit)} and this process holds "
                f"{format_bytes(held)}")
        _held[device] = held + size
    name = f"{os.getpid()}-{next(_numbers)}"
    path = store.make_shared(store.gpu_dir(uuid)) / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            block = _Block(fd, size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
    except OSError as exc:
        _forget(device, size)
        _unlink(path)
        raise OutOfMemoryError(f"CUDA error: out of memory (cudaErrorMemoryAllocation): tried to allocate "
                               f"{format_bytes(size)} on GPU {device} ({uuid}): the host has no room "
                               f"({exc.strerror})") from None
    block.device, block.name = device, name
    weakref.finalize(block, _free, path, device, size)
    return block


def _forget(device: int, size: int) -> None:
    with _lock:
        _held[device] = max(0, _held.get(device, 0) - size)


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _free(path, device: int, size: int) -> None:
    """The last array of an allocation is gone: its file goes (wherever a resume moved it)."""
    if os.getpid() != _owner:
        return  # a forked child's copy of the finalizer: the memory is its parent's
    _forget(device, size)
    if os.path.exists(path):
        _unlink(path)
        return
    for moved in store.root().glob(f"*/{os.path.basename(path)}"):
        _unlink(moved)


def empty(shape: int | Sequence[int], dtype: Any = "float64", device: int = 0):
    """A new array on ``device`` (its contents zero: fresh pages).
    OutOfMemoryError beyond the slice's limit; RuntimeError for no such device."""
    import numpy

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = numpy.dtype(dtype)
    block = _allocate(math.prod(shape) * dtype.itemsize, device)
    return numpy.ndarray(shape, dtype, buffer=block)


zeros = empty


def asarray(value: Any, device: int = 0):
    """A copy of ``value`` (anything NumPy takes) on ``device``."""
    import numpy

    host = numpy.asarray(value)
    array = empty(host.shape, host.dtype, device)
    array[...] = host
    return array


def allocation_of(array: Any) -> _Block | None:
    """The allocation ``array`` (or any view of one) lives in, None for host
    memory: its ``device`` index, its ``name`` (unique in the process) and
    ``len()``, its size in bytes (whole pages), shared by all its views."""
    seen = 0
    while array is not None and seen < 64:
        if isinstance(array, _Block):
            return array
        array = array.obj if isinstance(array, memoryview) else getattr(array, "base", None)
        seen += 1
    return None


def device_of(array: Any) -> int | None:
    """The device index ``array`` (or any view of one) lives on; None for host memory."""
    block = allocation_of(array)
    return None if block is None else block.device


def to_host(array: Any):
    """A copy of a device ``array`` in host memory (a plain NumPy array)."""
    import numpy

    return numpy.array(array, copy=True)
