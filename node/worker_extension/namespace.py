"""The worker's variables as a pull sends them: the user's own names, on the
CPU, within the request's size cap, modules as imports (and, for a spill or a
move, the cells' results, ``Out[n]``); and such a pull restored into another
worker (a spill's, a move's)."""

from __future__ import annotations

import importlib
import itertools
import os
import sys
import types
from typing import Any

from gpupool.transfer import dump_values, load_values, output_count
from gpupool.wire.transfer import Pull, Pulling, PullAll

from .devices import place_on_devices, to_cpu_with_device


def user_variables(ip) -> dict[str, Any]:
    """The user's own names in the worker: no ``_private`` names, no names
    IPython put there itself (``In``, ``Out``, ``exit``...), no modules."""
    hidden = ip.user_ns_hidden
    return {name: value for name, value in ip.user_ns.items()
            if not name.startswith("_") and name not in hidden and not isinstance(value, types.ModuleType)}


def user_outputs(ip) -> dict[str, Any]:
    """The results the worker's cells showed, as their ``_n`` names: ``{"_3": Out[3]}``."""
    return {f"_{count}": value for count, value in ip.history_manager.output_hist.items()
            if not _is_widget(value)}


def user_modules(ip) -> dict[str, str]:
    """The modules the user imported into the worker's namespace, as
    ``{name: module name}`` (``{"np": "numpy"}``), so that they come back as
    imports, not as values."""
    hidden = ip.user_ns_hidden
    return {name: value.__name__ for name, value in ip.user_ns.items()
            if isinstance(value, types.ModuleType) and not name.startswith("_") and name not in hidden}


def pull_header(ip, request: Pulling) -> tuple[dict[str, Any], list]:
    """The transfer header and buffers (:func:`gpupool.transfer.dump_values`)
    for a :class:`~gpupool.wire.transfer.Pull` of its names or a ``PullAll``,
    within its ``max_bytes`` when given; each item says the device it came off."""
    missing: dict[str, str] = {}
    if isinstance(request, Pull):
        names = request.names
        values = {n: ip.user_ns[n] for n in names if n in ip.user_ns}
        missing = {n: "not defined on the worker" for n in names if n not in ip.user_ns}
    else:
        values = user_variables(ip)
        widgets = [name for name, value in values.items() if _is_widget(value)]
        missing.update({name: "widget: stays on the worker" for name in widgets})
        values = {name: value for name, value in values.items() if name not in widgets}
        if isinstance(request, PullAll) and request.outputs:
            values.update(user_outputs(ip))
    limit = request.max_bytes
    if limit:  # leave what surely exceeds the cap before copying it to host memory
        values, missing = _within(values, int(limit), missing)
    moved = {name: to_cpu_with_device(value) for name, value in values.items()}
    header, buffers = dump_values({name: value for name, (value, _) in moved.items()})
    for item in header["items"]:  # the client remembers it, so the next attach moves it back
        item["device"] = moved[item["name"]][1]
    header["errors"].update(missing)
    if limit:
        header, buffers = _cap(header, buffers, int(limit))
    if isinstance(request, PullAll):
        header["modules"] = user_modules(ip)
        header["cwd"] = os.getcwd()  # where the cells left it (%cd): a release follows it where it can
    return header, buffers


def restore(ip, header: dict[str, Any], buffers: list) -> dict[str, Any]:
    """Load a ``pull_all``'s ``header`` and ``buffers`` (:func:`pull_header`,
    from another worker) into ``ip``'s namespace: values back on their
    devices where this worker has them, modules imported. Answers ``{"ok",
    "loaded", "errors"}`` (``{name: why}`` for each that did not come back
    as it was; what the pull itself left behind is the sender's to say)."""
    values, errors = load_values({"items": header.get("items", [])}, buffers)
    devices = {item["name"]: item["device"] for item in header.get("items", []) if item.get("device")}
    errors.update(place_on_devices(values, devices))
    for name, module in header.get("modules", {}).items():
        try:
            values[name] = importlib.import_module(module)
        except Exception as exc:  # not installed where it lands
            errors[name] = f"module {module} cannot be imported: {exc}"
    ip.user_ns.update(values)
    for name, value in values.items():  # a result of the old worker's cells: its Out[n] here too
        count = output_count(name)
        if count is not None:
            ip.history_manager.output_hist[count] = value
    return {"ok": True, "loaded": sorted(values), "errors": errors}


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
