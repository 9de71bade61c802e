"""Agents registering and heartbeating (``/api/v1/nodes``, agent token only).

A registration upserts the node and its GPUs; a heartbeat renews the node
and carries worker reports and GPU readings. An agent that cannot read its
GPUs (NVML failed) says why in ``inventory_error``: its node is then
``degraded``, with the words in ``state_reason``; its GPU rows stay as last
known (with unknown readings), its leases go on, and nothing new is placed
there until a registration or heartbeat without the error. Worker reports
update the lease's worker state and idle time; a worker reported ``dead`` ends its
lease ``failed`` through the one release path; and every reported worker
whose lease does not hold capacity on this node comes back in ``stop``, so
no worker outlives its lease.
"""

from __future__ import annotations

import logging
import signal
import urllib.parse
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpupool.errors import GPUPoolError, bad_request, not_found
from gpupool.schema import (MAX_BYTES, MAX_CPUS, GPUInfo, LeaseState, WorkerReport, has_control_characters,
                            is_unicode, parse_time)

from .capacity import mark_all, mark_gpus, mark_node
from .leases import LeaseBook
from .models import GPU, Lease, Node

log = logging.getLogger("gpupool.service.nodes")

INVENTORIES = ("simulated", "nvml")


class NodeBook:
    """Node registration and heartbeats; ends leases through ``leases``."""

    def __init__(self, leases: LeaseBook, heartbeat_interval: float) -> None:
        self.leases = leases
        self.heartbeat_interval = heartbeat_interval

    async def register(self, body: Any) -> dict[str, Any]:
        """``POST /nodes``: returns ``{"name", "heartbeat_interval", "stop"}``.
        Raises 400 for a bad body (and changes nothing)."""
        if not isinstance(body, dict):
            raise bad_request("the registration body must be a JSON object")
        name = _name(body.get("name"))
        url = _url(body.get("url"))
        inventory = body.get("inventory")
        if inventory not in INVENTORIES:
            raise bad_request(f"'inventory' must be one of {', '.join(INVENTORIES)}, got {inventory!r:.80}")
        enforcement = _enforcement(body)
        gpus = _list(body, "gpus", required=True)
        infos = [GPUInfo.from_json(g) for g in gpus]
        if len({i.uuid for i in infos}) != len(infos):
            raise bad_request("each GPU 'uuid' must appear once")
        healthy = {g["uuid"]: g.get("healthy") is not False for g in gpus}
        reports = [WorkerReport.from_json(w) for w in _list(body, "workers")]
        error = _inventory_error(body)
        environments = _environments(body)
        host = _host(body)
        stop, dead = await self.leases.work.write(self._register_now, name, url, inventory, enforcement, infos,
                                                  healthy, reports, error, environments, host)
        if error is None:
            log.info("node %s registered: %s, %d GPU(s), %s inventory", name, url, len(infos), inventory)
        else:
            log.warning("node %s registered degraded: %s; its leases go on, nothing new is placed there", name, error)
        self._end_dead(dead)
        await self.leases.drain_queue()  # its GPUs may fit requests that are waiting
        return {"name": name, "heartbeat_interval": self.heartbeat_interval, "stop": stop}

    def _register_now(self, name, url, inventory, enforcement, infos, healthy, reports, error, environments, host):
        now = self.leases.now()
        with self.leases.writing() as session:
            node = session.get(Node, name)
            if node is None:
                node = Node(name=name)
                session.add(node)
            else:
                _refuse_second_agent(node, url, now, self.leases.settings.node_ttl)
            node.url, node.inventory, (node.enforcement, node.whole_gpus) = url, inventory, enforcement
            node.environments = environments
            node.host_cpus, node.host_memory = host
            node.registered_at, node.last_heartbeat_at = now, now
            _set_state(node, error)
            if error is None:  # a degraded node's GPUs stay as last known: it cannot list them
                self._upsert_gpus(session, node, infos, healthy)
            mark_all(session)  # GPUs may have come, gone or changed: the scheduler reads them all again
            stop, dead = self._apply_reports(session, node, reports, now)
            dead += self._lost_workers(session, node, reports)
        return stop, dead

    async def heartbeat(self, name: str, body: Any) -> dict[str, Any]:
        """``POST /nodes/{name}/heartbeat``: returns ``{"stop": [lease ids]}``.
        404 for an unknown node (the agent registers again)."""
        if not isinstance(body, dict):
            raise bad_request("the heartbeat body must be a JSON object")
        if not _is_name(name):
            raise not_found(f"node {name[:40]!r}")  # no store can hold that name, so none is registered
        reports = [WorkerReport.from_json(w) for w in _list(body, "workers")]
        readings = [_reading(g) for g in _list(body, "gpus")]
        error = _inventory_error(body)
        stop, dead, came_back = await self.leases.work.write(self._heartbeat_now, name, reports, readings, error)
        self._end_dead(dead)
        if came_back:
            await self.leases.drain_queue()  # its GPUs may fit requests that are waiting
        return {"stop": stop}

    def _heartbeat_now(self, name, reports, readings, error):
        now = self.leases.now()
        with self.leases.writing() as session:
            node = session.get(Node, name)
            if node is None:
                raise not_found(f"node {name}")
            was = _set_state(node, error)
            came_back = was != "up" and node.state == "up"
            if node.state != was:
                if error is not None:
                    log.warning("node %s is degraded: %s; its leases go on, nothing new is placed there", name, error)
                else:
                    log.info("node %s is back", name)
                mark_node(session, name)
            node.last_heartbeat_at = now
            gpus = {g.uuid: g for g in node.gpus}
            # In UUID order, the order lease creation locks GPU rows in (no deadlock).
            for uuid, used, utilization, healthy, unattributed in sorted(readings, key=lambda r: r[0]):
                if uuid in gpus:
                    gpu = gpus[uuid]
                    gpu.memory_used, gpu.utilization = used, utilization
                    if (gpu.memory_unattributed or 0) != (unattributed or 0) or healthy not in (None, gpu.healthy):
                        mark_gpus(session, [uuid])  # placement depends on these two
                    gpu.memory_unattributed = unattributed
                    if healthy is not None:
                        gpu.healthy = healthy
            stop, dead = self._apply_reports(session, node, reports, now)
        return stop, dead, came_back

    @staticmethod
    def _upsert_gpus(session: Session, node: Node, infos: list[GPUInfo], healthy: dict[str, bool]) -> None:
        for info in sorted(infos, key=lambda i: i.uuid):  # lock order, as in lease creation
            gpu = session.get(GPU, info.uuid)
            if gpu is None:
                gpu = GPU(uuid=info.uuid)
                session.add(gpu)
            elif gpu.node_name != node.name:
                log.warning("GPU %s moves from node %s to node %s", info.uuid, gpu.node_name, node.name)
            gpu.node_name, gpu.name, gpu.index = node.name, info.name, info.index
            gpu.memory_total, gpu.memory_reserved = info.memory_total, info.memory_reserved
            gpu.compute_capability, gpu.healthy = info.compute_capability, healthy[info.uuid]
        session.flush()
        known = {info.uuid for info in infos}
        for gpu in session.scalars(select(GPU).where(GPU.node_name == node.name)):
            if gpu.uuid not in known:
                # Leases keep a copy of the GPU's name and index, so it can go.
                log.warning("GPU %s (%s) is no longer reported by node %s", gpu.uuid, gpu.name, node.name)
                session.delete(gpu)

    @staticmethod
    def _apply_reports(session: Session, node: Node, reports: list[WorkerReport],
                       now: datetime) -> tuple[list[str], list[tuple[str, str]]]:
        """Update leases from worker reports. Returns (lease ids whose workers
        must stop, (lease id, reason) of workers that died)."""
        stop: list[str] = []
        dead: list[tuple[str, str]] = []
        for report in reports:
            lease = session.get(Lease, report.lease_id)
            if lease is None or lease.node_name != node.name or not LeaseState(lease.state).holds_capacity:
                stop.append(report.lease_id)
            elif report.execution_state == "dead":
                if lease.state != LeaseState.releasing.value:
                    dead.append((lease.id, report.reason or death_reason(report.exit_code)))
            elif lease.state == LeaseState.active.value:
                _update_worker(lease, report, now)
        return stop, dead

    @staticmethod
    def _lost_workers(session: Session, node: Node, reports: list[WorkerReport]) -> list[tuple[str, str]]:
        """At registration: active leases on this node whose worker the
        (re)started agent does not report are gone with the old agent."""
        reported = {r.lease_id for r in reports}
        active = session.scalars(select(Lease.id).where(Lease.node_name == node.name,
                                                        Lease.state == LeaseState.active.value))
        return [(lease_id, f"the worker was lost: the agent on {node.name} restarted without it")
                for lease_id in active if lease_id not in reported]

    def _end_dead(self, dead: list[tuple[str, str]]) -> None:
        # In the background: the release path calls back into the very agent
        # that is waiting for this response.
        for lease_id, reason in dead:
            log.info("lease %s: %s", lease_id, reason)
            self.leases.spawn(self.leases.release(lease_id, LeaseState.failed, reason))


