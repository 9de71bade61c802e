"""GPUPoolError's parts: the reason code (an enum, the wire's ``"error"``),
the user message, the log message, the status; and the codes' table in docs/api.md."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from gpupool.errors import GPUPoolError, Reason, bad_request, not_found

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("gpupool", "node", "hub_plugin", "magics")


def _constructions() -> list[tuple[str, ast.expr]]:
    """``(where, first argument)`` of every ``GPUPoolError(...)`` and, in a class
    deriving from it, every ``super().__init__(...)`` in the shipped code."""
    found = []
    for package in SHIPPED:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            subclasses = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                          and any(isinstance(base, ast.Name) and base.id == "GPUPoolError" for base in node.bases)]
            inits = {id(call) for cls in subclasses for call in ast.walk(cls) if _calls(call, "__init__")}
            for node in ast.walk(tree):
                if _calls(node, "GPUPoolError") or id(node) in inits:
                    found.append((f"{path.relative_to(ROOT)}:{node.lineno}", node.args[0]))
    return found


def _calls(node: ast.AST, name: str) -> bool:
    """Whether ``node`` is a call with arguments of ``name`` or ``something.name``."""
    if not (isinstance(node, ast.Call) and node.args):
        return False
    func = node.func
    return (func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else "") == name


def test_every_error_the_code_base_raises_names_a_reason_member():
    constructions = _constructions()
    assert len(constructions) > 50
    literal = [where for where, arg in constructions if isinstance(arg, ast.Constant)]
    assert not literal, f"use a Reason member, not a string: {literal}"
    named = {arg.attr for _, arg in constructions
             if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "Reason"}
    assert named <= set(Reason.__members__)


def test_docs_table_of_codes_is_the_enum():
    text = (ROOT / "docs" / "api.md").read_text()
    section = text.split("## Error codes", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert documented == [reason.value for reason in Reason]


def test_a_reason_is_its_string_on_the_wire():
    error = GPUPoolError(Reason.pool_full, "no GPU is free", 409, reasons={"not enough free fraction": 2})
    assert error.code == "pool_full" and error.code is Reason.pool_full
    assert json.dumps(error.to_json()) == ('{"error": "pool_full", "message": "no GPU is free", '
                                           '"reasons": {"not enough free fraction": 2}}')
    assert f"{error.code}" == "pool_full" and str(error) == "no GPU is free"
    assert (bad_request("no").code, not_found("lease L-1").status) == (Reason.bad_request, 404)


def test_from_json_keeps_a_known_code_as_its_member_and_an_unknown_one_as_it_came():
    known = GPUPoolError.from_json(429, {"error": "quota_exceeded", "message": "too many", "limit": "max_gpus"})
    assert known.code is Reason.quota_exceeded and known.status == 429 and known.extra == {"limit": "max_gpus"}
    newer = GPUPoolError.from_json(409, {"error": "budget_spent", "message": "this month's budget is spent"})
    assert newer.code == "budget_spent" and not isinstance(newer.code, Reason)
    assert newer.message == "this month's budget is spent" and newer.status == 409
    assert newer.to_json() == {"error": "budget_spent", "message": "this month's budget is spent"}
    assert GPUPoolError.from_json(502, {}).to_json() == {"error": "error", "message": "unknown error"}


def test_from_json_of_a_body_that_is_not_ours_never_raises():
    """JupyterHub's 404 (``{"status": 404, "message": null}``) once raised TypeError
    (``status`` given twice); what is not text or not a name is left out."""
    from gpupool.errors import is_error_body

    hub = GPUPoolError.from_json(404, {"status": 404, "message": None})
    assert (hub.code, hub.message, hub.status, hub.extra) == ("error", "unknown error", 404, {})
    odd = GPUPoolError.from_json(502, {"error": 7, "message": ["x"], "log_message": "y", "a b": 1, "hint": "h"})
    assert (odd.code, odd.message, odd.extra, odd.log_message) == ("error", "unknown error", {"hint": "h"},
                                                                   "unknown error")
    assert not is_error_body({"status": 404, "message": None}) and not is_error_body(["error", "message"])
    assert is_error_body(GPUPoolError(Reason.not_found, "lease L-1 not found", 404).to_json())


def test_the_log_message_defaults_to_the_user_message_and_never_goes_on_the_wire():
    plain = GPUPoolError(Reason.not_configured, "set --service-url")
    assert plain.log_message == "set --service-url"
    detailed = GPUPoolError(Reason.store_busy, "the pool's database is busy", 503,
                            log_message="store busy: database is locked")
    assert detailed.log_message == "store busy: database is locked" and detailed.message != detailed.log_message
    assert "log_message" not in detailed.to_json() and "locked" not in json.dumps(detailed.to_json())


@pytest.mark.parametrize("reply, words", [
    ({"error": "no_inventory", "message": "NVML could not start"}, "NVML could not start"),
    ({}, "the agent at http://node-1:8766/workers answered HTTP 500"),
])
def test_an_agent_failure_tells_the_user_the_reason_and_the_log_the_call(reply, words):
    from gpupool.hub_plugin.agent_client import _failed

    error = _failed(Reason.worker_start_failed, "POST", "http://node-1:8766/workers", 500, reply)
    assert (error.code, error.status, error.message) == (Reason.worker_start_failed, 502, words)
    assert error.log_message.startswith("POST http://node-1:8766/workers -> HTTP 500") and words in error.log_message
