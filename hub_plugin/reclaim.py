"""Idle reclaim's loop: every ``PoolLeases.reclaim_interval`` seconds the
:class:`Reclaimer` reads the store, runs the pure rules of
:mod:`.rules.reclaim` (:func:`~.rules.reclaim.decide`,
:func:`~.rules.reclaim.lost_nodes`, :func:`~.rules.reclaim.lost_parked`;
the rules themselves are described there) and of pressure, and hands each
decision to the park path (:mod:`.parking`) or the one release path
(:mod:`.leases`).

A worker that died is handled when its agent reports it (:mod:`.nodes`).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Callable

from sqlalchemy import select
from sqlalchemy.orm import selectinload

from gpupool.schema import LeaseState
from gpupool.units import format_duration

from .background import Background
from .leases import LeaseBook
from .models import Lease, Node
from .parking import Parking
from .pressure import Pressure
from .rules.reclaim import (PARKED_STATES, ALIVE, Decision, agents_away, decide, lost_nodes, lost_parked, outlived,
                            still_due, still_idle)
from .state import PoolState

log = logging.getLogger("gpupool.service.reclaim")


class Reclaimer:
    """The periodic sweep: reads and marks through ``state``, parks through
    ``parking`` and releases through ``leases`` (in ``tasks``, the background),
    recomputes ``pressure`` (the plan every lease JSON shows). Every
    ``interval`` seconds; a node silent for ``node_ttl`` seconds is lost, and
    its parked leases end after ``parked_node_grace`` more."""

    def __init__(self, state: PoolState, leases: LeaseBook, parking: Parking, tasks: Background, pressure: Pressure,
                 *, interval: float, node_ttl: float, parked_node_grace: float = 600.0) -> None:
        self.state = state
        self.leases = leases
        self.parking = parking
        self.tasks = tasks
        self.pressure = pressure
        self.interval = interval
        self.node_ttl = node_ttl
        self.parked_node_grace = parked_node_grace
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
        """One pass: mark lost nodes, start parking or releasing what must be
        taken back. Its store work runs on the store threads (``state.work``)."""
        now: datetime = self.state.now()
        work = self.state.work
        lost, parkable, decisions, gone, replaced = await work.read(self._due_now, now)
        if lost:
            await work.write(self._mark_lost, lost, now)
        early, preempted = await work.read(self._pressure_now, now, parkable)
        for decision in decisions:
            self._apply(decision, still_idle if decision.parks else still_due)
        for decision in gone:  # parked on a node lost too long
            self._apply(decision, _still_parked)
        for decision in replaced:  # a move's old lease, outlived by its replacement
            self._apply(decision, _still_held)
        for decision in early:  # idle past the early deadline pressure set
            self._apply(decision, self.pressure.still_due)
        for decision in preempted:  # preemptible, its cell running past its preempt_at: frozen mid-cell
            self._apply(decision, self.pressure.still_preempted)
        # The queue: give up on requests whose wait has passed, and place what
        # fits (capacity may have come from a node, not only from a release).
        await self.leases.expire_queue()
        await self.leases.drain_queue(sweep=True)
        return decisions + gone + replaced + early + preempted

    def _apply(self, decision: Decision, only_if: Callable[[Lease, datetime], bool]) -> None:
        """Park or end ``decision``'s lease in the background, ``only_if`` it still qualifies then."""
        if decision.parks:
            self.tasks.spawn(self.parking.park(decision.lease_id, decision.code, decision.reason, only_if=only_if))
        else:
            self.tasks.spawn(self.leases.release(decision.lease_id, decision.state, decision.reason,
                                                 code=decision.code, only_if=only_if))

    def _pressure_now(self, now: datetime, parkable: set[str]) -> tuple[list[Decision], list[Decision]]:
        """Recompute the pressure plan (:mod:`.pressure`); the idle leases past its early deadlines
        and the preemptible ones past their ``preempt_at``."""
        epoch = self.state.capacity_epoch  # read first: a change while reading makes the ETA read again
        with self.state.reading() as session:
            active = session.scalars(select(Lease).where(Lease.state == LeaseState.active.value)
                                     .options(selectinload(Lease.gpus))).all()
            self.pressure.refresh(session, active, now, epoch)
            return self.pressure.due(active, now, parkable), self.pressure.preempts(active, now, parkable)

    def _due_now(self, now: datetime) -> tuple[list[str], set[str], list[Decision], list[Decision], list[Decision]]:
        """``(nodes now lost, nodes that can park, idle and heartbeat decisions, the parked
        leases of nodes lost too long, the old leases of moves outlived (:func:`outlived`))``."""
        with self.state.reading() as session:
            nodes = {node.name: node for node in session.scalars(select(Node))}
            lost = lost_nodes((n for n in nodes.values() if n.state in ALIVE), now, self.node_ttl)
            parkable = {name for name, node in nodes.items() if node.checkpointer and node.state in ALIVE}
            leases = session.scalars(select(Lease).where(Lease.state.in_((LeaseState.active.value,
                                                                          *PARKED_STATES)))).all()
            gone = lost_parked(leases, nodes, now, self.node_ttl, self.parked_node_grace)
            away = agents_away(nodes.values(), now, self.node_ttl, self.parked_node_grace)
            return lost, parkable, decide(leases, now, parkable, away), gone, outlived(leases, now)

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


def _still_parked(lease: Lease, now: datetime) -> bool:
    return lease.state == LeaseState.parked.value


def _still_held(lease: Lease, now: datetime) -> bool:
    """A move's old lease is still to be released: still active or parked."""
    return lease.state in (LeaseState.active.value, LeaseState.parked.value)