def _refuse_second_agent(node: Node, url: str, now: datetime, node_ttl: float) -> None:
    """409 when another agent, at another URL, still heartbeats under this name:
    a second agent must not take over a live node's name (and its GPUs)."""
    last = node.last_heartbeat_at
    alive = node.state in ("up", "degraded")
    if alive and node.url != url and last is not None and (now - last).total_seconds() < node_ttl:
        raise GPUPoolError("node_name_taken", f"node name {node.name!r} belongs to the live agent at {node.url}; "
                           "give this agent another --name (or stop that agent and wait "
                           f"{node_ttl:.0f}s, c.GPUPool.node_ttl)", 409)


def _set_state(node: Node, error: str | None) -> str:
    """Set ``node``'s state from its agent's ``inventory_error``: ``up``, or
    ``degraded`` with the words in ``state_reason`` and its GPUs' readings
    unknown. Returns the state it had."""
    was = node.state
    node.state, node.state_reason = ("up", None) if error is None else ("degraded", error)
    if error is not None:
        for gpu in node.gpus:
            gpu.memory_used = gpu.utilization = None
    return was


def death_reason(exit_code: int | None) -> str:
    """Words for a worker's end: exit code, or signal when negative."""
    if exit_code is None:
        return "the worker process died"
    if exit_code < 0:
        try:
            name = f" ({signal.Signals(-exit_code).name})"
        except ValueError:
            name = ""
        return f"the worker process was killed by signal {-exit_code}{name}"
    return f"the worker process exited with code {exit_code}"


