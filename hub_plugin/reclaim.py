"""Idle reclaim: which active leases to take back, and which nodes are lost.

:func:`decide` and :func:`lost_nodes` are pure (rows and ``now`` in,
decisions out), so tests move time by passing a different ``now``. The
:class:`Reclaimer` loop runs them every ``GPUPool.reclaim_interval`` seconds
and hands each decision to the one release path in :mod:`.leases`.

Rules (docs/api.md, "Reclaim"):

- heartbeat: no heartbeat from the notebook kernel for ``heartbeat_ttl``
  while no cell runs -> ``reclaimed``;
- idle: the agent reports the worker ``idle`` and ``now - idle_since >=
  idle_timeout`` -> ``reclaimed``;
- a worker that is ``busy`` (a cell is running) is never reclaimed by either;
- pressure (:mod:`.pressure`, :mod:`.priority`): while requests wait, an idle
  over-quota lease's deadline comes after ``c.GPUPool.pressure_grace``.

A worker that died is handled when its agent reports it (:mod:`.nodes`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Iterable

from sqlalchemy import select

from gpupool.schema import LeaseState
from gpupool.units import format_duration

from .background import Background
from .models import Lease, Node
from .state import PoolState

if TYPE_CHECKING:  # .pressure (which the lease views use) imports this module's rules
    from .leases import LeaseBook
    from .pressure import Pressure

log = logging.getLogger("gpupool.service.reclaim")


@dataclass(frozen=True)
class Decision:
    """End ``lease_id`` in ``state`` (a final state) for ``reason`` (words)."""

    lease_id: str
    state: LeaseState
    reason: str


def decide(leases: Iterable[Any], now: datetime) -> list[Decision]:
    """Decisions for ``leases``: objects with the attributes of
    :class:`~.models.Lease` (``id``, ``state``, ``worker_state``,
    ``idle_since``, ``idle_timeout``, ``last_heartbeat_at``, ``started_at``,
    ``heartbeat_ttl``). Only ``active`` leases are considered."""
    decisions = []
    for lease in leases:
        if lease.state != LeaseState.active.value or lease.worker_state == "busy":
            continue
        reason = heartbeat_expired(lease, now) or idle_expired(lease, now)
        if reason:
            decisions.append(Decision(lease.id, LeaseState.reclaimed, reason))
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


class Reclaimer:
    """The periodic sweep: reads and marks through ``state``, releases through
    ``leases`` (in ``tasks``, the background), recomputes ``pressure`` (the
    plan every lease JSON shows). Every ``interval`` seconds; a node silent for
    ``node_ttl`` seconds is lost."""

    def __init__(self, state: PoolState, leases: LeaseBook, tasks: Background, pressure: Pressure, *,
                 interval: float, node_ttl: float) -> None:
        self.state = state
        self.leases = leases
        self.tasks = tasks
        self.pressure = pressure
        self.interval = interval
        self.node_ttl = node_ttl
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:  # one bad sweep must not end reclaim for good
                log.exception("reclaim sweep failed; retrying in %ss", self.interval)
            await asyncio.sleep(self.interval)

    async def sweep(self) -> list[Decision]:
        """One pass: mark lost nodes, start releasing what must be reclaimed.
        Its store work runs on the store threads (``state.work``)."""
        now: datetime = self.state.now()
        work = self.state.work
        lost, decisions = await work.read(self._due_now, now)
        if lost:
            await work.write(self._mark_lost, lost, now)
        early = await work.read(self._pressure_now, now)
        for decision in decisions:
            self.tasks.spawn(self.leases.release(decision.lease_id, decision.state, decision.reason,
                                                 only_if=still_due))
        for decision in early:  # the notebook did not park it before its early deadline
            self.tasks.spawn(self.leases.release(decision.lease_id, decision.state, decision.reason,
                                                 only_if=self.pressure.still_due))
        # The queue: give up on requests whose wait has passed, and place what
        # fits (capacity may have come from a node, not only from a release).
        await self.leases.expire_queue()
        await self.leases.drain_queue(sweep=True)
        return decisions + early

    def _pressure_now(self, now: datetime) -> list[Decision]:
        """Recompute the pressure plan (:mod:`.pressure`); the idle leases past its early deadlines."""
        with self.state.reading() as session:
            active = session.scalars(select(Lease).where(Lease.state == LeaseState.active.value)).all()
            self.pressure.refresh(session, active, now)
            return self.pressure.due(active, now)

    def _due_now(self, now: datetime) -> tuple[list[str], list[Decision]]:
        with self.state.reading() as session:
            lost = lost_nodes(session.scalars(select(Node).where(Node.state.in_(ALIVE))), now, self.node_ttl)
            active = session.scalars(select(Lease).where(Lease.state == LeaseState.active.value)).all()
            return lost, decide(active, now)

    def _mark_lost(self, names: list[str], now: datetime) -> None:
        with self.state.writing() as tx:
            # Re-check under the write lock: a heartbeat may have come in since.
            for node in tx.session.scalars(select(Node).where(Node.name.in_(names))):
                if lost_nodes([node], now, self.node_ttl):
                    node.state = "lost"
                    node.state_reason = f"no heartbeat from its agent for {format_duration(self.node_ttl)}"
                    tx.changes.node(node.name)
                    log.warning("node %s lost: no heartbeat for %s; nothing new is placed there",
                                node.name, format_duration(self.node_ttl))
