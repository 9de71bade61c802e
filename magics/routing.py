"""Which side of an attached gpupool kernel answers what (pure rules): the
cells and comms that stay in the notebook kernel, and the request fields
checked before a request is forwarded."""

from __future__ import annotations

import ast
import re
from typing import Any, Collection

#: A help cell, IPython's ``obj?``, ``obj??``, ``?obj``: the object's dotted name.
_HELP = re.compile(r"\s*(?:\?\??)?\s*([A-Za-z_][\w.]*)\s*(?:\?\??)?\s*")

#: Comm targets of the notebook kernel itself; every other comm is the worker's.
OWN_TARGET_PREFIX = "gpupool."


def forwarded_code(code: str) -> str | None:
    """The code an attached kernel runs on the worker for cell ``code``, or
    None when the cell runs here: a ``%%local`` cell, or only ``%gpu`` lines
    (and blanks and comments). A ``%%gpu`` cell runs its body there."""
    lines = [line.strip() for line in code.splitlines() if line.strip() and not line.strip().startswith("#")]
    if not lines or lines[0].startswith("%%local"):
        return None
    if lines[0] == "%%gpu":
        return code.lstrip().partition("\n")[2]
    if lines[0].startswith("%%gpu"):  # %%gpu AMOUNT while attached: the magic says why not
        return None
    if all(line == "%gpu" or line.startswith("%gpu ") for line in lines):
        return None
    return code


def gpu_lines(source: str) -> list[str]:
    """The ``%gpu`` lines of ``source``, a cell as IPython transformed it
    (``%gpu release`` is ``get_ipython().run_line_magic('gpu', 'release')``
    there, wherever it stands: in a loop too, but not in a string), in order;
    [] when ``source`` is no Python (the worker then says what is wrong)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "run_line_magic" and len(node.args) >= 2 \
                and all(isinstance(arg, ast.Constant) and isinstance(arg.value, str) for arg in node.args[:2]) \
                and node.args[0].value == "gpu":
            found.append((node.lineno, node.col_offset, node.args[1].value))
    return [line for _, _, line in sorted(found)]


def help_target(code: str) -> str | None:
    """The object ``code`` asks help for (``np.arange?`` -> ``np.arange``), or
    None when it is no help cell. IPython turns such a cell into a magic call
    with the name in a string, which no scan of the names a cell reads sees;
    the gpupool kernel sends the object's root along first, as for any cell
    that reads a local name."""
    match = _HELP.fullmatch(code)
    if match is None or "?" not in code:
        return None
    return match.group(1)


#: An object's name, then the attribute or item being completed after it (``data.sh``, ``data['k``).
_COMPLETED = re.compile(r"(?<![\w.\]])([^\W\d]\w*)(?:\s*\.\s*\w*|\s*\[[^\[\]]*\]?)+$")


def completed_object(code: str, cursor_pos: int) -> str | None:
    """The name of the object whose attribute or item a completion at ``cursor_pos``
    in ``code`` asks for (``localdata['`` -> ``localdata``); None for a plain name.
    Only the cursor's line is read: the search then costs a line's length, not the cell's."""
    match = _COMPLETED.search(code[:cursor_pos].rpartition("\n")[2])
    return match.group(1) if match else None


def comm_for_worker(msg: dict[str, Any], own_comms: Collection[str]) -> bool:
    """Whether the front end's comm message ``msg`` is the worker's (while
    attached): a ``comm_open`` of a target not gpupool's own, a
    ``comm_msg``/``comm_close`` of a comm not among ``own_comms`` (ids)."""
    msg_type = (msg.get("header") or {}).get("msg_type")
    content = msg.get("content") or {}
    if msg_type == "comm_open":
        return not str(content.get("target_name", "")).startswith(OWN_TARGET_PREFIX)
    return msg_type in ("comm_msg", "comm_close") and content.get("comm_id") not in own_comms


def malformed(content: dict[str, Any], fields: tuple[str, ...]) -> str:
    """Words for what is wrong with a request's ``fields`` ("" when nothing):
    ``code`` must be a string, ``cursor_pos`` a whole number."""
    for name in fields:
        value = content.get(name)
        kind = str if name == "code" else int
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{name} must be {'a string' if kind is str else 'a whole number'}, not {value!r}"
    return ""
