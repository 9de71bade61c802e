"""The OpenAPI 3.1 document of ``/api/v1`` (served at ``/api/v1/openapi.json``).

The bodies' schemas come from their declarations in :mod:`gpupool.wire`
(``json_schema()``); this module writes the paths, operations, parameters
and errors, mirroring docs/api.md. A test checks that every route the service
serves under ``/api/v1`` appears here.
"""

from __future__ import annotations

import copy
from typing import Any

from gpupool.schema import LeaseState
from gpupool.wire.fields import INK, TEXT, WORDS, ref as _ref
from gpupool.wire.leases import MOST_SECONDS as _MOST_SECONDS, Lease, LeaseRequest
from gpupool.wire.nodes import (GPUInfo, GPUReading, Heartbeat, HeartbeatReply, NodeRegistration, RegistrationReply,
                                WorkerEnvironment, WorkerReport)
from gpupool.wire.parking import CheckpointerInfo
from gpupool.wire.pool import Pool, PoolGPU, PoolNode, PoolTotals
from gpupool.wire.quotas import Limits, Quota, QuotaUsage

from .intake import MAX_START_WAIT_S as _MAX_START_WAIT_S

#: The bodies in ``components.schemas``, each under its class's name.
_BODIES = (LeaseRequest, Lease, NodeRegistration, GPUInfo, WorkerReport, WorkerEnvironment, RegistrationReply,
           Heartbeat, GPUReading, HeartbeatReply, Limits, Quota, QuotaUsage, Pool, PoolNode, PoolGPU, PoolTotals,
           CheckpointerInfo)


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int | tuple[int, str]) -> dict[str, Any]:
    words = {400: "bad input; nothing changed", 401: "missing or unknown token",
             403: "this token may not call this endpoint", 404: "not found (or not yours)",
             409: "the pool cannot take the request now", 415: "the body was not sent as application/json",
             429: "over your quota (quota_exceeded; `limit` names which)", 503: "the store is busy or down; retry"}
    # A code may come as (code, words) where the common words do not fit the operation.
    pairs = [code if isinstance(code, tuple) else (code, words[code]) for code in codes]
    return {str(code): _json(_ref("Error"), said) for code, said in pairs}


def _op(summary: str, ok: dict[str, Any], *, body: dict[str, Any] | None = None, body_required: bool = True,
        errors: tuple = (401,), params: list[dict[str, Any]] | None = None, ok_code: int = 200,
        security: bool = True) -> dict[str, Any]:
    if body is not None:
        errors = (*errors, 415)
    op: dict[str, Any] = {"summary": summary, "responses": {str(ok_code): ok, **_errors(*errors)}}
    if body is not None:
        op["requestBody"] = {"required": body_required, "content": {"application/json": {"schema": body}}}
    if params:
        op["parameters"] = params
    if not security:
        op["security"] = []
    return op


def _param(name: str, where: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path", "schema": schema, "description": description}


#: The body of a request that takes no fields: none, or ``{}`` (a field is refused, 400).
_NO_FIELDS = {"type": "object", "additionalProperties": False, "maxProperties": 0, "description": "no fields: {}"}
_RESUME = {"type": "object", "additionalProperties": False, "properties": {"in_place": {
    "type": "boolean", "description": "asked ahead of a cell (the user is back at the notebook): the lease waits for "
                                      "its own node and never moves, until a resume without it is asked"}}}
_LEASE_ID = _param("id", "path", {"type": "string", "pattern": "^L-[0-9a-f]{12}$"}, "lease id")
#: ``hub_plugin.quotas.check_scope``: ``'*'``, ``'user:NAME'`` or ``'group:NAME'``.
_SCOPE = _param("scope", "path", {"type": "string", "maxLength": 210,
                                  "pattern": f"^(\\*|(user|group):{INK}({TEXT}*{INK})?)$"},
                "'*', 'group:NAME' or 'user:NAME' (NAME without control characters or white space around it)")

_SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error", "message"], "properties": {
        "error": {"type": "string", "description": "machine reason, e.g. pool_full"},
        "message": {"type": "string", "description": "words for a person"}}},
}

