"""One short line for what a release, park or resume moved, grouped.

``brought back 3 variables (x, y, model; 12.0 MiB), 2 modules (np, pd),
1 function (f); lost with the worker: 1 widget (slider), 1 that cannot be
pickled (lock)``: names by kind instead of one entry per variable, so a
namespace of fifty names still fits a line.
"""

from __future__ import annotations

from typing import Any

from gpupool.transfer import COPIED_AS_CONTENTS, output_count, shown_name
from gpupool.units import format_bytes

#: How many names one group lists before "and N more".
SHOWN = 6

#: (words in a transfer error, how the group is called): first match wins.
_LEFT_BEHIND = (
    ("widget", "widget"),
    ("cannot be sent", "that cannot be pickled"),
    ("over the transfer size cap", "over the size cap (c.GPUMagics.release_state_cap)"),
    ("cannot be imported here", "module not installed here"),
    ("cannot be loaded here", "that cannot be loaded here"),
    ("not defined", "not defined on the worker"),
)


def as_outputs(items: list[dict[str, Any]], errors: dict[str, str]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """``items`` and ``errors`` of a pull with the cells' results (``_3``) named ``Out[3]`` and
    marked as outputs, so that a summary groups them apart from variables."""
    named = [{**item, "name": shown_name(item["name"]), "output": True}
             if output_count(item["name"]) is not None else item for item in items]
    return named, {shown_name(name): why for name, why in errors.items()}


def summarize(verb: str, items: list[dict[str, Any]], errors: dict[str, str]) -> str:
    """``"; VERB 3 variables (...), 2 modules (...); lost with the worker: ..."``,
    or ``""`` when nothing moved and nothing was left."""
    parts = []
    moved = _moved_groups(items)
    if moved:
        parts.append(f"{verb} " + ", ".join(moved))
    copied = [f"{item['name']} ({item['type']})" for item in items if item.get("type") in COPIED_AS_CONTENTS]
    if copied:
        parts.append("open files arrived as in-memory copies of what they held, no longer open: " + ", ".join(copied))
    left = _left_groups(errors)
    if left:
        parts.append("lost with the worker: " + ", ".join(left))
    return "; " + "; ".join(parts) if parts else ""


def _moved_groups(items: list[dict[str, Any]]) -> list[str]:
    groups: dict[str, list[dict[str, Any]]] = {"variable": [], "module": [], "function": [], "class": [],
                                               "output": []}
    for item in items:
        kind = "output" if item.get("output") else \
            {"module": "module", "function": "function", "type": "class"}.get(item.get("type", ""), "variable")
        groups[kind].append(item)
    out = []
    for kind, members in groups.items():
        if not members:
            continue
        size = sum(i.get("nbytes", 0) for i in members) if kind in ("variable", "output") else 0
        extra = (f"; {format_bytes(size)}" if size else "") + _devices(members)
        out.append(_group(kind, [i["name"] for i in members], extra))
    return out


def _devices(items: list[dict[str, Any]]) -> str:
    """``"; on_gpu, model were on cuda:0"``: the values that came off an accelerator."""
    by_device: dict[str, list[str]] = {}
    for item in items:
        if item.get("device"):
            by_device.setdefault(item["device"], []).append(item["name"])
    return "".join(f"; {', '.join(names)} {'was' if len(names) == 1 else 'were'} on {device}"
                   for device, names in by_device.items())


def _left_groups(errors: dict[str, str]) -> list[str]:
    groups: dict[str, list[str]] = {}
    for name, why in errors.items():
        label = next((label for words, label in _LEFT_BEHIND if words in why), why)
        groups.setdefault(label, []).append(name)
    return [_group(label, names) for label, names in groups.items()]


def _group(kind: str, names: list[str], extra: str = "") -> str:
    shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
    plural = len(names) != 1 and kind in ("variable", "module", "function", "class", "widget", "output")
    noun = {"class": "classes"}.get(kind, kind + "s") if plural else kind
    return f"{len(names)} {noun} ({shown}{extra})"
