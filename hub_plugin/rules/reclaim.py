"""Idle reclaim's rules: which active leases to take back, and which nodes are lost.

Pure (rows and ``now`` in, decisions out), so tests and the simulator move
time by passing a different ``now``; the sweep that reads the store and
applies them is :class:`gpupool.hub_plugin.reclaim.Reclaimer`.

Rules (docs/api.md, "Reclaim"):

- heartbeat: no heartbeat from the notebook kernel for ``heartbeat_ttl``
  while no cell runs -> ``reclaimed``;
- idle: the agent reports the worker ``idle`` and ``now - idle_since >=
  idle_timeout`` -> ``reclaimed``;
- a worker that is ``busy`` (a cell is running) is never reclaimed by either;
- pressure (:mod:`gpupool.hub_plugin.pressure`, :mod:`.priority`): while
  requests wait, an idle over-quota lease's deadline comes after
  ``c.GPUPool.pressure_grace``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from gpupool.strenum import StrEnum
from typing import Any, Iterable

from gpupool.schema import LeaseState
from gpupool.units import format_duration


class Reclaim(StrEnum):
    """Why the service took a lease back, as a code: kept with the lease
    (``leases.reclaim_code``) and the label of ``gpupool_reclaims_total``.
    Stable: a code may be added, none renamed."""

    idle = "idle"  # its worker stayed idle for its idle timeout
    heartbeat = "heartbeat"  # its notebook kernel stopped sending heartbeats
    pressure = "pressure"  # parked early by the sweep while others wait (:mod:`.pressure`)


@dataclass(frozen=True)
class Decision:
    """End ``lease_id`` in ``state`` (a final state) for ``reason`` (words
    for its owner), reclaimed for ``code``."""

    lease_id: str
    state: LeaseState
    reason: str
    code: Reclaim


def decide(leases: Iterable[Any], now: datetime) -> list[Decision]:
    """Decisions for ``leases``: objects with the attributes of
    :class:`~gpupool.hub_plugin.models.Lease` (``id``, ``state``, ``worker_state``,
    ``idle_since``, ``idle_timeout``, ``last_heartbeat_at``, ``started_at``,
    ``heartbeat_ttl``). Only ``active`` leases are considered."""
    decisions = []
    for lease in leases:
        if lease.state != LeaseState.active.value or lease.worker_state == "busy":
            continue
        silent = heartbeat_expired(lease, now)
        if silent:
            decisions.append(Decision(lease.id, LeaseState.reclaimed, silent, Reclaim.heartbeat))
            continue
        idle = idle_expired(lease, now)
        if idle:
            decisions.append(Decision(lease.id, LeaseState.reclaimed, idle, Reclaim.idle))
    return decisions


def heartbeat_expired(lease: Any, now: datetime) -> str | None:
    """The reason if the notebook kernel's heartbeats stopped, else None."""
    last = lease.last_heartbeat_at or lease.started_at
    if last is None:
        return None
    silent = (now - last).total_seconds()
    if silent < lease.heartbeat_ttl:
        return None
    return (f"the notebook kernel stopped sending heartbeats for {format_duration(silent)} "
            f"(heartbeat TTL {format_duration(lease.heartbeat_ttl)})")


def idle_deadline(lease: Any) -> datetime | None:
    """When ``lease`` is reclaimed for idleness if its worker stays idle
    (``idle_since + idle_timeout``); None unless it is active and its worker
    reported idle. Sent to the client (``idle_deadline``), which warns
    ``c.GPUPool.idle_warning`` seconds ahead."""
    if lease.state != LeaseState.active.value or lease.worker_state != "idle" or lease.idle_since is None:
        return None
    return lease.idle_since + timedelta(seconds=lease.idle_timeout)


def idle_expired(lease: Any, now: datetime) -> str | None:
    """The reason if the worker reported idle for its idle timeout, else None."""
    deadline = idle_deadline(lease)
    if deadline is None or now < deadline:
        return None
    idle = (now - lease.idle_since).total_seconds()
    return f"idle for {format_duration(idle)} (idle timeout {format_duration(lease.idle_timeout)})"


def still_due(lease: Any, now: datetime) -> bool:
    """Whether ``lease`` is still to be reclaimed at ``now``: the release path
    re-checks this under the write lock, since a busy report or a heartbeat
    may have arrived after the sweep read the lease."""
    return bool(decide([lease], now))


#: Node states whose agent heartbeats: a ``degraded`` one (NVML failed) is alive too.
ALIVE = ("up", "degraded")


def lost_nodes(nodes: Iterable[Any], now: datetime, node_ttl: float) -> list[str]:
    """Names of ``up`` or ``degraded`` nodes (objects with ``name``, ``state``,
    ``last_heartbeat_at``) not heard from for ``node_ttl`` seconds."""
    return [node.name for node in nodes
            if node.state in ALIVE and (now - node.last_heartbeat_at).total_seconds() >= node_ttl]
