"""Which of the user's names hold GPU memory, and how much: what ``%gpu
status`` lists under the lease, answered on the ``gpu_memory``
op of the transfer comm.

A holder is a name of the user's namespace, an ``Out[n]`` of IPython's
output history, or the last traceback (``sys.last_traceback``, kept by
IPython for ``%debug``), whose frames' locals pin what they referred to.
What counts: PyTorch CUDA tensors and ``nn.Module``s (parameters and
buffers), CuPy arrays, JAX arrays off the CPU, arrays in simulated GPU
memory (:mod:`gpupool.node.simgpu`), directly or inside lists,
tuples, sets, dicts and objects' attributes. A library is looked at only
when the user's code imported it (``sys.modules``), never imported here.

Each *allocation* (a PyTorch storage, a CuPy memory block, a JAX buffer, a
simulated allocation) counts once: for a name whose value is a tensor, array
or module before a container holding it, the largest first, the last
traceback last. A view, a module's parameter that also has a name of its
own, a tensor also in a list, is not counted twice; a holder whose every allocation another holder counts names it in
``shares``. The walk is bounded (:data:`DEPTH`, :data:`ITEMS`,
:data:`OBJECTS`, :data:`SECONDS`); where a bound stopped it, the answer says
``complete: false``.
"""

from __future__ import annotations

import itertools
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Any, Iterator

from . import lasttraceback
from .namespace import user_variables

#: Levels of containers and attributes looked into below a name.
DEPTH = 3
#: Items looked at per container (its first ones): a list of a million floats is not walked.
ITEMS = 10_000
#: Objects looked at in all, for one listing.
OBJECTS = 200_000
#: Seconds one listing may take.
SECONDS = 1.0
#: Modules whose objects are never walked into: the shell itself reaches every name.
_SHELL_MODULES = ("IPython", "ipykernel", "traitlets", "zmq", "tornado", "asyncio", "jupyter_client", "gpupool")

#: (library, device, address): one allocation, the same for every view of it.
Key = tuple[str, str, Any]


@dataclass
class Budget:
    """What is left of one listing's bounds: ``spent`` once the objects or
    the time ran out, ``partial`` once anything was left unlooked at."""

    objects: int = OBJECTS
    deadline: float = field(default_factory=lambda: time.monotonic() + SECONDS)
    spent: bool = False
    partial: bool = False

    def spend(self) -> bool:
        """Count one object; False once the bounds are spent."""
        self.objects -= 1
        if self.objects < 0 or (self.objects % 256 == 0 and time.monotonic() > self.deadline):
            self.spent = self.partial = True
        return not self.spent


