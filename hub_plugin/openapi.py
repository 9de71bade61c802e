"""The OpenAPI 3.1 document of ``/api/v1`` (served at ``/api/v1/openapi.json``).

Hand-written to mirror docs/api.md; a test checks that every route the
service serves under ``/api/v1`` appears here.
"""

from __future__ import annotations

import copy
from typing import Any

from gpupool.schema import LEASE_CLASSES, MAX_BYTES, MAX_CPUS, MIN_CPUS, MIN_FRACTION, MIN_MEMORY, LeaseState


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    words = {400: "bad input; nothing changed", 401: "missing or unknown token",
             403: "this token may not call this endpoint", 404: "not found (or not yours)",
             409: "the pool cannot take the request now", 415: "the body was not sent as application/json",
             429: "over your quota (quota_exceeded; `limit` names which)", 503: "the store is busy or down; retry"}
    return {str(code): _json(_ref("Error"), words[code]) for code in codes}


def _op(summary: str, ok: dict[str, Any], *, body: dict[str, Any] | None = None, body_required: bool = True,
        errors=(401,), params: list[dict[str, Any]] | None = None, ok_code: int = 200,
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


#: A byte count on the wire (``gpupool.schema.MAX_BYTES``).
_BYTES = {"type": "integer", "minimum": 0, "maximum": MAX_BYTES}
_LEASE_ID = _param("id", "path", {"type": "string", "pattern": "^L-[0-9a-f]{12}$"}, "lease id")
#: Text without ASCII control characters (``gpupool.schema.has_control_characters``).
_TEXT = "[^\\x00-\\x1f\\x7f]"
#: ... that is not white space either (``str.strip`` would remove it).
_INK = "[^\\s\\x00-\\x1f\\x7f]"
_NAME = {"type": "string", "minLength": 1, "maxLength": 200, "pattern": f"^{_TEXT}+$"}
#: ``hub_plugin.quotas.check_scope``: ``'*'``, ``'user:NAME'`` or ``'group:NAME'``.
_SCOPE = _param("scope", "path", {"type": "string", "maxLength": 210,
                                  "pattern": f"^(\\*|(user|group):{_INK}({_TEXT}*{_INK})?)$"},
                "'*', 'group:NAME' or 'user:NAME' (NAME without control characters or white space around it)")
#: The longest wait and idle timeout any request may name, seconds (``LeaseRequest``).
_MOST_SECONDS = 366 * 86400
_NULLABLE_TIME = {"type": ["string", "null"], "format": "date-time"}
#: ``gpupool.wire.nodes.inventory_error``.
_INVENTORY_ERROR = {"type": ["string", "null"], "minLength": 1, "maxLength": 500,
                    "pattern": f"^{_TEXT}*{_INK}{_TEXT}*$",
                    "description": "why the agent cannot read its GPUs (NVML failed to start or stopped "
                    "answering); null or absent: it can. While set the node is degraded: its GPUs are kept as "
                    "last known, its leases go on, nothing new is placed there"}

_SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error", "message"], "properties": {
        "error": {"type": "string", "description": "machine reason, e.g. pool_full"},
        "message": {"type": "string", "description": "words for a person"}}},
    "LeaseRequest": {"type": "object", "additionalProperties": False, "description": "null: as if left out",
                     "properties": {
        "fraction": {"type": ["number", "null"], "minimum": MIN_FRACTION, "maximum": 1, "default": 1,
                     "description": "of one GPU; 1 (or left out) when gpu_count > 1"},
        "gpu_count": {"type": ["integer", "null"], "minimum": 1, "maximum": 64, "default": 1,
                      "description": "whole GPUs, all on one node; 400 above the biggest node's count"},
        "memory": {"type": ["integer", "null"], "minimum": MIN_MEMORY, "maximum": 2**50,
                   "description": "bytes per GPU (default: the fraction's share)"},
        "model": {**_NAME, "type": ["string", "null"], "description": "substring of the GPU name, e.g. A100"},
        "idle_timeout": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": _MOST_SECONDS,
                         "description": "seconds (at most c.GPUPool.max_idle_timeout, or max_idle_timeout of "
                         "your quota: 400 above it)"},
        "kernel_id": {**_NAME, "type": ["string", "null"]},
        "wait": {"type": ["number", "null"], "minimum": 0, "maximum": _MOST_SECONDS,
                 "description": "seconds to queue when nothing fits (at most c.GPUPool.max_wait); "
                 "0 or absent: 409 at once"},
        "server_name": {"type": ["string", "null"], "maxLength": 255, "pattern": "^[^\\x00-\\x1f\\x7f]*$",
                        "description": "the JupyterHub server the kernel runs in (JUPYTERHUB_SERVER_NAME, "
                        "\"\" the default one): stopping that server releases the lease"},
        "env": {"type": ["string", "null"], "pattern": "^[A-Za-z0-9._-]{1,100}$",
                "description": "the worker environment on the node (c.NodeAgent.environments): the lease "
                "goes only to a node that reports it usable; 409 unknown_environment when none does. "
                "Absent: the node's default"},
        "prefer_env": {"type": ["string", "null"], "pattern": "^[A-Za-z0-9._-]{1,100}$",
                       "description": "when env is absent: this environment if some node offers it, else "
                       "the node's default (never refused); the magic sends the notebook kernel's name"},
        "lease_class": {"type": ["string", "null"], "enum": [*LEASE_CLASSES, None], "default": "interactive",
                        "description": "batch requests queue behind every interactive one"},
        "preemptible": {"type": ["boolean", "null"], "default": False,
                        "description": "the running cell may be interrupted and the lease parked while others "
                        "wait; 400 where c.GPUPool.allow_preemption is off"},
        "cpus": {"type": ["number", "null"], "minimum": MIN_CPUS, "maximum": MAX_CPUS,
                 "description": "host cores for the worker (its cgroup's CPU limit); absent: the GPU share's "
                 "part of the node's cores (c.GPUPool.host_share); 400 above the biggest node's"},
        "host_memory": {"type": ["integer", "null"], "minimum": MIN_MEMORY, "maximum": 2**50,
                        "description": "bytes of host RAM for the worker (its cgroup's memory limit); absent: "
                        "the GPU share's part of the node's RAM; 400 above the biggest node's"}},
        # Several GPUs are whole GPUs.
        "if": {"required": ["gpu_count"], "properties": {"gpu_count": {"type": "integer", "minimum": 2}}},
        "then": {"properties": {"fraction": {"enum": [1, None]}}}},
    "Lease": {"type": "object", "required": ["id", "owner", "state", "fraction", "gpu_count", "memory"], "properties": {
        "id": {"type": "string"}, "owner": {"type": "string"},
        "state": {"enum": [s.value for s in LeaseState]}, "reason": {"type": ["string", "null"]},
        "fraction": {"type": "number"}, "gpu_count": {"type": "integer"},
        "memory": {"type": "integer", "description": "bytes per GPU"}, "node": {"type": ["string", "null"]},
        "cpus": {"type": ["number", "null"], "description": "host cores held (reserved) on the node (null: the node "
                 "reports no host)"},
        "host_memory": {"type": ["integer", "null"], "description": "host bytes held (reserved) on the node"},
        "cpu_limit": {"type": ["number", "null"], "description": "host cores the worker's cgroup is limited to: "
                      "cpus, raised to 1 core (at most the node's) where the default share was taken"},
        "host_memory_limit": {"type": ["integer", "null"], "description": "host bytes the worker's cgroup is "
                              "limited to: host_memory, raised to 1 GiB (at most the node's) where the default "
                              "share was taken"},
        "requested_cpus": {"type": ["number", "null"], "description": "cpus as requested (null: the default "
                           "share)"},
        "requested_host_memory": {"type": ["integer", "null"], "description": "host_memory as requested (null: "
                                  "the default share)"},
        "gpus": {"type": "array", "items": {"type": "object", "properties": {
            "uuid": {"type": "string"}, "name": {"type": "string"}, "index": {"type": "integer"}}}},
        "env": {"type": ["string", "null"], "description": "the worker environment asked for; once placed, "
                "the one the worker runs in (the node's default when none was asked for)"},
        "idle_timeout": {"type": "number"}, "heartbeat_ttl": {"type": "number"},
        "kernel_id": {"type": ["string", "null"]}, "server_name": {"type": ["string", "null"]},
        "created_at": _NULLABLE_TIME, "started_at": _NULLABLE_TIME,
        "ended_at": _NULLABLE_TIME, "idle_since": _NULLABLE_TIME,
        "idle_deadline": {**_NULLABLE_TIME, "description": "when the lease is reclaimed if its worker stays "
                          "idle; null while a cell runs or when not active"},
        "idle_warning": {"type": "number", "description": "seconds before idle_deadline that the notebook "
                         "warns (c.GPUPool.idle_warning); 0: no warning"},
        "node_state": {"type": ["string", "null"], "enum": ["up", "degraded", "lost", None],
                       "description": "lost: no heartbeat from the node's agent for node_ttl; the worker is "
                       "unreachable until it returns (the lease keeps its capacity). degraded: the agent "
                       "cannot read its GPUs (NVML); the lease goes on, nothing new is placed there"},
        "worker": {"type": ["object", "null"], "properties": {
            "pid": {"type": ["integer", "null"]}, "execution_state": {"type": ["string", "null"]}}},
        "connection": {"type": ["object", "null"], "description": "Jupyter connection info; owner only, while active"},
        "usage_gpu_seconds": {"type": "number"},
        "events": {"type": "array", "items": {"type": "object", "properties": {
            "state": {"type": "string"}, "at": {"type": "string", "format": "date-time"},
            "reason": {"type": ["string", "null"]}}}},
        "queue_position": {"type": ["integer", "null"], "description": "while queued: 1-based place in line"},
        "queue_estimate_s": {"type": ["number", "null"], "description": "while queued: rough wait, seconds"},
        "wait_until": _NULLABLE_TIME,
        "lease_class": {"enum": list(LEASE_CLASSES)}, "preemptible": {"type": "boolean"},
        "pressure": {"type": ["string", "null"], "description": "why idle_deadline came early or a preemption "
                     "is due, e.g. 'parked early: 3 people are waiting for a GPU'"},
        "preempt_at": {**_NULLABLE_TIME, "description": "when the running cell of a preemptible lease is "
                       "interrupted, then the lease parked"}}},
    "Limits": {"type": "object", "additionalProperties": False, "description": "null: unlimited. When set, "
               "gpu_hours_* and max_idle_timeout also take strings with a unit ('8h', '30m')", "properties": {
        "max_gpus": {"type": ["number", "null"], "minimum": 0,
                     "description": "GPUs held or queued at once (sum of fractions)"},
        "max_lease_gpus": {"type": ["number", "null"], "minimum": 0, "description": "fraction x count of one lease"},
        "gpu_hours_per_day": {"type": ["number", "null"], "minimum": 0},
        "gpu_hours_per_week": {"type": ["number", "null"], "minimum": 0},
        "max_idle_timeout": {"type": ["number", "null"], "exclusiveMinimum": 0, "description": "seconds"},
        "guaranteed_gpus": {"type": ["number", "null"], "minimum": 0, "description": "GPUs never parked early "
                            "nor preempted (the oldest leases first); null: none"}}},
    "GPUInfo": {"type": "object", "required": ["uuid", "name", "index", "memory_total"], "properties": {
        "uuid": {"type": "string"}, "name": {"type": "string"}, "index": {"type": "integer", "minimum": 0, "maximum": 1023},
        "memory_total": _BYTES | {"minimum": 1}, "memory_reserved": _BYTES,
        "compute_capability": {"type": ["string", "null"]}, "healthy": {"type": "boolean"}}},
    "WorkerReport": {"type": "object", "required": ["lease_id", "execution_state"], "properties": {
        "lease_id": {"type": "string", "minLength": 1, "maxLength": 40, "pattern": f"^{_TEXT}+$"},
        "pid": {"type": ["integer", "null"], "description": "ignored unless 0 to 2**31-1"},
        "execution_state": {"enum": ["starting", "idle", "busy", "dead"]},
        "idle_since": _NULLABLE_TIME, "exit_code": {"type": ["integer", "null"]},
        "memory_used": {"type": ["integer", "null"], "description": "bytes; ignored unless 0 to 2**50"},
        "reason": {"type": ["string", "null"]}}},
    "Stop": {"type": "array", "items": {"type": "string"}, "description": "lease ids whose workers must stop"},
}

