"""The ``framework`` checkpointer's part in the worker: GPU memory moved to
host memory between cells, in place, and back (docs/parking.md).

:func:`park` (the agent's ``park_gpu`` request, while no cell runs) finds
every PyTorch CUDA tensor the interpreter holds (``gc``: variables,
modules' parameters and buffers, optimizer states, gradients), copies each
*storage* once into (pinned) host memory and points every tensor of it at the
copy (``tensor.data``): the user's references, views and ``Parameter``
objects stay the same objects, aliasing included. Then the caching allocator
is emptied. :func:`resume` does the reverse onto the same devices. What
PyTorch holds where ``gc`` cannot see (autograd graphs, CUDA graphs,
compiled code) stays on the GPU, with the CUDA context: that is reported as
kept. CuPy and JAX arrays cannot be moved in place (their arrays own their
device memory); their memory pools are emptied and the arrays they hold stay
on the GPU, said in words.
"""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

from gpupool.units import format_bytes

#: id(tensor) -> (a weak reference to it, the device it was on before the park): it is on
#: the CPU until the resume. By id: a tensor's ``==`` compares elements, so no mapping keyed
#: by tensors (a WeakKeyDictionary) can look one up.
_parked: dict[int, tuple[weakref.ref, str]] = {}


def remember(tensor: Any, device: str) -> None:
    """Note that ``tensor`` (now in host memory) belongs on ``device``."""
    key = id(tensor)
    _parked[key] = (weakref.ref(tensor, lambda _, key=key: _parked.pop(key, None)), device)


def parked_device(value: Any) -> str | None:
    """The device a tensor parked in host memory comes from ("cuda:0"), else None."""
    entry = _parked.get(id(value))
    return entry[1] if entry is not None and entry[0]() is value else None


def _parked_tensors() -> list[tuple[Any, str]]:
    return [(tensor, device) for ref, device in list(_parked.values()) if (tensor := ref()) is not None]


def _storage_groups(torch, tensors: list) -> dict[tuple[int, str], list]:
    groups: dict[tuple[int, str], list] = {}
    for tensor in tensors:
        groups.setdefault((tensor.untyped_storage().data_ptr(), str(tensor.device)), []).append(tensor)
    return groups


def move_tensors(torch, tensors: list, device: str, pin: bool = False) -> int:
    """Move ``tensors`` (dense, strided) to ``device`` in place, one copy per
    storage, views kept views of the same new storage; returns the bytes of
    the storages moved. ``pin``: the new storages in pinned host memory."""
    moved = 0
    with torch.no_grad():
        for (_, _), group in _storage_groups(torch, tensors).items():
            storage = group[0].untyped_storage()
            size = storage.nbytes()
            source = torch.empty(0, dtype=torch.uint8, device=group[0].device).set_(storage, 0, (size,), (1,))
            copy = torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin)
            copy.copy_(source)
            new = copy.untyped_storage()
            for tensor in group:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=device).set_(
                    new, tensor.storage_offset(), tensor.size(), tensor.stride())
            moved += size
    return moved


def _cuda_tensors(torch) -> tuple[list, list]:
    """``(movable, others)``: the CUDA tensors ``gc`` sees, dense and strided or not."""
    movable, others = [], []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                (movable if obj.layout == torch.strided and type(obj) in (torch.Tensor, torch.nn.Parameter)
                 else others).append(obj)
        except Exception:  # a half-built object, a tensor subclass that refuses: left where it is
            continue
    return movable, others


def park() -> dict[str, Any]:
    """Move this worker's GPU memory to host memory (see the module's
    docstring); answers ``{"ok", "moved", "kept", "lost"}`` (bytes moved,
    bytes the frameworks still reserve on the GPU, words)."""
    moved, kept, lost = 0, 0, []
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        movable, others = _cuda_tensors(torch)
        devices = [str(tensor.device) for tensor in movable]
        moved = move_tensors(torch, movable, "cpu", pin=True)
        for tensor, device in zip(movable, devices):
            remember(tensor, device)
        del movable
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        kept = sum(torch.cuda.memory_reserved(d) for d in range(torch.cuda.device_count()))
        if others:
            lost.append(f"{len(others)} PyTorch tensor(s) of other kinds (sparse, subclasses) stay on the GPU")
        if kept:
            lost.append(f"{format_bytes(kept)} that PyTorch holds out of reach (autograd graphs, CUDA graphs, "
                        "compiled code) stays on the GPU")
    kept += _cupy(lost) + _jax(lost)
    return {"ok": True, "moved": moved, "kept": kept, "lost": lost}


def resume() -> dict[str, Any]:
    """Move what :func:`park` moved back onto its devices; answers ``{"ok", "moved"}``."""
    torch = sys.modules.get("torch")
    moved = 0
    if torch is not None and _parked:
        by_device: dict[str, list] = {}
        for tensor, device in _parked_tensors():
            by_device.setdefault(device, []).append(tensor)
        for device, tensors in by_device.items():
            moved += move_tensors(torch, tensors, device)
        _parked.clear()
        gc.collect()
    return {"ok": True, "moved": moved}


def _cupy(lost: list[str]) -> int:
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return 0
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    used = int(pool.used_bytes())
    if used:
        lost.append(f"CuPy arrays ({format_bytes(used)}) stay on the GPU: CuPy cannot move an array in place")
    return used


def _jax(lost: list[str]) -> int:
    jax = sys.modules.get("jax")
    if jax is None:
        return 0
    try:
        held = sum(a.nbytes for a in jax.live_arrays() if next(iter(a.devices())).platform != "cpu")
        jax.clear_caches()
    except Exception:  # an older JAX without live_arrays
        return 0
    if held:
        lost.append(f"JAX arrays ({format_bytes(held)}) stay on the GPU: JAX arrays cannot be moved in place")
    return int(held)
