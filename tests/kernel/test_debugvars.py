"""The CPU kernel's names in the worker's debugger replies (gpupool.magics.debugvars): which replies
gain them, marked, and which do not; the debugger messages are DAP's, as JupyterLab 4 sends them."""

from types import SimpleNamespace

from IPython.core.formatters import DisplayFormatter

from gpupool.magics.debugvars import LocalNames


def shell(**names):
    return SimpleNamespace(user_ns={"In": [], "_": None, **names}, user_ns_hidden={"In": [], "_": None},
                           display_formatter=DisplayFormatter())


def ok(command, body):
    return {"type": "response", "success": True, "command": command, "body": body}


def test_a_stopped_module_frame_lists_the_local_names_in_its_locals_and_globals_only():
    local = LocalNames(shell(cpu_only=3, both=1))
    local.merge({"command": "stackTrace"}, ok("stackTrace", {"stackFrames": [{"id": 7, "name": "<module>"},
                                                                           {"id": 8, "name": "helper"}]}))
    local.merge({"command": "scopes", "arguments": {"frameId": 7}},
                ok("scopes", {"scopes": [{"name": "Locals", "variablesReference": 11},
                                         {"name": "Globals", "variablesReference": 12}]}))
    local.merge({"command": "scopes", "arguments": {"frameId": 8}},
                ok("scopes", {"scopes": [{"name": "Locals", "variablesReference": 21}]}))
    worker = [{"name": "both", "value": "1", "type": "int", "variablesReference": 0}]
    for ref in (11, 12):
        got = local.merge({"command": "variables", "arguments": {"variablesReference": ref}},
                          ok("variables", {"variables": list(worker)}))["body"]["variables"]
        assert [v["name"] for v in got] == ["both", "cpu_only (local)"]
        assert got[1] | {} == {"name": "cpu_only (local)", "evaluateName": "cpu_only", "value": "3", "type": "int",
                               "variablesReference": 0, "presentationHint": {"kind": "data",
                                                                             "attributes": ["readOnly"]}}
    inner = local.merge({"command": "variables", "arguments": {"variablesReference": 21}},
                        ok("variables", {"variables": list(worker)}))
    assert [v["name"] for v in inner["body"]["variables"]] == ["both"], "a function's locals are its own"
    local.merge({"command": "continue"}, ok("continue", {}))
    again = local.merge({"command": "variables", "arguments": {"variablesReference": 12}},
                        ok("variables", {"variables": list(worker)}))
    assert [v["name"] for v in again["body"]["variables"]] == ["both"], "after continue the references are stale"


def test_failed_replies_pass_unchanged_and_only_marked_names_are_rendered_here():
    local = LocalNames(shell(table={"a": 1}))
    failed = {"type": "response", "success": False, "command": "inspectVariables", "message": "not started"}
    assert local.merge({"command": "inspectVariables"}, dict(failed)) == failed
    assert local.rich_inspect({"command": "richInspectVariables", "arguments": {"variableName": "table"}}) is None
    rich = local.rich_inspect({"command": "richInspectVariables", "seq": 4,
                               "arguments": {"variableName": "table (local)"}})
    assert rich["success"] and rich["request_seq"] == 4 and rich["body"]["data"]["text/plain"] == "{'a': 1}"
    gone = local.rich_inspect({"command": "richInspectVariables", "arguments": {"variableName": "x (local)"}})
    assert not gone["success"] and "no longer defined" in gone["message"]
