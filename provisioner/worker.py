"""IPython extension loaded into every worker kernel on a GPU node.

The agent starts each worker with ``--IPKernelApp.extra_extensions`` naming
this module. It gives the worker two things the notebook's client relies on:

- the ``gpupool.transfer`` comm target, through which the client pushes
  variables into the worker and pulls them back (see :mod:`gpupool.transfer`
  for the wire shape); GPU tensors are moved to the CPU before they travel,
  with the device they were on, and a push can ask for them to be put back
  on it; the ``have`` and ``versions`` ops let the client send along only the
  names a cell needs and warn about package mismatches (docs/api.md); big
  buffers go over the worker's data plane (:mod:`.worker_dataplane`, on the
  ``transfer_port`` of its connection file) instead of the comm message;
- the PyTorch memory cap of the slice: when the user's code imports
  ``torch`` and CUDA is available, ``torch.cuda.set_per_process_memory_fraction``
  is set from ``GPUPOOL_MEMORY_LIMIT`` (PyTorch has no environment variable
  for it, unlike JAX's ``XLA_PYTHON_CLIENT_MEM_FRACTION``, which the agent sets).
"""

from __future__ import annotations

import importlib.abc
import itertools
import json
import logging
import os
import sys
import types
from typing import Any

from gpupool.transfer import dump_values, load_values, package_versions

from . import worker_dataplane

TARGET = "gpupool.transfer"
log = logging.getLogger("gpupool.worker")


def load_ipython_extension(ip) -> None:
    """Register the transfer comm target, the ``%gpu`` line magic that asks
    the notebook kernel (:func:`notebook_magic`), the front end's stdin rule
    and the PyTorch cap hook."""
    plane = worker_dataplane.start_for_kernel()
    ip.kernel.comm_manager.register_target(TARGET, lambda comm, msg: _serve(ip, comm, msg, plane))
    ip.register_magic_function(lambda line: notebook_magic(ip, line), "line", "gpu")
    ip.events.register("pre_run_cell", lambda info: _front_end_stdin(ip))
    if os.environ.get("GPUPOOL_MEMORY_LIMIT") and "torch" not in sys.modules:
        sys.meta_path.insert(0, _AfterImport("torch", _cap_torch_memory))


#: The prompt of an ``input_request`` that asks the notebook kernel to run a
#: ``%gpu`` line (followed by JSON ``{"line": ...}``); the gpupool kernel
#: answers it itself with JSON ``{"ok": bool, "message": str}`` and never
#: shows it to the user (docs/api.md, "Worker magics").
MAGIC_PROMPT = "\x00gpupool-magic:"
#: Metadata key of a forwarded ``execute_request``: the front end's own
#: ``allow_stdin`` (the request itself always allows stdin, for MAGIC_PROMPT).
STDIN_KEY = "gpupool_allow_stdin"


def notebook_magic(ip, line: str) -> None:
    """``%gpu LINE`` in a cell on the worker: the notebook kernel runs it (its
    output shows in the cell, in order) and says whether it worked; raises
    UsageError with its words when not. It travels as an ``input_request``
    because the worker's shell channel is busy with this very cell."""
    from IPython.core.error import UsageError

    kernel = ip.kernel
    saved, kernel._allow_stdin = kernel._allow_stdin, True
    try:
        answer = kernel.raw_input(MAGIC_PROMPT + json.dumps({"line": line}))
    finally:
        kernel._allow_stdin = saved
    try:
        result = json.loads(answer)
    except ValueError:
        raise UsageError("%gpu on the worker needs the notebook's gpupool kernel to answer it") from None
    if not result.get("ok"):
        raise UsageError(result.get("message") or "%gpu failed")


def _front_end_stdin(ip) -> None:
    """Before a forwarded cell: ``input()`` is allowed only if the front end
    allowed it (a forwarded request always allows stdin, see STDIN_KEY)."""
    metadata = (ip.kernel.get_parent("shell") or {}).get("metadata") or {}
    if STDIN_KEY in metadata:
        ip.kernel._allow_stdin = bool(metadata[STDIN_KEY])


def user_variables(ip) -> dict[str, Any]:
    """The user's own names in the worker: no ``_private`` names, no names
    IPython put there itself (``In``, ``Out``, ``exit``...), no modules."""
    hidden = ip.user_ns_hidden
    return {name: value for name, value in ip.user_ns.items()
            if not name.startswith("_") and name not in hidden and not isinstance(value, types.ModuleType)}


def user_modules(ip) -> dict[str, str]:
    """The modules the user imported into the worker's namespace, as
    ``{name: module name}`` (``{"np": "numpy"}``), so that they come back as
    imports, not as values."""
    hidden = ip.user_ns_hidden
    return {name: value.__name__ for name, value in ip.user_ns.items()
            if isinstance(value, types.ModuleType) and not name.startswith("_") and name not in hidden}


