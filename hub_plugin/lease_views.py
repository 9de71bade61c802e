"""Reading leases as the API shows them: one, a user's list, and the long
poll that answers once a lease leaves a state (:mod:`.watch` wakes it).

The JSON is :func:`.views.lease_body` plus what only the service knows: the
queue place and estimate of a queued request (or of a parked lease waiting to
resume), the idle deadline (early under pressure), the node's state, the host
limits the worker's cgroup gets.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from gpupool.errors import bad_request, not_found
from gpupool.schema import LeaseState, isoformat

from . import usage
from .auth import Identity
from .capacity import HOLDING
from .config import PoolLeases
from .transitions import RESUMING
from .models import Lease, Node
from .parked import may_move
from .pressure import Pressure
from .rules import queue as wait_queue
from .rules.priority import class_rank
from .rules.reclaim import ParkCode
from .rules.hosts import host_limits
from .state import PoolState
from .transitions import QUEUED
from .views import lease_body

#: Most seconds a long poll (``GET /leases/{id}?wait=``) may wait.
MAX_WAIT_S = 60.0
#: Most leases ``GET /leases`` returns (the newest).
LIST_LIMIT = 500


@dataclass(frozen=True)
class QueueView:
    """The queue as one read saw it: lease id -> 1-based place, and lease id ->
    seconds until it is likely placed (:mod:`.rules.eta`; None: nothing known frees enough)."""

    positions: dict[str, int]
    etas: dict[str, float | None]


class LeaseViews:
    """Leases as their owner (or an admin) sees them. ``pressure`` is the
    reclaim sweep's plan, which every lease JSON shows; ``pool_leases`` gives
    the ``idle_warning`` it carries."""

    def __init__(self, pool_leases: PoolLeases, state: PoolState, pressure: Pressure) -> None:
        self.pool_leases = pool_leases
        self.state = state
        self.pressure = pressure

    async def get(self, who: Identity, lease_id: str) -> dict[str, Any]:
        """The lease as ``who`` may see it. 404 when it is someone else's."""
        return await self.state.work.read(self._get_now, who, lease_id)

    def _get_now(self, who: Identity, lease_id: str) -> dict[str, Any]:
        with self.state.reading() as session:
            lease = self.visible(session, who, lease_id)
            return self.json(lease, who, session, self.queue_view(session, [lease]))

    async def wait(self, who: Identity, lease_id: str, state: str | None, seconds: float) -> dict[str, Any]:
        """Long poll: the lease once it is no longer in ``state`` (default: the
        state it is in now), or as it is after ``seconds`` (at most 60)."""
        seconds = min(max(seconds, 0.0), MAX_WAIT_S)
        if state is not None and state not in LeaseState.__members__:
            raise bad_request(f"'state' must be one of {', '.join(LeaseState.__members__)}, got {state!r}")
        watch = self.state.watch
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while True:
            fut = watch.future(lease_id)  # before reading, so no change slips between
            try:
                lease = await self.get(who, lease_id)
            except BaseException:
                fut.cancel()
                raise
            state = state or lease["state"]
            left = deadline - loop.time()
            if lease["state"] != state or left <= 0 or watch.closed:
                fut.cancel()
                return lease
            await watch.changed(fut, left)

    async def wait_out(self, lease_id: str, state: str, seconds: float) -> None:
        """Return once ``lease_id`` is no longer in ``state``, or after ``seconds``."""
        watch = self.state.watch
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while loop.time() < deadline and not watch.closed:
            fut = watch.future(lease_id)
            try:
                now_in = await self.state.work.read(self._state_now, lease_id)
            except BaseException:
                fut.cancel()
                raise
            if now_in != state:
                fut.cancel()
                return
            await watch.changed(fut, deadline - loop.time())

    def _state_now(self, lease_id: str) -> str | None:
        with self.state.reading() as session:
            return session.scalar(select(Lease.state).where(Lease.id == lease_id))

    async def list(self, who: Identity, *, active: bool = True, kernel_id: str | None = None,
                   all_users: bool = False) -> list[dict[str, Any]]:
        """``who``'s own leases, oldest first (at most the newest 500);
        ``active``: only those holding capacity, parked or queued; ``kernel_id``: only that kernel's;
        ``all_users``: every user's (an admin's call: the handler checks), each as an admin sees it.
        Takes a fixed number of queries, whatever the number of leases or of queued requests."""
        return await self.state.work.read(self._list_now, who, active, kernel_id, all_users)

    def _list_now(self, who: Identity, active: bool, kernel_id: str | None, all_users: bool) -> list[dict[str, Any]]:
        query = select(Lease) if all_users else select(Lease).where(Lease.owner == who.name)
        if active:
            query = query.where(Lease.state.in_((*HOLDING, QUEUED, LeaseState.parked.value)))
        if kernel_id:
            query = query.where(Lease.kernel_id == kernel_id)
        query = query.options(selectinload(Lease.gpus), selectinload(Lease.events))
        with self.state.reading() as session:
            rows = session.scalars(query.order_by(Lease.created_at.desc()).limit(LIST_LIMIT)).all()
            queue = self.queue_view(session, rows)
            nodes = _nodes(session, rows)
            return [self.json(lease, who, session, queue, nodes) for lease in reversed(rows)]

    async def owner(self, who: Identity, lease_id: str) -> str:
        """The owner of a lease ``who`` may see; else 404."""
        return await self.state.work.read(self._owner_now, who, lease_id)

    def _owner_now(self, who: Identity, lease_id: str) -> str:
        with self.state.reading() as session:
            return self.visible(session, who, lease_id).owner

    # -- within a session ------------------------------------------------------------------------

    @staticmethod
    def visible(session: Session, who: Identity, lease_id: str, *, owner_only: bool = False) -> Lease:
        """The lease if ``who`` may see it (its owner, or an admin unless
        ``owner_only``); else 404, so its existence is not revealed. A lease
        that does not exist and one of someone else take the same one query
        (the owner is part of it), so the answer's time does not tell them apart."""
        query = select(Lease).where(Lease.id == lease_id)
        if owner_only or not who.admin:
            query = query.where(Lease.owner == who.name)
        lease = session.scalars(query.options(selectinload(Lease.gpus), selectinload(Lease.events))).first()
        if lease is None:
            raise not_found(f"lease {lease_id}")
        return lease

    def json(self, lease: Lease, who: Identity, session: Session, queue: QueueView | None = None,
             nodes: dict[str, Any] | None = None) -> dict[str, Any]:
        """The lease JSON (:func:`.views.lease_body`), with ``queue_position``/``queue_estimate_s`` while
        queued (from ``queue``, see :meth:`queue_view`) and ``node_state``
        (from ``nodes``, else read), ``cpu_limit``/``host_memory_limit`` (the
        worker's cgroup limits: :func:`.rules.hosts.host_limits`), ``wait_until``, and
        ``idle_deadline`` with ``idle_warning`` (for the notebook's warning before idle reclaim:
        :func:`warning_lead`)."""
        if nodes is None:
            nodes = _nodes(session, [lease])
        node = nodes.get(lease.node_name) if lease.node_name else None
        limits = host_limits(lease, node if node is not None else _GONE)  # what the agent is told to enforce
        place = queue.positions.get(lease.id) if _in_line(lease) and queue is not None else None
        return lease_body(
            lease, for_owner=lease.owner == who.name,  # no move from a lost node: its state waits there
            moves=self.pool_leases.resume_moves and (node is None or node.state != "lost"),
            queue_position=place, queue_estimate_s=queue.etas.get(lease.id) if place is not None else None,
            wait_until=isoformat(lease.wait_until),
            **self.pressure.shown(lease),  # idle_deadline, early under pressure; pressure; preempt_at
            idle_warning=warning_lead(self.pool_leases.idle_warning, lease.idle_timeout),
            node_state=node.state if node is not None else None,
            cpu_limit=limits.get("cpus"), host_memory_limit=limits.get("host_memory")).to_json()

    def newest_view(self, session: Session, lease: Lease) -> QueueView | None:
        """:meth:`queue_view` of a request just queued, from counts per owner, class and shape (no row
        per queued request): every request ahead of the newest is placed before it, in whatever order;
        so is every resume waiting of its class or a higher one. The newest is last, so every node cleared
        for a request ahead is open again once that request is placed: no node is held against it."""
        if lease.state != QUEUED:
            return None
        groups = session.execute(select(Lease.owner, Lease.lease_class, Lease.fraction, Lease.gpu_count, func.count())
                                 .where(Lease.state == QUEUED)
                                 .group_by(Lease.owner, Lease.lease_class, Lease.fraction, Lease.gpu_count)).all()
        last = usage.last_used(session, {row[0] for row in groups}, self.state.now())
        asks = [(class_rank(lease_class), 1, (fraction, count, lease_class))
                for owner, lease_class, fraction, count, number in groups
                if wait_queue.before_newest(owner, lease_class, lease.owner, lease.lease_class, last)
                for _ in range(number)]
        asks += [(class_rank(resume.lease_class), 0, self._resume_ask(resume, remap))
                 for resume, remap in self._resumes(session)
                 if class_rank(resume.lease_class) <= class_rank(lease.lease_class)]
        asks.sort(key=lambda ask: ask[:2])  # the queue's order: interactive first, resumes first in a class
        own = (lease.fraction, lease.gpu_count, lease.lease_class)
        ordered = [ask for _, _, ask in asks]
        ordered.remove(own)  # its own goes last of its class (the last there is: none after it is counted)
        ordered.append(own)
        self.pressure.renew(session, self.state.capacity_epoch, self.state.now())  # one POST, not a long poll
        return QueueView({lease.id: len(ordered)}, {lease.id: self.pressure.etas(ordered, self.state.now())[-1]})

    def queue_view(self, session: Session, leases) -> QueueView | None:
        """What the queued ones of ``leases`` need for ``queue_position`` and
        ``queue_estimate_s``: the queue's order, read once as three columns and
        sorted once (a fixed number of queries, however many leases are shown;
        the queue itself is at most users x ``c.PoolQuotas.max_queued_per_user``);
        None when none of ``leases`` is queued."""
        if not any(_in_line(lease) for lease in leases):
            return None
        queued = session.execute(select(Lease.id, Lease.owner, Lease.created_at, Lease.lease_class,
                                        Lease.fraction, Lease.gpu_count).where(Lease.state == QUEUED)).all()
        resumes = self._resumes(session)
        last = usage.last_used(session, {row[1] for row in queued} | {r.owner for r, _ in resumes}, self.state.now())
        places = wait_queue.positions([*((row[0], row[1], row[2], row[3], False) for row in queued),
                                       *((r.id, r.owner, r.resume_requested_at, r.lease_class,
                                          r.park_code != ParkCode.preemption) for r, _ in resumes)], last)
        asked = {row[0]: (row[4], row[5], row[3]) for row in queued}
        asked.update((resume.id, self._resume_ask(resume, remap)) for resume, remap in resumes)
        in_line = sorted(places, key=places.get)
        self.pressure.follow(session, self.state.capacity_epoch)
        # A node cleared for one of them is that one's (a request ahead of it is kept off it).
        etas = self.pressure.etas([asked[i] for i in in_line], self.state.now(), in_line, set(in_line))
        return QueueView(places, dict(zip(in_line, etas)))

    @staticmethod
    def _resumes(session: Session) -> list[tuple[Lease, bool]]:
        """The parked leases waiting to resume (their GPUs loaded), each with whether its node's
        checkpointer can remap: two queries."""
        leases = session.scalars(select(Lease).where(RESUMING).options(selectinload(Lease.gpus))).all()
        if not leases:
            return []
        remap = {name: bool((checkpointer or {}).get("remap")) for name, checkpointer in session.execute(
            select(Node.name, Node.checkpointer).where(Node.name.in_(sorted({x.node_name for x in leases}))))}
        return [(lease, remap.get(lease.node_name, False)) for lease in leases]

    def _resume_ask(self, lease: Lease, remap: bool) -> tuple:
        """A resume as the ETA sees it: its slice, class, and the GPUs it may take (its node's,
        then other nodes' where it may move)."""
        moves = may_move(lease, self.pool_leases.resume_moves)
        return (lease.fraction, lease.gpu_count, lease.lease_class, self.pressure.resume_room(lease, remap, moves))


def _in_line(lease: Lease) -> bool:
    """Whether ``lease`` waits in the queue: queued, or parked with a resume asked for."""
    return lease.state == QUEUED or (lease.state == LeaseState.parked.value and lease.resume_requested_at is not None)


def _nodes(session: Session, leases):
    """Name -> ``(name, state, host_cpus, host_memory)`` of the nodes ``leases`` are on (one query)."""
    names = sorted({lease.node_name for lease in leases if lease.node_name})
    if not names:
        return {}
    return {row.name: row for row in session.execute(
        select(Node.name, Node.state, Node.host_cpus, Node.host_memory).where(Node.name.in_(names)))}


#: A node no longer registered: its host is unknown, so the limits shown are what the lease holds.
_GONE = SimpleNamespace(state=None, host_cpus=None, host_memory=None)


def warning_lead(idle_warning: float, idle_timeout: float | None) -> float:
    """Seconds before the idle deadline that the notebook warns: ``c.PoolLeases.idle_warning``, but
    never more than a third of the lease's idle timeout (a 1-minute timeout is warned 20 s ahead,
    not at every cell's end). 0 stays 0 (no warning)."""
    return min(idle_warning, idle_timeout / 3) if idle_timeout else idle_warning
