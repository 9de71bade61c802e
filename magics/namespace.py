"""Which local names a routed cell needs: "the namespace follows the user".

Before a cell runs on the worker, the client sends along the values the cell
reads (and does not bind itself first) that exist only in the local kernel (defined before ``%gpu acquire``,
brought back by a release, or made in a ``%%local`` cell). This module
finds the candidates from the cell's source; the worker says which of them
it already has (the ``have`` op of :mod:`gpupool.node.worker_extension`), and
only the rest travel.
"""

from __future__ import annotations

import ast
import builtins
import re
import symtable
from typing import Any

from IPython.core.inputtransformer2 import TransformerManager

# IPython's own names in every user namespace; never user state.
_SHELL_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "display"}

#: A word that may be a Python identifier (every name a cell reads is one of its words).
_WORD = re.compile(r"[^\W\d]\w*")


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
        source, tree = _python(cell)
        table = symtable.symtable(source, "<cell>", "exec")
    except (SyntaxError, ValueError):
        return list(found)
    _collect(table, found, top=True)
    # ``X += 1`` reads X, though the symbol table counts it as assigned only.
    top = {symbol.get_name() for symbol in table.get_symbols()}
    found.update(dict.fromkeys(name for name in _augmented(tree) if name in top))
    # A name the cell imports itself at top level is the worker's own import; one it binds before
    # reading it (X = ..., def f) is the worker's own value.
    made = {symbol.get_name() for symbol in table.get_symbols() if symbol.is_imported()} | bound_first(tree)
    # get_ipython: IPython's translation of magics calls it, and every kernel has it.
    return [name for name in found
            if not hasattr(builtins, name) and name not in made and name != "get_ipython"]


def names_bound(cell: str) -> set[str]:
    """Global names ``cell`` binds at top level (assigned, imported, defined, deleted), after
    IPython's translation; none for a cell that does not parse."""
    try:
        source, _ = _python(cell)
        table = symtable.symtable(source, "<cell>", "exec")
    except (SyntaxError, ValueError):
        return set()
    return {symbol.get_name() for symbol in table.get_symbols() if symbol.is_assigned() or symbol.is_imported()}


def _python(cell: str) -> tuple[str, ast.Module]:
    """``cell`` as Python, and its syntax tree: IPython's translation only
    when it is not plain Python (valid Python is never translated, and the
    translation is the slow part). Raises SyntaxError or ValueError."""
    try:
        return cell, ast.parse(cell)
    except SyntaxError:
        source = _TRANSLATOR.transform_cell(cell)
        return source, ast.parse(source)


def bound_first(tree: ast.Module) -> set[str]:
    """Top-level names the cell of ``tree`` binds unconditionally before it reads
    them (``X = np.ones(3)`` then ``print(X)``; ``def f`` then ``f()``): the
    cell makes them itself, so a local value of that name is not sent.
    Conservative: only plain assignments and ``def``/``class`` at top level
    bind (not ``if``, ``for``, ``with`` or ``try`` bodies, which may not
    run), and a name read anywhere in a statement before the one that binds
    it (in a function body too, or ``X = X + 1``) is read first."""
    bound: set[str] = set()
    read: set[str] = set()
    for statement in tree.body:
        read |= {node.id for node in ast.walk(statement)
                 if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store)} - bound
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(statement.name)
        elif isinstance(statement, ast.Assign) or isinstance(statement, ast.AnnAssign) and statement.value:
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            bound |= {name for target in targets for name in _plain_targets(target)}
    return bound - read


def _augmented(tree: ast.Module) -> list[str]:
    """Names ``tree`` updates in place (``X += 1``), anywhere: the caller keeps
    the top-level ones (at top level, or a function's ``global``), which are
    read before they are written."""
    return [node.target.id for node in ast.walk(tree)
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name)]


def _plain_targets(target: ast.expr) -> list[str]:
    """The names an assignment target binds outright (``a``, ``a, *b``); not ``a[0]`` or ``a.b``."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Starred):
        return _plain_targets(target.value)
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in _plain_targets(element)]
    return []


def _collect(table: symtable.SymbolTable, found: dict[str, None], top: bool) -> None:
    for symbol in table.get_symbols():
        if symbol.is_referenced() and (top or symbol.is_global()):
            found.setdefault(symbol.get_name(), None)
    for child in table.get_children():
        _collect(child, found, top=False)


def local_candidates(cell: str, user_ns: dict[str, Any], hidden: dict[str, Any]) -> list[str]:
    """Names ``cell`` reads that the local namespace holds as user state:
    not ``_private``, not put there by IPython (``user_ns_hidden``), not
    the shell's own helpers. A cell none of whose words is such a name reads
    none of them, and is not parsed (most cells, once the state lives on the
    worker). The cell's words are looked up, not the namespace walked: it
    grows at every cell (IPython's ``_i<N>``), and this runs before each one."""
    held = [name for name in dict.fromkeys(_WORD.findall(cell))
            if name in user_ns and not name.startswith("_") and name not in hidden and name not in _SHELL_NAMES]
    if not held:
        return []
    return [name for name in names_read(cell) if name in held]