_PATHS: dict[str, Any] = {
    "/leases": {
        "post": _op("Ask for a slice or whole GPUs; the capacity is reserved in the same transaction",
                    _json(_ref("Lease"), "the new lease, state starting"), body=_ref("LeaseRequest"),
                    errors=(400, 401, 403, 409, 429, 503), ok_code=201),
        "get": _op("Your own leases", _json({"type": "object", "properties": {
            "leases": {"type": "array", "items": _ref("Lease")}}}, "your leases, oldest first"),
            errors=(400, 401, 403), params=[
                _param("active", "query", {"type": "string", "enum": ["1", "0", "true", "false"], "default": "1"},
                       "1 (or true): only leases holding or waiting for capacity"),
                _param("kernel_id", "query", {"type": "string"}, "only this kernel's leases")]),
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
                                                                "pattern": f"^{_TEXT}*{_INK}{_TEXT}*$"},
                                            "words kept with the release")]),
    },
    "/leases/{id}/heartbeat": {
        "post": _op("Renew the notebook kernel's liveness", _json(_ref("Lease"), "the lease, also once ended"),
                    body={"type": "object", "description": "no fields yet"}, body_required=False,
                    errors=(400, 401, 403, 404), params=[_LEASE_ID]),
    },
    "/pool": {
        "get": _op("Nodes, GPUs and their allocation", _json({"type": "object", "properties": {
            "nodes": {"type": "array", "items": {"type": "object"}},
            "totals": {"type": "object", "properties": {
                "gpus": {"type": "integer"}, "allocated": {"type": "number"}, "free": {"type": "number"}}}}},
            "the pool"), errors=(401,)),
    },
    "/nodes": {
        "post": _op("Agent registration", _json({"type": "object", "properties": {
            "name": {"type": "string"}, "heartbeat_interval": {"type": "number"}, "stop": _ref("Stop")}},
            "registered"), body={"type": "object", "required": ["name", "url", "inventory", "gpus"], "properties": {
                "name": {"type": "string"}, "url": {"type": "string", "format": "uri"},
                "inventory": {"enum": ["simulated", "nvml"]}, "enforcement": {"type": "string"},
                "whole_gpus": {"type": "boolean"}, "gpus": {"type": "array", "items": _ref("GPUInfo")},
                "workers": {"type": "array", "items": _ref("WorkerReport")},
                "inventory_error": _INVENTORY_ERROR}},
            errors=(400, 401, 403, 503)),
    },
    "/nodes/{name}/heartbeat": {
        "post": _op("Agent heartbeat: worker reports and GPU readings", _json({"type": "object", "properties": {
            "stop": _ref("Stop")}}, "workers to stop"), body={"type": "object", "properties": {
                "workers": {"type": "array", "items": _ref("WorkerReport")},
                "gpus": {"type": "array", "items": {"type": "object", "required": ["uuid"], "properties": {
                    "uuid": {"type": "string"}, "memory_used": _BYTES | {"type": ["integer", "null"]},
                    "memory_unattributed": _BYTES | {"type": ["integer", "null"]},
                    "utilization": {"type": ["number", "null"]}, "healthy": {"type": "boolean"}}}},
                "inventory_error": _INVENTORY_ERROR}},
            errors=(400, 401, 403, 404), params=[_param("name", "path", {"type": "string"}, "node name")]),
    },
    "/quota": {
        "get": _op("Your limits and usage", _json({"type": "object", "properties": {
            "user": {"type": "string"}, "groups": {"type": "array", "items": {"type": "string"}},
            "limits": _ref("Limits"), "usage": {"type": "object", "properties": {
                "holding_gpus": {"type": "number"}, "today_gpu_hours": {"type": "number"},
                "week_gpu_hours": {"type": "number"}, "day_resets_at": {"type": "string", "format": "date-time"},
                "week_resets_at": {"type": "string", "format": "date-time"}, "timezone": {"type": "string"}}}}},
            "limits and usage"), errors=(401, 403)),
    },
    "/admin/quotas": {
        "get": _op("Quota tables: configured, overrides, effective (admins)", _json({"type": "object", "properties": {
            "configured": {"type": "object"}, "overrides": {"type": "object"}, "effective": {"type": "object"}}},
            "the tables"), errors=(401, 403)),
    },
    "/admin/quotas/{scope}": {
        "put": _op("Set limits of a scope at run time (merged into its override; kept in SQL)",
                   _json({"type": "object"}, "the scope's override"), body=_ref("Limits"),
                   errors=(400, 401, 403, 503), params=[_SCOPE]),
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
    pool's ``c.GPUPool.max_wait`` and ``max_idle_timeout`` (seconds) as the
    maxima of a lease request's ``wait`` and ``idle_timeout``."""
    schemas = copy.deepcopy(_SCHEMAS)
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
