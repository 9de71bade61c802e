"""The CPU kernel's own names in the debugger's Variables panel while attached.

The debugger runs on the worker (:meth:`~gpupool.magics.kernel.GPUPoolKernel.debug_request`
forwards its requests), so its Variables panel lists the worker's names only,
while Tab also offers the names that are still only here (a cell reading one
sends it along first). :class:`LocalNames` adds those to the worker's answers
where the debugger protocol lets a kernel list variables of its own:

- ``inspectVariables`` (JupyterLab's Variables panel while no breakpoint
  stopped the cell: the kernel's globals);
- ``variables`` of the ``Globals`` scope of a stopped frame, and of the
  ``Locals`` scope of a cell's module-level frame (``<module>``, whose locals
  are its globals): the scopes JupyterLab shows first.

Each is marked: its name is ``NAME (local)`` (``evaluateName`` the name
itself), it cannot be expanded (``variablesReference`` 0: its children are in
this process, which the worker's debugger cannot walk), and the panel's
"render variable" (``richInspectVariables``) of a marked name is answered
here, from this kernel's namespace. Evaluating a marked name in the debug
console (``evaluate``) runs on the worker, where it is not defined: the
protocol has no way to send one expression to two processes.
"""

from __future__ import annotations

import reprlib
from typing import Any

#: What a name of this kernel's is marked with in the Variables panel.
MARK = " (local)"
#: Frame-stepping commands after which the scopes' references mean nothing any more.
_MOVES = ("continue", "next", "stepIn", "stepOut", "pause", "disconnect", "terminate")
_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlist = 200, 200, 20


class LocalNames:
    """Adds the names of ``shell`` (the notebook kernel's IPython) that the
    worker lacks to the worker's debugger replies (see the module's words)."""

    def __init__(self, shell) -> None:
        self.shell = shell
        self._frames: dict[int, str] = {}  # frame id -> its name, from the last stackTrace
        self._global_refs: set[int] = set()  # variablesReference of scopes whose variables are globals

    def names(self) -> dict[str, Any]:
        """This kernel's user names (not IPython's own, not ``_``-prefixed)."""
        hidden = self.shell.user_ns_hidden
        return {name: value for name, value in self.shell.user_ns.items()
                if not name.startswith("_") and name not in hidden}

    def merge(self, request: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
        """The worker's ``debug_reply`` content ``reply`` to ``request`` (a DAP
        request's content), with this kernel's names added where they belong."""
        command, arguments = request.get("command"), request.get("arguments") or {}
        body = reply.get("body") if isinstance(reply.get("body"), dict) else None
        if command in _MOVES:
            self._frames.clear()
            self._global_refs.clear()
        if not reply.get("success") or body is None:
            return reply
        if command == "stackTrace":
            self._frames = {f.get("id"): str(f.get("name", "")) for f in body.get("stackFrames") or []}
        elif command == "scopes":
            module = self._frames.get(arguments.get("frameId")) == "<module>"
            for scope in body.get("scopes") or []:
                if scope.get("name") == "Globals" or (module and scope.get("name") == "Locals"):
                    self._global_refs.add(scope.get("variablesReference"))
        elif command == "inspectVariables" or (command == "variables" and
                                               arguments.get("variablesReference") in self._global_refs):
            body["variables"] = self._with_local(body.get("variables") or [])
        return reply

    def _with_local(self, variables: list[dict[str, Any]]) -> list[dict[str, Any]]:
        there = {v.get("evaluateName") or v.get("name") for v in variables}
        here = [self._variable(name, value) for name, value in self.names().items() if name not in there]
        return variables + here

    @staticmethod
    def _variable(name: str, value: Any) -> dict[str, Any]:
        try:
            shown = _REPR.repr(value)
        except Exception as exc:  # a __repr__ that raises: say so, as a debugger does
            shown = f"<repr failed: {type(exc).__name__}>"
        return {"name": f"{name}{MARK}", "evaluateName": name, "value": shown, "type": type(value).__name__,
                "variablesReference": 0, "presentationHint": {"kind": "data", "attributes": ["readOnly"]}}

    def rich_inspect(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """The reply to a ``richInspectVariables`` of a marked name, from this
        kernel's namespace (the display formatter's data and metadata); None
        for any other request (the worker answers it)."""
        if request.get("command") != "richInspectVariables":
            return None
        name = str((request.get("arguments") or {}).get("variableName", ""))
        if not name.endswith(MARK):
            return None
        base = name[:-len(MARK)]
        names = self.names()
        reply = {"type": "response", "request_seq": request.get("seq"), "seq": 0, "command": "richInspectVariables"}
        if base not in names:
            return {**reply, "success": False, "message": f"{base} is no longer defined in the notebook's kernel"}
        data, metadata = self.shell.display_formatter.format(names[base])
        return {**reply, "success": True, "body": {"data": data, "metadata": metadata}}