_PATHS: dict[str, Any] = {
    "/leases": {
        "post": _op("Ask for a slice or whole GPUs; the capacity is reserved in the same transaction",
                    _json(_ref("Lease"), "the new lease: starting, or queued; with start_wait, active (with its "
                          "connection) or failed once its worker started or could not within that time"),
                    body=_ref("LeaseRequest"), errors=(400, 401, 403, 409, 429, 503), ok_code=201, params=[
                        _param("start_wait", "query", {"type": "number", "minimum": 0, "default": 0},
                               "seconds to wait for a placed lease's worker before answering (at most "
                               f"{_MAX_START_WAIT_S:g} are waited; 0: answer at once)")]),
        "get": _op("Your own leases (every user's for an admin, with all_users)", _json({"type": "object", "properties": {
            "leases": {"type": "array", "items": _ref("Lease")}}}, "your leases, oldest first"),
            errors=(400, 401, 403), params=[
                _param("active", "query", {"type": "string", "enum": ["1", "0", "true", "false"], "default": "1"},
                       "1 (or true): only leases holding or waiting for capacity"),
                _param("kernel_id", "query", {"type": "string"}, "only this kernel's leases"),
                _param("all_users", "query", {"type": "string", "enum": ["1", "0", "true", "false"], "default": "0"},
                       "1 (or true): every user's leases (admins only: 403 otherwise)")]),
    },
    "/leases/{id}": {
        "get": _op("One of your leases; long-polls with wait and state", _json(_ref("Lease"), "the lease"),
                   errors=(400, 401, 403, 404), params=[
                       _LEASE_ID,
                       _param("wait", "query", {"type": "number", "minimum": 0},
                              "seconds to wait for the lease to leave `state` (at most 60 are waited)"),
                       _param("state", "query", {"enum": [s.value for s in LeaseState]},
                              "the state to wait out (default: the current one)")]),
        "delete": _op("Release: stop the worker, record usage, free the slice (idempotent)",
                      _json(_ref("Lease"), "the ended lease"), errors=(400, 401, 403, 404), params=[
                          _LEASE_ID, _param("reason", "query", {"type": "string", "maxLength": 200,
                                                                "pattern": WORDS},
                                            "words kept with the release")]),
    },
    "/leases/{id}/heartbeat": {
        "post": _op("Renew the notebook kernel's liveness", _json(_ref("Lease"), "the lease, also once ended"),
                    body=_NO_FIELDS, body_required=False,
                    errors=(400, 401, 403, 404), params=[_LEASE_ID]),
    },
    "/leases/{id}/park": {
        "post": _op("Park in place: the worker frozen on its node, its GPU state in host memory, its GPU share "
                    "back in the pool (docs/parking.md); answers once parked, or still parking after 20 s",
                    _json(_ref("Lease"), "the lease, parking or parked"),
                    body=_NO_FIELDS, body_required=False,
                    errors=(400, 401, 403, 404, (409, "invalid_state (not active), cannot_park (its node cannot), "
                                                      "worker_busy (a cell runs)")), params=[_LEASE_ID]),
    },
    "/leases/{id}/resume": {
        "post": _op("Resume a parked lease once its node has room, or (c.PoolLeases.resume_moves, parked.may_move) "
                    "another node of its GPU model; idempotent; it waits in the queue with queue_position and "
                    "queue_estimate_s; a lease whose node is lost ends failed",
                    _json(_ref("Lease"), "the lease: parked with parked.resume_requested, starting, or active"),
                    body=_RESUME, body_required=False,
                    errors=(400, 401, 403, 404, (409, "invalid_state: queued, releasing or ended")),
                    params=[_LEASE_ID]),
    },
    "/pool": {
        "get": _op("Nodes, GPUs and their allocation", _json(_ref("Pool"), "the pool"), errors=(401,)),
    },
    "/nodes": {
        "post": _op("Agent registration", _json(_ref("RegistrationReply"), "registered"),
                    body=_ref("NodeRegistration"), errors=(400, 401, 403, 503)),
    },
    "/nodes/{name}/heartbeat": {
        "post": _op("Agent heartbeat: worker reports and GPU readings",
                    _json(_ref("HeartbeatReply"), "workers to stop"), body=_ref("Heartbeat"),
                    errors=(400, 401, 403, 404), params=[_param("name", "path", {"type": "string"}, "node name")]),
    },
    "/quota": {
        "get": _op("Your limits and usage", _json(_ref("Quota"), "limits and usage"), errors=(401, 403)),
    },
    "/admin/quotas": {
        "get": _op("Quota tables: configured, overrides, effective (admins)", _json({"type": "object", "properties": {
            "configured": {"type": "object"}, "overrides": {"type": "object"}, "effective": {"type": "object"}}},
            "the tables"), errors=(401, 403)),
    },
    "/admin/quotas/{scope}": {
        "put": _op("Set limits of a scope at run time (merged into its override; kept in SQL)",
                   _json({"type": "object"}, "the scope's override"),
                   body={"allOf": [_ref("Limits")], "minProperties": 1},  # {} sets nothing: a 400
                   errors=(400, 401, 403, 409, 503), params=[_SCOPE]),
        "delete": _op("Remove a scope's override", _json({"type": "object"}, "removed"),
                      errors=(400, 401, 403, 404), params=[_SCOPE]),
    },
    "/admin/usage": {
        "get": _op("GPU-hours per user and group: today, this week, per day (admins)",
                   _json({"type": "object"}, "usage"), errors=(400, 401, 403), params=[
                       _param("days", "query", {"type": "integer", "minimum": 1, "maximum": 92, "default": 7},
                              "days of daily_gpu_hours")]),
    },
    "/openapi.json": {"get": _op("This document", _json({"type": "object"}, "OpenAPI 3.1"), errors=(),
                                 security=False)},
    "/health": {"get": _op("Liveness", _json({"type": "object", "properties": {"status": {"const": "ok"}}}, "ok"),
                           errors=(), security=False)},
}


def document(base_url: str = "/", *, max_wait: float = _MOST_SECONDS,
             max_idle_timeout: float = _MOST_SECONDS) -> dict[str, Any]:
    """The OpenAPI document, with the server URL under ``base_url`` and the
    pool's ``c.PoolLeases.max_wait`` and ``max_idle_timeout`` (seconds) as the
    maxima of a lease request's ``wait`` and ``idle_timeout``."""
    schemas = copy.deepcopy(_SCHEMAS) | {body.__name__: body.json_schema() for body in _BODIES}
    request = schemas["LeaseRequest"]["properties"]
    request["wait"]["maximum"] = min(max_wait, _MOST_SECONDS)
    request["idle_timeout"]["maximum"] = min(max_idle_timeout, _MOST_SECONDS)
    return {
        "openapi": "3.1.0",
        "info": {"title": "gpupool service", "version": "1",
                 "description": "GPU pooling for Jupyter: leases of GPU slices, the pool, node agents. "
                                "Units: fractions, bytes, seconds, ISO 8601 UTC times."},
        "servers": [{"url": f"{base_url.rstrip('/')}/api/v1"}],
        "components": {"schemas": schemas, "securitySchemes": {
            "token": {"type": "apiKey", "in": "header", "name": "Authorization",
                      "description": "'token TOKEN': a user token, or the agent token for /nodes"}}},
        "security": [{"token": []}],
        "paths": _PATHS,
    }