def _update_worker(lease: Lease, report: WorkerReport, now: datetime) -> None:
    """Copy a live worker's report onto its lease. ``idle_since`` comes from the
    agent when given (kept between the lease's start and now, against clock
    skew), else it starts now when the worker turns idle."""
    was = lease.worker_state
    if report.pid is not None:
        lease.worker_pid = report.pid
    lease.worker_state = report.execution_state
    lease.worker_memory_used = report.memory_used
    if report.execution_state == "busy":
        lease.idle_since = None
    elif report.execution_state == "idle":
        try:
            since = parse_time(report.idle_since)
        except (TypeError, ValueError, AttributeError):
            since = None
        if since is not None:
            lease.idle_since = min(max(since, lease.started_at or since), now)
        elif was != "idle" or lease.idle_since is None:
            lease.idle_since = now


#: What agents that send no ``whole_gpus`` (older than that field) meant by their mode's name.
LEGACY_WHOLE_GPU_MODES = ("mig", "exclusive")


def _enforcement(body: dict[str, Any]) -> tuple[str | None, bool]:
    """``(mode name, whole GPUs only)`` of a registration: the agent's
    ``enforcement`` (the name, shown) and ``whole_gpus`` (its capacity rule,
    placed by; absent from older agents, whose built-in names say it)."""
    name, whole = body.get("enforcement"), body.get("whole_gpus")
    if name is not None and (not isinstance(name, str) or not 0 < len(name) <= 50 or has_control_characters(name)):
        raise bad_request("'enforcement' must be a string of at most 50 characters")
    if whole is None:
        return name, name in LEGACY_WHOLE_GPU_MODES
    if not isinstance(whole, bool):
        raise bad_request(f"'whole_gpus' must be true or false, got {whole!r:.40}")
    return name, whole