def _serve(ip, comm, msg, plane=None) -> None:
    """Answer one request (the comm's open message) and close the comm.
    ``plane``: the worker's data plane (:mod:`.worker_dataplane`), which
    carries big buffers when the request has a ``stream`` ticket."""
    data = msg["content"]["data"]
    op = data.get("op")
    try:
        if op == "push":
            buffers = worker_dataplane.pushed_buffers(plane, data) if data.get("stream") else msg.get("buffers") or []
            values, errors = load_values(data["header"], buffers)
            errors.update(place_on_devices(values, data.get("devices") or {}))
            ip.user_ns.update(values)
            comm.send({"ok": True, "loaded": sorted(values), "errors": errors})
        elif op in ("pull", "pull_all"):
            header, buffers = worker_dataplane.offer_pull(plane, data, *_pull(ip, data))
            comm.send({"ok": True, "header": header}, buffers=buffers)
        elif op in REMOTING_OPS:
            comm.send(REMOTING_OPS[op](ip, data))
        else:
            comm.send({"ok": False, "message": f"unknown transfer op {op!r}"})
    except worker_dataplane.TransferError as exc:  # its words are for the user as they are
        comm.send({"ok": False, "message": str(exc)})
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
        widgets = [name for name, value in values.items() if _is_widget(value)]
        missing.update({name: "widget: stays on the worker" for name in widgets})
        values = {name: value for name, value in values.items() if name not in widgets}
    limit = data.get("max_bytes")
    if limit:  # leave what surely exceeds the cap before copying it to host memory
        values, missing = _within(values, int(limit), missing)
    moved = {name: to_cpu_with_device(value) for name, value in values.items()}
    header, buffers = dump_values({name: value for name, (value, _) in moved.items()})
    for item in header["items"]:  # the client remembers it, so the next attach moves it back
        item["device"] = moved[item["name"]][1]
    header["errors"].update(missing)
    if limit:
        header, buffers = _cap(header, buffers, int(limit))
    if data["op"] == "pull_all":
        header["modules"] = user_modules(ip)
    return header, buffers


def _is_widget(value: Any) -> bool:
    """An ipywidgets widget: its state lives in the front end, it cannot move."""
    widgets = sys.modules.get("ipywidgets")
    return widgets is not None and isinstance(value, widgets.Widget)