def allocations(value: Any) -> dict[Key, tuple[int, str]] | None:
    """``{key: (bytes, device)}`` of a value that is itself device memory
    (a tensor, a module, an array), ``{}`` for one that is a tensor or array
    in host memory, None for anything else (which may contain some)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(value, torch.Tensor):
            return _torch_storage(value)
        if isinstance(value, torch.nn.Module):
            found: dict[Key, tuple[int, str]] = {}
            for tensor in (*value.parameters(), *value.buffers()):
                found.update(_torch_storage(tensor))
            return found
    module = type(value).__module__.split(".")[0]
    if module == "numpy":
        return _simgpu(value)
    if module == "cupy":
        return _cupy(value)
    if module in ("jax", "jaxlib"):
        return _jax(value)
    return None


def _torch_storage(tensor: Any) -> dict[Key, tuple[int, str]]:
    if not tensor.is_cuda:
        return {}
    storage = tensor.untyped_storage()
    device = str(tensor.device)
    return {("torch", device, storage.data_ptr()): (int(storage.nbytes()), device)}


def _simgpu(array: Any) -> dict[Key, tuple[int, str]] | None:
    simgpu = sys.modules.get("gpupool.node.simgpu")
    block = simgpu.allocation_of(array) if simgpu is not None else None
    if block is None:
        return {} if hasattr(array, "dtype") else None
    device = f"simgpu:{block.device}"
    return {("simgpu", device, block.name): (len(block), device)}


def _cupy(array: Any) -> dict[Key, tuple[int, str]] | None:
    memory = getattr(getattr(array, "data", None), "mem", None)
    if memory is None or not hasattr(array, "device"):
        return None
    device = f"cuda:{array.device.id}"
    return {("cupy", device, int(memory.ptr)): (int(memory.size), device)}


def _jax(array: Any) -> dict[Key, tuple[int, str]] | None:
    if not callable(getattr(array, "devices", None)):
        return None
    first = next(iter(array.devices()))
    if first.platform == "cpu":
        return {}
    try:
        address: Any = array.unsafe_buffer_pointer()
    except Exception:  # sharded over devices: no one pointer, the array is its own key
        address = id(array)
    device = f"{first.platform}:{first.id}"
    return {("jax", device, address): (int(array.nbytes), device)}


def reachable(value: Any, budget: Budget, skip: set[int]) -> dict[Key, tuple[int, str]]:
    """The allocations ``value`` holds, looking :data:`DEPTH` levels into
    containers and attributes; never into objects in ``skip`` (ids) or of the shell."""
    found: dict[Key, tuple[int, str]] = {}
    seen = set(skip)
    todo = [(value, 0)]
    while todo and budget.spend():
        item, depth = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        try:
            own = allocations(item)
        except Exception:  # a sparse tensor (no storage), a half-built object: not counted, the rest is
            budget.partial = True
            continue
        if own is not None:
            found.update(own)
        elif depth < DEPTH:
            try:
                todo.extend((child, depth + 1) for child in _children(item, budget))
            except RuntimeError:  # changed size while looked at (another thread): what was seen counts
                budget.partial = True
    if todo:
        budget.partial = True
    return found


def _children(value: Any, budget: Budget) -> Iterator[Any]:
    """What a container or plain object refers to, its first :data:`ITEMS`."""
    if isinstance(value, (str, bytes, bytearray, int, float, complex, bool, type, types.ModuleType,
                          types.FunctionType, types.BuiltinFunctionType, types.MethodType)) or value is None:
        return iter(())
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        if type(value).__module__.split(".")[0] in _SHELL_MODULES:
            return iter(())
        try:
            items = vars(value).values()
        except TypeError:  # no __dict__ (slots, builtins)
            return iter(())
    if len(items) > ITEMS:
        budget.partial = True
    return itertools.islice(items, ITEMS)


def named_values(ip) -> dict[str, Any]:
    """The holders by name: the user's variables, then ``Out[n]`` of IPython's output history."""
    named = dict(user_variables(ip))
    out = ip.user_ns.get("Out")
    if isinstance(out, dict):
        named.update({f"Out[{n}]": value for n, value in out.items()})
    return named


def listing(ip, top: int = 10) -> dict[str, Any]:
    """The ``gpu_memory`` op's answer: ``{"ok", "holders": [...], "more":
    {"count", "bytes"}, "complete": bool}``, the ``top`` holders largest
    first, each ``{"name", "bytes", "devices": ["cuda:0"], "type", "shares":
    [names]}`` (bytes it alone counts; ``shares``: the holders that count
    the rest of what it holds), then how many more hold how many bytes."""
    budget = Budget()
    skip = {id(ip.user_ns)}
    named = [(name, value, reachable(value, budget, skip)) for name, value in named_values(ip).items()
             if not budget.spent]
    # A tensor's own name before a list or dict that also holds it, then the largest first.
    named.sort(key=lambda entry: (not _device_value(entry[1]), -sum(size for size, _ in entry[2].values())))
    held = [(name, type(value).__name__, found) for name, value, found in named if found]
    exc = lasttraceback.last_exception()
    if exc is not None:  # last: what it pins that a name holds too is that name's
        frames = lasttraceback.user_frames(ip, exc)
        pinned = reachable([dict(frame.f_locals) for frame in frames], budget, skip)
        if pinned:
            held.append((lasttraceback.label(ip, exc), "traceback", pinned))
    rows = _claim(held)
    return {"ok": True, "holders": rows[:top],
            "more": {"count": len(rows[top:]), "bytes": sum(row["bytes"] for row in rows[top:])},
            "complete": not budget.partial}


def _device_value(value: Any) -> bool:
    """Whether ``value`` is itself a tensor, array or module (not a container of them)."""
    try:
        return allocations(value) is not None
    except Exception:  # as reachable() has it: not counted
        return False


def _claim(held: list[tuple[str, str, dict[Key, tuple[int, str]]]]) -> list[dict[str, Any]]:
    """Rows of ``held`` (name, type, allocations), in priority order: each
    allocation counted for the first holder that holds it; largest first."""
    owner: dict[Key, str] = {}
    rows = []
    for name, kind, found in held:
        own = [key for key in found if key not in owner]
        owner.update((key, name) for key in own)
        rows.append({"name": name, "type": kind, "bytes": sum(found[key][0] for key in own),
                     "devices": sorted({device for _, device in found.values()}),
                     "shares": sorted({owner[key] for key in found if owner[key] != name})})
    rows.sort(key=lambda row: -row["bytes"])
    return rows
