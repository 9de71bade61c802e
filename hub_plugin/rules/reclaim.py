"""Idle reclaim's rules: which leases to take back (park in place, or end),
and which nodes are lost.

Pure (rows and ``now`` in, decisions out), so tests and the simulator move
time by passing a different ``now``; the sweep that reads the store and
applies them is :class:`gpupool.hub_plugin.reclaim.Reclaimer`.

Rules (docs/api.md, "Reclaim"; docs/parking.md):

- heartbeat: no heartbeat from the notebook kernel for ``heartbeat_ttl``
  while no cell runs, or while the lease is parked (its kernel died, whatever
  the frozen worker was doing) -> ``reclaimed``;
- idle: the agent reports the worker ``idle`` and ``now - idle_since >=
  idle_timeout`` -> ``parked`` in place where its node can park (its agent
  reports a checkpointer) and the lease asked ``on_idle: park``; else
  ``reclaimed``;
- a worker that is ``busy`` (a cell is running) is never reclaimed by either;
- pressure (:mod:`gpupool.hub_plugin.pressure`, :mod:`.priority`): while
  requests wait, an idle over-quota lease's deadline comes after
  ``c.PoolPressure.pressure_grace`` (parked, or reclaimed where it cannot park), and
  a preemptible lease whose cell runs is frozen mid-cell at its ``preempt_at``;
- a parked lease whose node is lost for ``node_ttl`` plus
  ``c.PoolNodes.parked_node_grace`` -> ``failed``, saying what was lost
  (:func:`lost_parked`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from gpupool.strenum import StrEnum
from typing import Any, Collection, Iterable, Mapping

from gpupool.schema import LeaseState, WorkerState
from gpupool.units import format_duration


class Reclaim(StrEnum):
    """Why the service took a lease back, as a code: kept with the lease
    (``leases.reclaim_code``) and the label of ``gpupool_reclaims_total``.
    Stable: a code may be added, none renamed."""

    idle = "idle"  # its worker stayed idle for its idle timeout
    heartbeat = "heartbeat"  # its notebook kernel stopped sending heartbeats
    pressure = "pressure"  # parked early by the sweep while others wait (:mod:`.pressure`)
    replaced = "replaced"  # a move's new lease has run for MOVE_GRACE_S and this old one was not released


class ParkCode(StrEnum):
    """Why a lease was parked in place, as a code: kept with the lease
    (``leases.park_code``) and the label of ``gpupool_parks_total``.
    Stable: a code may be added, none renamed."""

    idle = "idle"  # its worker stayed idle for its idle timeout
    pressure = "pressure"  # parked early while others wait (:mod:`.pressure`)
    preemption = "preemption"  # a preemptible lease frozen mid-cell for a waiting person
    owner = "owner"  # its owner asked (POST /leases/{id}/park, %gpu park)
    agent_stopped = "agent_stopped"  # its node's agent, stopping, saved it to disk (c.AgentParking.park_on_stop)


#: What a park does with a running cell (:data:`gpupool.wire.parking.RUNNING_CELL`): an idle park
#: never touches one, preemption freezes it where it is.
REFUSE, FREEZE = "refuse", "freeze"
#: The lease states whose worker still lives on its node, and whose notebook kernel's heartbeats count.
PARKED_STATES = (LeaseState.parking.value, LeaseState.parked.value)


@dataclass(frozen=True)
class Decision:
    """Take ``lease_id`` back for ``reason`` (words for its owner): end it in
    ``state`` (a final state), reclaimed for ``code`` (:class:`Reclaim`; None: not a
    reclaim, e.g. ``failed``), or,
    with ``state`` ``parked``, park it in place for ``code`` (:class:`ParkCode`),
    doing ``running_cell`` with a running cell."""

    lease_id: str
    state: LeaseState
    reason: str
    code: Reclaim | ParkCode | None = None
    running_cell: str = REFUSE

    @property
    def parks(self) -> bool:
        """True when the lease is parked in place, not ended."""
        return self.state is LeaseState.parked


def is_busy(lease: Any) -> bool:
    """Whether a cell runs on ``lease``'s worker (an object with ``worker_state``): its agent
    last reported it ``busy``. The one "busy" rule of the service's rules, the ETA's and the
    simulator's: a worker ``starting``, ``dead`` or not reported yet (None) runs no cell, so it
    is neither preempted nor spared as busy, and none of these is idle either (:func:`idle_deadline`)."""
    return lease.worker_state == WorkerState.busy


def decide(leases: Iterable[Any], now: datetime, parkable: Collection[str] = (),
           away: Collection[str] = ()) -> list[Decision]:
    """Decisions for ``leases``: objects with the attributes of
    :class:`~gpupool.hub_plugin.models.Lease` (``id``, ``state``, ``worker_state``,
    ``idle_since``, ``idle_timeout``, ``last_heartbeat_at``, ``started_at``,
    ``heartbeat_ttl``; ``node_name`` and ``on_idle`` where ``parkable`` is given).
    ``active`` leases are considered, and parked (or parking) ones for their
    heartbeats. ``parkable``: the nodes that can park in place (their agent reports a
    checkpointer); an idle lease there that asked ``on_idle: park`` is parked, any
    other is reclaimed. ``away``: nodes that can park but whose agent is away for now
    (lost, and within its grace: :func:`agents_away`); an idle lease there that would be
    parked waits for its agent (it re-adopts the worker) rather than losing its variables."""
    decisions = []
    for lease in leases:
        if lease.state in PARKED_STATES:
            silent = heartbeat_expired(lease, now)
            if silent:
                decisions.append(Decision(lease.id, LeaseState.reclaimed, silent, Reclaim.heartbeat))
            continue
        if lease.state != LeaseState.active.value or is_busy(lease):
            continue
        silent = heartbeat_expired(lease, now)
        if silent:
            decisions.append(Decision(lease.id, LeaseState.reclaimed, silent, Reclaim.heartbeat))
            continue
        idle = idle_expired(lease, now)
        if idle and parks_idle(lease, away):
            continue
        if idle and parks_idle(lease, parkable):
            decisions.append(Decision(lease.id, LeaseState.parked, idle, ParkCode.idle))
        elif idle:
            decisions.append(Decision(lease.id, LeaseState.reclaimed, idle, Reclaim.idle))
    return decisions


def parks_idle(lease: Any, parkable: Collection[str]) -> bool:
    """Whether idleness parks ``lease`` in place (else it ends it): its node can
    park and it did not ask ``on_idle: release``."""
    return bool(parkable) and lease.node_name in parkable and getattr(lease, "on_idle", "park") != "release"


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
    ``c.PoolLeases.idle_warning`` seconds ahead."""
    if lease.state != LeaseState.active.value or lease.worker_state != WorkerState.idle or lease.idle_since is None:
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


