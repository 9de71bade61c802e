"""Idle reclaim's loop: every ``GPUPool.reclaim_interval`` seconds the
:class:`Reclaimer` reads the store, runs the pure rules of
:mod:`.rules.reclaim` (:func:`~.rules.reclaim.decide`,
:func:`~.rules.reclaim.lost_nodes`; the rules themselves are described
there) and hands each decision to the one release path in :mod:`.leases`.

A worker that died is handled when its agent reports it (:mod:`.nodes`).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import selectinload

from gpupool.schema import LeaseState
from gpupool.units import format_duration

from .background import Background
from .leases import LeaseBook
from .models import Lease, Node
from .pressure import Pressure
from .rules.reclaim import ALIVE, Decision, decide, lost_nodes, still_due
from .state import PoolState

log = logging.getLogger("gpupool.service.reclaim")


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
                                                 code=decision.code, only_if=still_due))
        for decision in early:  # the notebook did not park it before its early deadline
            self.tasks.spawn(self.leases.release(decision.lease_id, decision.state, decision.reason,
                                                 code=decision.code, only_if=self.pressure.still_due))
        # The queue: give up on requests whose wait has passed, and place what
        # fits (capacity may have come from a node, not only from a release).
        await self.leases.expire_queue()
        await self.leases.drain_queue(sweep=True)
        return decisions + early

    def _pressure_now(self, now: datetime) -> list[Decision]:
        """Recompute the pressure plan (:mod:`.pressure`); the idle leases past its early deadlines."""
        with self.state.reading() as session:
            active = session.scalars(select(Lease).where(Lease.state == LeaseState.active.value)
                                     .options(selectinload(Lease.gpus))).all()
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