def _is_name(value: Any) -> bool:
    return (isinstance(value, str) and 0 < len(value) <= 200 and "/" not in value and value == value.strip()
            and not has_control_characters(value) and is_unicode(value))


def _name(value: Any) -> str:
    if not _is_name(value):
        raise bad_request("'name' must be a node name of 1 to 200 characters without '/', control characters "
                          "or surrounding spaces")
    return value


def _url(value: Any) -> str:
    try:
        parsed = urllib.parse.urlparse(value) if isinstance(value, str) and not has_control_characters(value) else None
    except ValueError:  # e.g. "http://[::1" (an unclosed IPv6 address)
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc or len(value) > 500:
        raise bad_request(f"'url' must be the agent's http(s) URL, like http://10.0.0.5:8766, got {value!r:.80}")
    return value.rstrip("/")


def _inventory_error(body: dict[str, Any]) -> str | None:
    """The optional ``inventory_error``: why the agent cannot read its GPUs (null: it can)."""
    value = body.get("inventory_error")
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 500 or not value.strip()
                              or has_control_characters(value)):
        raise bad_request("'inventory_error' must be null or words of 1 to 500 characters without control characters")
    return value


def _host(body: dict[str, Any]) -> tuple[float | None, int | None]:
    """The optional ``host_cpus`` (cores) and ``host_memory`` (bytes) of a
    registration, both or neither ((None, None): not reported)."""
    cpus, memory = body.get("host_cpus"), body.get("host_memory")
    if cpus is None and memory is None:
        return None, None
    if (isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not 0 < cpus <= MAX_CPUS
            or isinstance(memory, bool) or not isinstance(memory, int) or not 0 < memory <= MAX_BYTES):
        raise bad_request(f"'host_cpus' (cores in (0, {MAX_CPUS}]) and 'host_memory' (bytes in (0, 2**50]) go "
                          f"together, got {cpus!r:.40} and {memory!r:.40}")
    return float(cpus), memory


def _environments(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The optional ``environments`` of a registration (None: not reported):
    at most 100 of ``{"name", "python", "default", "usable", "problem"}``."""
    value = body.get("environments")
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > 100:
        raise bad_request("'environments' must be a list of at most 100 worker environments")
    result = []
    for env in value:
        if not isinstance(env, dict) or not isinstance(env.get("name"), str) or not isinstance(env.get("python"), str):
            raise bad_request("each environment needs 'name' and 'python' (strings)")
        problem = env.get("problem")
        if problem is not None and not isinstance(problem, str):
            raise bad_request("an environment's 'problem' must be words or null")
        result.append({"name": env["name"][:100], "python": env["python"][:500], "default": env.get("default") is True,
                       "usable": env.get("usable") is True, "problem": None if problem is None else problem[:500]})
    return result


def _list(body: dict[str, Any], key: str, *, required: bool = False) -> list[Any]:
    value = body.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list):
        raise bad_request(f"'{key}' must be a list")
    return value


def _reading(value: Any) -> tuple[str, int | None, float | None, bool | None, int | None]:
    """One GPU reading of a heartbeat: (uuid, memory_used bytes, utilization %,
    healthy, memory_unattributed bytes: used by processes of no worker)."""
    if not isinstance(value, dict) or not isinstance(value.get("uuid"), str):
        raise bad_request("each GPU reading needs a 'uuid'")
    used, util, healthy = value.get("memory_used"), value.get("utilization"), value.get("healthy")
    unattributed = value.get("memory_unattributed")
    for key, number in (("memory_used", used), ("memory_unattributed", unattributed)):
        if number is not None and (isinstance(number, bool) or not isinstance(number, int)
                                   or not 0 <= number <= MAX_BYTES):
            raise bad_request(f"'{key}' must be a whole number of bytes from 0 to 2**50")
    if util is not None and (isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 <= util <= 100):
        raise bad_request("'utilization' must be a percentage from 0 to 100")
    if healthy is not None and not isinstance(healthy, bool):
        raise bad_request("'healthy' must be true or false")
    return value["uuid"], used, None if util is None else float(util), healthy, unattributed
