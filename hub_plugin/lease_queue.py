"""The queue in the store: requests that wait (``queued``) are placed when
capacity frees up, in the order :func:`.queue.drain` gives (its docstring has
the fairness rule), and fail when their ``wait`` passes or their owner's quota
no longer allows them. Parked leases whose resume was asked for wait in the
same line, ahead of their class's new requests, for room on their own node,
or, with ``c.PoolLeases.resume_moves``, on another node (a cold move;
:mod:`.rules.resume`). This module decides and writes; starting (or
resuming, or moving) what was placed and ending what failed is the life
cycle's (:mod:`.leases`, :mod:`.parking`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from gpupool.errors import GPUPoolError
from gpupool.units import format_duration

from . import parked, usage
from .config import PoolLeases, PoolNodes, PoolPressure, PoolQuotas
from .models import Lease, Node
from .placing import Placer
from .quota_book import QuotaBook
from .rules import queue as wait_queue
from .rules.scheduler import Demand, Placement
from .state import PoolState, Transaction
from .transitions import CAPPED, QUEUED, RESUMING, assign

log = logging.getLogger("gpupool.service.leases")

#: Seconds after which the reclaim sweep drains the queue even when no capacity changed here.
FULL_DRAIN_S = 30.0


@dataclass
class Drained:
    """What a drain did: ``placed`` (lease ids, to start) and ``over``
    (``{id: why}`` of requests whose owner's quota no longer allows them, to end ``failed``)."""

    placed: list[str] = field(default_factory=list)
    over: dict[str, str] = field(default_factory=dict)


class LeaseQueue:
    """Drains and expires the queue. ``on_dequeued(seconds)`` is told how long
    each request waited when it is placed (for metrics). Reads ``host_share``
    (``pool_nodes``), the batch settings (``pool_pressure``),
    ``max_active_per_user`` (``pool_quotas``) and ``resume_moves`` (``pool_leases``)."""

    def __init__(self, pool_nodes: PoolNodes, pool_pressure: PoolPressure, pool_quotas: PoolQuotas,
                 pool_leases: PoolLeases, state: PoolState, quotas: QuotaBook, placer: Placer,
                 on_dequeued: Callable[[float], None] = lambda seconds: None) -> None:
        self.pool_nodes = pool_nodes
        self.pool_leases = pool_leases
        self.pool_pressure = pool_pressure
        self.pool_quotas = pool_quotas
        self.state = state
        self.quotas = quotas
        self.placer = placer
        self._on_dequeued = on_dequeued
        self._drained_epoch, self._drained_at = -1, 0.0  # the capacity epoch the last drain saw, and when

    async def drain(self, *, sweep: bool = False) -> Drained:
        """Place queued requests that fit now.

        ``sweep``: the periodic call. Then, when no committed transaction
        changed capacity since the last drain (and that was less than
        :data:`FULL_DRAIN_S` ago, which also catches changes another service
        on the same store made), only the quotas of the queued are checked
        again: a thousand queued requests are not placed anew five times a second."""
        work = self.state.work
        if not await work.read(self._any_queued):
            return Drained()
        fresh = self._drained_epoch == self.state.capacity_epoch and time.monotonic() - self._drained_at < FULL_DRAIN_S
        if sweep and fresh:
            return Drained(over=await work.read(self._over_quota_now))
        return await work.write(self._drain_now)

    async def expired(self) -> dict[str, str]:
        """``{id: reason}`` of the queued requests whose ``wait`` has passed."""
        return await self.state.work.read(self._expired_now)

    def drain_in(self, tx: Transaction, now: datetime) -> Drained:
        """Within a write transaction holding the capacity lock: place what
        :func:`.queue.drain` picks. The queue is read as plain columns; only
        the leases placed are loaded whole, so a thousand queued requests cost
        one light query."""
        session = tx.session
        rows = [row for row in session.execute(
            select(Lease.id, Lease.owner, Lease.fraction, Lease.gpu_count, Lease.requested_memory, Lease.model,
                   Lease.env, Lease.requested_cpus, Lease.requested_host_memory, Lease.created_at, Lease.wait_until,
                   Lease.groups, Lease.lease_class).where(Lease.state == QUEUED))
            if row.wait_until is None or row.wait_until > now]
        resumes = self._resumes(session)
        if not rows and not resumes:
            return Drained()
        over = self._over_quota(session, rows, now)
        share = self.pool_nodes.host_share
        waiting = [wait_queue.Waiting(row.id, row.owner, asked(row, share), row.created_at, row.lease_class)
                   for row in rows if row.id not in over] + resumes
        owners = {w.owner for w in waiting}
        last = usage.last_used(session, owners, now)
        placed = []

        def accept(item: wait_queue.Waiting, decision: Placement) -> bool:
            if not self.placer.verify(session, decision):
                return False  # the index was stale: stop; the next drain decides on a fresh one
            lease = session.get(Lease, item.lease_id)
            if item.resume is not None:
                where = parked.placed(tx, lease, decision, now)  # on another node: a cold move
                log.info("lease %s of %s resumes on %s", item.lease_id, item.owner, where)
            else:
                where = assign(tx, lease, decision, now)
                self._on_dequeued((now - item.created_at).total_seconds())
                log.info("lease %s of %s placed from the queue on %s", item.lease_id, item.owner, where)
            placed.append(item.lease_id)
            return True

        tx.changes.index_taken = True  # drain takes capacity in the index as it goes
        ids = {item.lease_id for item in waiting}
        wait_queue.drain(waiting, self.placer.pool(session), last, now, accept=accept,
                         room=self._room(session, owners), batch_yields=self.pool_pressure.batch_yields,
                         headroom_nodes=self.pool_pressure.batch_headroom_nodes,
                         held_nodes=self.placer.held_nodes(ids), resume_moves=self.pool_leases.resume_moves,
                         cleared=self.placer.cleared_for(ids))
        return Drained(placed, over)

    def _resumes(self, session: Session) -> list[wait_queue.Waiting]:
        """The parked leases whose resume was asked for, as the queue waits for them (their GPUs and
        their node's checkpointer loaded: one query each)."""
        leases = session.scalars(select(Lease).where(RESUMING).options(selectinload(Lease.gpus))).all()
        nodes = {node.name: node for node in session.scalars(
            select(Node).where(Node.name.in_(sorted({lease.node_name for lease in leases}))))} if leases else {}
        share = self.pool_nodes.host_share
        asks = [(lease, parked.resume_ask(lease, nodes[lease.node_name], share)) for lease in leases
                if nodes.get(lease.node_name) is not None and nodes[lease.node_name].state != "lost"]
        return [wait_queue.Waiting(lease.id, lease.owner, ask.demand(), lease.resume_requested_at, lease.lease_class,
                                   ask) for lease, ask in asks]

    def _any_queued(self) -> bool:
        with self.state.reading() as session:
            return (session.scalar(select(Lease.id).where(Lease.state == QUEUED).limit(1)) is not None
                    or session.scalar(select(Lease.id).where(RESUMING).limit(1)) is not None)

    def _drain_now(self) -> Drained:
        self._drained_epoch, self._drained_at = self.state.capacity_epoch, time.monotonic()
        with self.state.writing() as tx:
            self.state.store.lock_capacity(tx.session)
            return self.drain_in(tx, self.state.now())

    def _over_quota_now(self) -> dict[str, str]:
        """:meth:`_over_quota` of the queue, reading one lease per owner (their groups)
        and the ids only of owners who are over."""
        now = self.state.now()
        with self.state.reading() as session:
            firsts = session.execute(select(func.min(Lease.id)).where(Lease.state == QUEUED)
                                     .group_by(Lease.owner)).scalars().all()
            sample = session.execute(select(Lease.id, Lease.owner, Lease.groups).where(Lease.id.in_(firsts))).all()
            over = self._over_quota(session, sample, now)
            owners = {row.owner: over[row.id] for row in sample if row.id in over}
            if not owners:
                return {}
            return {lease_id: owners[owner] for lease_id, owner in session.execute(
                select(Lease.id, Lease.owner).where(Lease.state == QUEUED, Lease.owner.in_(sorted(owners))))}

    def _over_quota(self, session: Session, leases, now: datetime) -> dict[str, str]:
        """Queued leases whose owner may not take them any more (GPU-hours used
        up while they waited, or an admin lowered a limit): ``{id: why}``."""
        over: dict[str, str] = {}
        for owner, groups in {lease.owner: tuple(lease.groups or ()) for lease in leases}.items():
            try:
                # Their own queued requests already count in what they hold: nothing more is asked.
                self.quotas.enforce(session, owner, self.quotas.limits(session, owner, groups), 0.0, now)
            except GPUPoolError as exc:
                over.update({lease.id: f"while queued: {exc.message}" for lease in leases if lease.owner == owner})
        return over

    def _room(self, session: Session, owners: set[str]) -> dict[str, int] | None:
        """How many more leases each of ``owners`` may hold (``c.PoolQuotas.max_active_per_user``; None: no cap)."""
        cap = self.pool_quotas.max_active_per_user
        if cap is None:
            return None
        held = dict(session.execute(select(Lease.owner, func.count()).where(
            Lease.owner.in_(sorted(owners)), Lease.state.in_(CAPPED)).group_by(Lease.owner)).all())
        return {owner: max(0, cap - held.get(owner, 0)) for owner in owners}

    def _expired_now(self) -> dict[str, str]:
        now, share = self.state.now(), self.pool_nodes.host_share
        with self.state.reading() as session:
            due = session.scalars(select(Lease).where(Lease.state == QUEUED, Lease.wait_until <= now)).all()
            return {lease.id: (f"waited {format_duration((now - lease.created_at).total_seconds())} in the "
                               f"queue for {asked(lease, share).describe(noun=True)} and nothing fitting became free "
                               "(ask again, or with a longer --wait)") for lease in due}


def asked(lease: Any, host_share: float) -> Demand:
    """What a queued ``lease`` asks the scheduler for: a :class:`.models.Lease`, or a row of its
    ``fraction``, ``gpu_count``, ``requested_memory`` (bytes per GPU; None: the fraction's share),
    ``model``, ``env``, ``requested_cpus`` and ``requested_host_memory`` (bytes) columns.
    ``host_share``: ``c.PoolNodes.host_share`` (only placement reads it, not the words)."""
    return Demand(lease.fraction, lease.gpu_count, lease.requested_memory, lease.model, lease.env,
                  lease.requested_cpus, lease.requested_host_memory, host_share)
