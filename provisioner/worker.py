"""IPython extension loaded into every worker kernel on a GPU node.

The agent starts each worker with ``--IPKernelApp.extra_extensions`` naming
this module. It gives the worker two things the notebook's client relies on:

- the ``gpupool.transfer`` comm target, through which the client pushes
  variables into the worker and pulls them back (see :mod:`gpupool.transfer`
  for the wire shape); GPU tensors are moved to the CPU before they travel;
- the PyTorch memory cap of the slice: when the user's code imports
  ``torch`` and CUDA is available, ``torch.cuda.set_per_process_memory_fraction``
  is set from ``GPUPOOL_MEMORY_LIMIT`` (PyTorch has no environment variable
  for it, unlike JAX's ``XLA_PYTHON_CLIENT_MEM_FRACTION``, which the agent sets).
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import types
from typing import Any

from gpupool.transfer import dump_values, load_values

TARGET = "gpupool.transfer"
log = logging.getLogger("gpupool.worker")


def load_ipython_extension(ip) -> None:
    """Register the transfer comm target and the PyTorch cap hook."""
    ip.kernel.comm_manager.register_target(TARGET, lambda comm, msg: _serve(ip, comm, msg))
    if os.environ.get("GPUPOOL_MEMORY_LIMIT") and "torch" not in sys.modules:
        sys.meta_path.insert(0, _AfterImport("torch", _cap_torch_memory))


def user_variables(ip) -> dict[str, Any]:
    """The user's own names in the worker: no ``_private`` names, no names
    IPython put there itself (``In``, ``Out``, ``exit``...), no modules."""
    hidden = ip.user_ns_hidden
    return {name: value for name, value in ip.user_ns.items()
            if not name.startswith("_") and name not in hidden and not isinstance(value, types.ModuleType)}


def _serve(ip, comm, msg) -> None:
    """Answer one request (the comm's open message) and close the comm."""
    data = msg["content"]["data"]
    op = data.get("op")
    try:
        if op == "push":
            values, errors = load_values(data["header"], msg.get("buffers") or [])
            ip.user_ns.update(values)
            comm.send({"ok": True, "loaded": sorted(values), "errors": errors})
        elif op in ("pull", "pull_all"):
            header, buffers = _pull(ip, data)
            comm.send({"ok": True, "header": header}, buffers=buffers)
        else:
            comm.send({"ok": False, "message": f"unknown transfer op {op!r}"})
    except Exception as exc:  # the client shows this; the worker stays up
        log.exception("transfer %s failed", op)
        comm.send({"ok": False, "message": f"{type(exc).__name__}: {exc}"})
    finally:
        comm.close()


def _pull(ip, data: dict[str, Any]) -> tuple[dict[str, Any], list]:
    missing: dict[str, str] = {}
    if data["op"] == "pull":
        names = data.get("names", [])
        values = {n: ip.user_ns[n] for n in names if n in ip.user_ns}
        missing = {n: "not defined on the worker" for n in names if n not in ip.user_ns}
    else:
        values = user_variables(ip)
    header, buffers = dump_values({name: to_cpu(value) for name, value in values.items()})
    header["errors"].update(missing)
    limit = data.get("max_bytes")
    if limit:
        header, buffers = _cap(header, buffers, int(limit))
    return header, buffers


def _cap(header: dict[str, Any], buffers: list, limit: int) -> tuple[dict[str, Any], list]:
    """Keep items in order while their total stays within ``limit`` bytes;
    the rest are listed in the errors as left behind."""
    kept, kept_buffers, total, position = [], [], 0, 0
    for item in header["items"]:
        count = item["nbuffers"]
        if total + item["nbytes"] <= limit:
            kept.append(item)
            kept_buffers.extend(buffers[position:position + count])
            total += item["nbytes"]
        else:
            header["errors"][item["name"]] = f"{item['type']} left on the worker: over the transfer size cap"
        position += count
    return {"items": kept, "errors": header["errors"]}, kept_buffers


def to_cpu(value: Any) -> Any:
    """A PyTorch tensor or module on a GPU, moved to the CPU; anything else as is."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.cpu()
    if isinstance(value, torch.nn.Module):
        return value.to("cpu")
    return value


def _cap_torch_memory(torch) -> None:
    """Set the caching allocator's cap to the slice's memory on each visible GPU."""
    try:
        if not torch.cuda.is_available():
            return
        limit = int(os.environ["GPUPOOL_MEMORY_LIMIT"])
        for device in range(torch.cuda.device_count()):
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    except Exception:  # a cap that cannot be set must not break the user's import
        log.warning("could not set the PyTorch memory cap", exc_info=True)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after ``name`` is first imported."""

    def __init__(self, name: str, callback) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, callback = spec.loader, self.callback

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                callback(module)

        spec.loader = _Loader()
        return spec
