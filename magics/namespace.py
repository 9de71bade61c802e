"""Which local names a routed cell needs: "the namespace follows the user".

Before a cell runs on the worker, the client sends along the values the cell
reads that exist only in the local kernel (defined before ``%gpu acquire``,
brought back by a release, or made in a ``%%local`` cell). This module
finds the candidates from the cell's source; the worker says which of them
it already has (the ``have`` op of :mod:`gpupool.provisioner.worker_extension`), and
only the rest travel.
"""

from __future__ import annotations

import symtable
import builtins
from typing import Any

from IPython.core.inputtransformer2 import TransformerManager

# IPython's own names in every user namespace; never user state.
_SHELL_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "display"}


#: IPython syntax to Python, without the shell's own transformers (whose routing would wrap the cell).
_TRANSLATOR = TransformerManager()


def names_read(cell: str) -> list[str]:
    """Global names ``cell`` reads: referenced at top level, or free in its
    functions, classes and comprehensions (parameters and locals are left
    out), in a stable order, without Python builtins. IPython syntax
    (``%magic``, ``!cmd``) is translated first with a TransformerManager of its own
    (not the shell's, whose routing transformer would wrap the cell); the body
    of a cell magic (``%%time``) is read too. A cell that does not parse reads
    nothing: it fails on the worker with the worker's SyntaxError, as it would
    locally."""
    found: dict[str, None] = {}
    if cell.lstrip().startswith("%%"):
        found.update(dict.fromkeys(names_read(cell.lstrip().partition("\n")[2])))
    try:
        table = _symbols(cell)
    except (SyntaxError, ValueError):
        return list(found)
    _collect(table, found, top=True)
    # A name the cell imports itself at top level is the worker's own import.
    imported = {symbol.get_name() for symbol in table.get_symbols() if symbol.is_imported()}
    # get_ipython: IPython's translation of magics calls it, and every kernel has it.
    return [name for name in found
            if not hasattr(builtins, name) and name not in imported and name != "get_ipython"]


def _symbols(cell: str) -> symtable.SymbolTable:
    """The cell's symbol table; IPython's translation only when the cell is
    not plain Python (valid Python is never translated, and the translation
    is the slow part). Raises SyntaxError or ValueError."""
    try:
        return symtable.symtable(cell, "<cell>", "exec")
    except SyntaxError:
        return symtable.symtable(_TRANSLATOR.transform_cell(cell), "<cell>", "exec")


def _collect(table: symtable.SymbolTable, found: dict[str, None], top: bool) -> None:
    for symbol in table.get_symbols():
        if symbol.is_referenced() and (top or symbol.is_global()):
            found.setdefault(symbol.get_name(), None)
    for child in table.get_children():
        _collect(child, found, top=False)


def local_candidates(cell: str, user_ns: dict[str, Any], hidden: dict[str, Any]) -> list[str]:
    """Names ``cell`` reads that the local namespace holds as user state:
    not ``_private``, not put there by IPython (``user_ns_hidden``), not
    the shell's own helpers."""
    return [name for name in names_read(cell)
            if name in user_ns and not name.startswith("_") and name not in hidden and name not in _SHELL_NAMES]