def still_idle(lease: Any, now: datetime) -> bool:
    """Whether ``lease`` is still active, idle and past its idle deadline at
    ``now``: the park path re-checks this under the write lock, as the release
    path does :func:`still_due`."""
    return lease.state == LeaseState.active.value and idle_expired(lease, now) is not None


#: Node states whose agent heartbeats: a ``degraded`` one (NVML failed) is alive too.
ALIVE = ("up", "degraded")


def lost_nodes(nodes: Iterable[Any], now: datetime, node_ttl: float) -> list[str]:
    """Names of ``up`` or ``degraded`` nodes (objects with ``name``, ``state``,
    ``last_heartbeat_at``) not heard from for ``node_ttl`` seconds."""
    return [node.name for node in nodes
            if node.state in ALIVE and (now - node.last_heartbeat_at).total_seconds() >= node_ttl]


def agents_away(nodes: Iterable[Any], now: datetime, node_ttl: float, grace: float) -> set[str]:
    """Names of the ``nodes`` (objects with ``name``, ``state``, ``checkpointer`` and
    ``last_heartbeat_at``) that can park but are ``lost`` for now, silent for less than
    ``node_ttl + grace`` seconds: an agent restarting (its refused connection marks its
    node lost at once), whose workers still run and are re-adopted, as a parked lease's are."""
    return {node.name for node in nodes if node.checkpointer and node.state == "lost"
            and (now - node.last_heartbeat_at).total_seconds() < node_ttl + grace}


def lost_parked(leases: Iterable[Any], nodes: Mapping[str, Any], now: datetime, node_ttl: float,
                grace: float) -> list[Decision]:
    """``failed`` for each parked lease (objects with ``id``, ``state``,
    ``node_name``) whose node (``nodes``: name -> objects with ``state`` and
    ``last_heartbeat_at``) is ``lost`` and silent for ``node_ttl + grace``
    seconds: the worker frozen there is as good as gone, and the words say so."""
    decisions = []
    for lease in leases:
        node = nodes.get(lease.node_name)
        if lease.state != LeaseState.parked.value or node is None or node.state != "lost":
            continue
        silent = (now - node.last_heartbeat_at).total_seconds()
        if silent >= node_ttl + grace:
            decisions.append(Decision(lease.id, LeaseState.failed, lost_words(lease.node_name, lease.id, silent)))
    return decisions


def lost_words(node: str, lease_id: str, silent: float | None = None) -> str:
    """What a node lost while a lease was parked there takes with it, in words."""
    heard = f" (no heartbeat for {format_duration(silent)})" if silent is not None else ""
    return (f"node {node} was lost while lease {lease_id} was parked{heard}: its worker and its variables there "
            "are gone")


#: Seconds a move's new lease may run while the lease it replaces is kept (its variables travel
#: worker to worker meanwhile); past them the sweep releases the old one.
MOVE_GRACE_S = 600.0


def outlived(leases: Iterable[Any], now: datetime, grace: float = MOVE_GRACE_S) -> list[Decision]:
    """``reclaimed`` for each active or parked lease that a move's new lease
    replaces (objects with ``id``, ``state``, ``replaces``, ``started_at``)
    which has itself been started for ``grace`` seconds: a move releases its
    old lease when its variables have travelled, so one still held is one the
    quota would otherwise never count again."""
    held = {lease.id: lease for lease in leases if lease.state in (LeaseState.active.value, *PARKED_STATES)}
    return [Decision(old, LeaseState.reclaimed, f"replaced by {lease.id} (a move) {format_duration(grace)} ago, and "
                     "not released since", Reclaim.replaced)
            for lease in held.values()
            if (old := lease.replaces) in held and lease.started_at is not None
            and (now - lease.started_at).total_seconds() >= grace]