def _within(values: dict[str, Any], limit: int, errors: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """``values`` whose known sizes fit ``limit`` in order (unknown sizes pass:
    :func:`_cap` checks them after pickling); the rest go to ``errors``."""
    kept, total, errors = {}, 0, dict(errors)
    for name, value in values.items():
        size = known_nbytes(value)
        if size is not None and total + size > limit:
            errors[name] = f"{type(value).__name__} left on the worker: over the transfer size cap"
            continue
        kept[name] = value
        total += size or 0
    return kept, errors


def known_nbytes(value: Any) -> int | None:
    """Bytes of an array-like's data without copying it (NumPy and CuPy
    ``nbytes``; PyTorch tensors, and modules as the sum of their parameters and
    buffers), or None when not known up front."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.nn.Module):
        return sum(t.element_size() * t.nelement() for t in itertools.chain(value.parameters(), value.buffers()))
    if torch is not None and isinstance(value, torch.Tensor):
        return value.element_size() * value.nelement()
    size = getattr(value, "nbytes", None)
    return size if isinstance(size, int) else None


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


# -- remoting ops: device memory, namespace and version checks (issue 6) ------------


def _framework(value: Any) -> str:
    return type(value).__module__.split(".")[0]


def device_of(value: Any) -> str | None:
    """The accelerator ``value`` lives on, or None for CPU values and
    everything without a device: ``"cuda:0"`` for a PyTorch tensor or module
    (its first parameter's device) and for any object with a ``device``
    attribute and a ``to(device)`` method (the duck type tests use without a
    GPU); ``"cupy:cuda:N"`` for a CuPy array; ``"jax:PLATFORM:N"`` for a JAX
    array on an accelerator. The prefix says which library puts it back."""
    if _framework(value) == "cupy" and hasattr(value, "get"):
        return f"cupy:cuda:{value.device.id}"
    if _framework(value) in ("jax", "jaxlib") and callable(getattr(value, "devices", None)):
        first = next(iter(value.devices()))
        return None if first.platform == "cpu" else f"jax:{first.platform}:{first.id}"
    torch = sys.modules.get("torch")
    device: Any = None
    if torch is not None and isinstance(value, torch.nn.Module):
        first = next(itertools.chain(value.parameters(), value.buffers()), None)
        device = None if first is None else first.device
    elif callable(getattr(value, "to", None)) and not isinstance(value, type):
        device = getattr(value, "device", None)
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
    if library == "cupy":
        import cupy

        with cupy.cuda.Device(int(where.rpartition(":")[2])):
            return cupy.asarray(value)
    if library == "jax":
        import jax

        platform, _, index = where.partition(":")
        return jax.device_put(value, next(d for d in jax.devices(platform) if d.id == int(index)))
    return value.to(device)  # PyTorch raises itself when CUDA is missing


def _have(ip, data: dict[str, Any]) -> dict[str, Any]:
    """Op ``have``: which of ``data["names"]`` the worker's namespace holds."""
    return {"ok": True, "have": [n for n in data.get("names", []) if n in ip.user_ns]}


def _versions(ip, data: dict[str, Any]) -> dict[str, Any]:
    """Op ``versions``: Python and key package versions (see package_versions)."""
    return {"ok": True, "versions": package_versions()}


def _attach(ip, data: dict[str, Any]) -> dict[str, Any]:
    """Op ``attach``, sent once by the gpupool kernel when it attaches: take
    the notebook's execution count (so prompts, ``Out[n]`` and tracebacks'
    ``Cell In[n]`` agree) and its working directory (:func:`enter_workdir`).
    Answers ``{"ok", "cwd", "notebook_dir": bool}``."""
    if isinstance(data.get("execution_count"), int):
        ip.execution_count = data["execution_count"]
    cwd, followed = enter_workdir(data.get("cwd"), data.get("user") or "user")
    return {"ok": True, "cwd": cwd, "notebook_dir": followed}


def enter_workdir(path: str | None, user: str) -> tuple[str, bool]:
    """Change into the notebook's folder ``path`` when this node sees it and
    this worker's account may enter and read it (shared home); else into a
    scratch folder of ``user``'s own under ``GPUPOOL_SCRATCH_DIR`` (default:
    the system temp dir's ``gpupool-scratch``), made 0700. Tried as the
    worker's own account, so the permission check is the kernel's own.
    Returns ``(folder now current, whether it is the notebook's)``."""
    if path and os.path.isdir(path) and os.access(path, os.R_OK | os.X_OK):
        os.chdir(path)
        return path, True
    import re
    import tempfile

    root = os.environ.get("GPUPOOL_SCRATCH_DIR") or os.path.join(tempfile.gettempdir(), "gpupool-scratch")
    if not os.path.isdir(root):  # shared by every worker account of the node, like /tmp (sticky)
        os.makedirs(root, exist_ok=True)
        os.chmod(root, 0o1777)
    scratch = os.path.join(root, re.sub(r"[^A-Za-z0-9._-]", "_", user) or "user")
    os.makedirs(scratch, mode=0o700, exist_ok=True)
    os.chdir(scratch)
    return scratch, False


REMOTING_OPS = {"have": _have, "versions": _versions, "attach": _attach}


# -- binding a warm worker to its lease (docs/enforcement.md, "Binding a worker to its GPUs") --

#: cuDeviceGetCount's answer before cuInit (CUDA driver API, CUresult).
_CUDA_ERROR_NOT_INITIALIZED = 3


def bind(env: dict[str, str]) -> None:
    """Bind this worker, started warm (no GPU visible), to a lease's slice.

    Called once by the agent, through a silent ``execute_request``, before the
    lease's owner gets the connection. ``env``: the slice's variables
    (:func:`gpupool.provisioner.enforcement.slice_environment`), put into
    ``os.environ``; CUDA reads ``CUDA_VISIBLE_DEVICES`` and the MPS limits
    when it initialises, so they bind as if the process had started with
    them. The PyTorch memory cap is armed as for a cold worker: on import, or
    at CUDA's lazy initialisation when ``torch`` was preloaded.

    Raises RuntimeError, changing nothing, when the worker is already bound
    (a warm worker serves one lease) or when CUDA is already initialised in
    this process (the variables would no longer hold).
    """
    bound = os.environ.get("GPUPOOL_LEASE_ID")
    if bound:
        raise RuntimeError(f"this worker is already bound to lease {bound}")
    if cuda_initialised():
        raise RuntimeError("CUDA is already initialised in this worker: it can no longer be bound to a GPU")
    os.environ.update(env)
    if not env.get("GPUPOOL_MEMORY_LIMIT"):
        return
    torch = sys.modules.get("torch")
    if torch is None:
        sys.meta_path.insert(0, _AfterImport("torch", _cap_torch_memory))
    else:
        _cap_torch_at_cuda_init(torch)


def cuda_initialised() -> bool:
    """True when CUDA was initialised in this process: PyTorch says so, or
    the CUDA driver library is loaded and answers anything but
    CUDA_ERROR_NOT_INITIALIZED (covers JAX, CuPy, TensorFlow alike)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    import ctypes

    try:  # RTLD_NOLOAD: only a library this process loaded already; never loads it
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    count = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED


def _cap_torch_at_cuda_init(torch) -> None:
    """Set the cap when PyTorch initialises CUDA, not now: initialising it at
    bind time would cost every lease a CUDA context, used or not.
    ``torch.cuda._lazy_call`` (private, used by ``torch.cuda.manual_seed``)
    queues the call for ``torch.cuda._lazy_init``."""
    try:
        torch.cuda._lazy_call(lambda: _cap_torch_memory(torch))
    except Exception:  # an older or newer PyTorch without it: no cap, as for raw CUDA
        log.warning("could not arm the PyTorch memory cap", exc_info=True)


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
