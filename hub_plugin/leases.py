"""The lease life cycle: the one place a lease changes state.

    create -> starting --(agent started the worker)--> active
                 |                                        |
                 +--------------> releasing <-------------+
                                     |
                        released | reclaimed | failed

- :meth:`LeaseBook.create` checks and reserves capacity in one serialized
  write transaction (the scheduler decides on the allocation summed from
  the leases that hold capacity) and writes the lease ``starting``; then a
  background task asks the node's agent for a worker.
- :meth:`LeaseBook.release` is the one release path, used by ``DELETE``,
  reclaim and a worker's death alike: ``releasing``, stop the worker on the
  agent, then the final state with its reason, ``ended_at`` and the usage,
  recorded once. The slice stays reserved until the worker is stopped (or
  the agent could not be reached: then the agent's next heartbeat is told to
  stop the orphan).
- Every transition is stored as a :class:`~.models.LeaseEvent` and wakes
  long polls (:mod:`.watch`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, Callable, Coroutine, Iterator

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, selectinload

from gpupool.errors import GPUPoolError, bad_request, not_found
from gpupool.schema import LeaseRequest, LeaseState, isoformat, utcnow
from gpupool.units import format_duration

from . import queue as wait_queue, usage
from .agent_client import AgentClient
from .auth import Identity
from .capacity import HOLDING, CapacityIndex, mark_gpus
from .config import GPUPool
from .db import Store
from .models import GPU, Lease, LeaseEvent, LeaseGPU, Node, new_lease_id
from .quota_book import QuotaBook
from .reclaim import idle_deadline
from .scheduler import DEFAULT_WORKLOAD, Demand, Placement, Refusal, Workload, workload_of
from .views import lease_json
from .watch import LeaseWatch

log = logging.getLogger("gpupool.service.leases")

#: Most seconds a long poll (``GET /leases/{id}?wait=``) may wait.
MAX_WAIT_S = 60.0
#: Most leases ``GET /leases`` returns (the newest).
LIST_LIMIT = 500
#: Ended leases whose lengths feed the queue's wait estimate.
ESTIMATE_SAMPLE = 50
#: The scheduler's expected workload is the mix of the last this many requests ...
WORKLOAD_WINDOW = 1000
#: ... once there are at least this many (before: scheduler.DEFAULT_WORKLOAD); recomputed every this many.
WORKLOAD_MIN = 50
QUEUED = LeaseState.queued.value


class LeaseBook:
    """Creates, reads and ends leases.

    ``settings`` are the service's ``c.GPUPool``; ``now`` is the one clock
    (UTC-aware datetimes), replaceable so time can be moved in tests;
    ``on_refusal(reasons)`` is told every refusal and ``on_dequeued(seconds)``
    how long each queued request waited when it is placed (for metrics).
    """

    def __init__(self, settings: GPUPool, store: Store, agents: AgentClient, *,
                 now: Callable[[], datetime] = utcnow,
                 on_refusal: Callable[[dict[str, int]], None] | None = None,
                 on_dequeued: Callable[[float], None] = lambda seconds: None) -> None:
        self.settings = settings
        self.store = store
        self.agents = agents
        self.now = now
        self.watch = LeaseWatch()
        self._on_refusal = on_refusal
        self._on_dequeued = on_dequeued
        self._tasks: set[asyncio.Task] = set()
        self.capacity = CapacityIndex(settings.context_overhead)
        self._recent: deque[Demand] | None = None  # recent requests, read from the store at first use
        self._shapes: Workload | None = None
        # A lambda, so a clock replaced on this book is the quotas' clock too.
        self.quotas = QuotaBook(settings, lambda: self.now())

    # -- reading ---------------------------------------------------------------

    def get(self, who: Identity, lease_id: str) -> dict[str, Any]:
        """The lease as ``who`` may see it. 404 when it is someone else's."""
        with self.store.read() as session:
            return self._json(self._visible(session, who, lease_id), who, session)

    async def wait(self, who: Identity, lease_id: str, state: str | None, seconds: float) -> dict[str, Any]:
        """Long poll: the lease once it is no longer in ``state`` (default: the
        state it is in now), or as it is after ``seconds`` (at most 60)."""
        seconds = min(max(seconds, 0.0), MAX_WAIT_S)
        if state is not None and state not in LeaseState.__members__:
            raise bad_request(f"'state' must be one of {', '.join(LeaseState.__members__)}, got {state!r}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while True:
            fut = self.watch.future(lease_id)  # before reading, so no change slips between
            lease = self.get(who, lease_id)
            state = state or lease["state"]
            left = deadline - loop.time()
            if lease["state"] != state or left <= 0 or self.watch.closed:
                fut.cancel()
                return lease
            await self.watch.changed(fut, left)

    def list(self, who: Identity, *, active: bool = True, kernel_id: str | None = None) -> list[dict[str, Any]]:
        """``who``'s own leases, oldest first (at most the newest 500);
        ``active``: only those holding capacity or queued; ``kernel_id``: only that kernel's."""
        query = select(Lease).where(Lease.owner == who.name)
        if active:
            query = query.where(Lease.state.in_((*HOLDING, QUEUED)))
        if kernel_id:
            query = query.where(Lease.kernel_id == kernel_id)
        query = query.options(selectinload(Lease.gpus), selectinload(Lease.events))
        with self.store.read() as session:
            rows = session.scalars(query.order_by(Lease.created_at.desc()).limit(LIST_LIMIT)).all()
            return [self._json(lease, who, session) for lease in reversed(rows)]

    # -- creating --------------------------------------------------------------

    def create(self, who: Identity, body: Any) -> dict[str, Any]:
        """Validate ``body`` (a ``LeaseRequest``), check the quota, place it and
        reserve the capacity in one transaction, and start the worker in the background.

        Returns the lease JSON: state ``starting``, or ``queued`` when nothing
        fits and the request has a ``wait``. Raises 400 ``bad_request`` for bad
        input, 429 ``quota_exceeded`` (with ``limit``) over a quota, and 409
        ``pool_full`` (with ``reasons``) when nothing fits and there is no ``wait``.
        """
        request = LeaseRequest.from_json(body)
        wait = self._wait(request.wait)
        demand = Demand(request.fraction, request.gpu_count, request.memory, request.model)
        groups = self.quotas.groups_of(who)
        now = self.now()
        with self.writing() as session:
            # The lock comes first: the quota check and the placement below
            # then see every lease committed before, and no other decision interleaves.
            self.store.lock_capacity(session)
            limits = self.quotas.limits(session, who.name, groups)
            idle_timeout = self._idle_timeout(request.idle_timeout, limits.max_idle_timeout)
            try:
                self.quotas.enforce(session, who.name, limits, request.fraction * request.gpu_count, now)
            except GPUPoolError as exc:
                if self._on_refusal is not None:  # counted by limit, beside the scheduler's reasons
                    self._on_refusal({f"quota {exc.extra.get('limit')}": 1})
                raise
            decision = self._place(session, demand)
            if isinstance(decision, Refusal) and not wait:
                self._refused(who, decision)
            lease = Lease(id=new_lease_id(), owner=who.name, fraction=request.fraction,
                          gpu_count=request.gpu_count, memory=request.memory or 0, kernel_id=request.kernel_id,
                          idle_timeout=idle_timeout, heartbeat_ttl=self.settings.heartbeat_ttl,
                          created_at=now, usage_gpu_seconds=0.0, groups=list(groups), model=request.model,
                          requested_memory=request.memory, server_name=request.server_name, env=request.env)
            if isinstance(decision, Placement):
                where = self._assign(session, lease, decision, now)
            else:
                lease.wait_until = now + timedelta(seconds=wait)
                where = "the queue"
                _transition(session, lease, LeaseState.queued,
                            f"waiting up to {format_duration(wait)}: {decision.message}", now)
                if self._on_refusal is not None:
                    self._on_refusal(decision.reasons)
            session.add(lease)  # only now: _assign's query would flush a lease without a state
            session.flush()
            result = self._json(lease, who, session)
        log.info("lease %s created for %s: %s on %s", lease.id, who.name, demand.describe(), where)
        if isinstance(decision, Placement):
            self.spawn(self._start(lease.id))
        return result

    def _place(self, session: Session, demand: Demand) -> Placement | Refusal:
        """The scheduler's decision for ``demand`` on the pool as ``session``
        sees it (the capacity lock is held), through the in-memory index."""
        workload = self._workload(session, demand)
        decision = self.capacity.get(session, workload).place(demand)
        if isinstance(decision, Placement) and not self.capacity.verify(session, decision):
            decision = self.capacity.get(session, workload).place(demand)  # rebuilt from the store
        return decision

    def _workload(self, session: Session, new: Demand | None = None) -> Workload:
        """The expected mix of requests the scheduler weighs: the last
        :data:`WORKLOAD_WINDOW` requests (``new`` included), or the scheduler's
        default while the pool has seen fewer than :data:`WORKLOAD_MIN`."""
        if self._recent is None:
            rows = session.execute(select(Lease.fraction, Lease.gpu_count)
                                   .order_by(Lease.created_at.desc()).limit(WORKLOAD_WINDOW)).all()
            self._recent = deque((Demand(f, c) for f, c in reversed(rows)), maxlen=WORKLOAD_WINDOW)
        if new is not None:
            self._recent.append(new)
            if len(self._recent) % WORKLOAD_MIN == 0:
                self._shapes = None
        if self._shapes is None:
            self._shapes = workload_of(self._recent) if len(self._recent) >= WORKLOAD_MIN else DEFAULT_WORKLOAD
        return self._shapes

    def _assign(self, session: Session, lease: Lease, decision: Placement, now: datetime) -> str:
        """Give ``lease`` the GPUs of ``decision`` and make it ``starting``; returns where, in words."""
        gpus = {g.uuid: g for g in session.scalars(select(GPU).where(GPU.uuid.in_(decision.gpus)))}
        lease.fraction, lease.memory, lease.node_name = decision.fraction, decision.memory, decision.node
        lease.gpus = [LeaseGPU(gpu_uuid=u, name=gpus[u].name, index=gpus[u].index) for u in decision.gpus]
        where = ", ".join(f"GPU {g.index} ({g.name})" for g in lease.gpus)
        _transition(session, lease, LeaseState.starting, f"placed on {decision.node}: {where}", now)
        return f"{decision.node} {where}"

    def _wait(self, asked: float | None) -> float:
        """Seconds a request may queue (0: not at all); 400 above ``c.GPUPool.max_wait``."""
        if not asked:
            return 0.0
        if asked > self.settings.max_wait:
            raise bad_request(f"wait {format_duration(asked)} is above this pool's maximum of "
                              f"{format_duration(self.settings.max_wait)}; ask for less "
                              "(an admin can raise c.GPUPool.max_wait)", max_wait=self.settings.max_wait)
        return asked

    def _idle_timeout(self, asked: float | None, most: float | None) -> float:
        """The lease's idle timeout: ``asked``, or the pool's default capped at
        ``most`` (the user's quota, by default ``c.GPUPool.max_idle_timeout``)."""
        if asked is None:
            return self.settings.idle_timeout if most is None else min(self.settings.idle_timeout, most)
        if most is not None and asked > most:
            raise bad_request(f"idle_timeout {format_duration(asked)} is above this pool's maximum of "
                              f"{format_duration(most)}; ask for less (an admin can raise "
                              "c.GPUPool.max_idle_timeout, or max_idle_timeout in your quota)",
                              max_idle_timeout=most)
        return asked

    def _refused(self, who: Identity, refusal: Refusal) -> None:
        if self._on_refusal is not None:
            self._on_refusal(refusal.reasons)
        log.info("lease for %s refused: %s", who.name, refusal.message)
        raise GPUPoolError("pool_full", refusal.message, 409, reasons=refusal.reasons)

    async def _start(self, lease_id: str) -> None:
        """Ask the agent for the worker; ``active`` on success, else the
        release path ends the lease ``failed`` with the agent's reason."""
        with self.store.read() as session:
            lease = session.get(Lease, lease_id, options=[selectinload(Lease.gpus)])
            if lease is None or lease.state != LeaseState.starting.value:
                return
            node = session.get(Node, lease.node_name)
            url, node_name = node.url, node.name
            body = {"lease_id": lease.id, "owner": lease.owner, "gpus": [g.gpu_uuid for g in lease.gpus],
                    "fraction": lease.fraction, "memory": lease.memory}
            if lease.env is not None:
                body["env"] = lease.env  # the agent refuses an environment it does not offer, in words
        try:
            reply = await self.agents.start_worker(url, body, self.settings.worker_start_timeout)
        except GPUPoolError as exc:
            log.warning("lease %s: worker start on %s failed: %s", lease_id, node_name, exc.log_message)
            await self.release(lease_id, LeaseState.failed,
                               f"the worker could not start on {node_name}: {exc.message}")
            return
        now = self.now()
        pid = reply.get("pid") if isinstance(reply.get("pid"), int) else None
        with self.writing() as session:
            lease = session.get(Lease, lease_id)
            started = lease is not None and lease.state == LeaseState.starting.value
            if started:
                lease.connection = reply["connection"]
                lease.worker_pid = pid
                lease.worker_state = "idle"  # the kernel answered, no cell has run yet
                lease.started_at = lease.last_heartbeat_at = lease.idle_since = now
                _transition(session, lease, LeaseState.active, f"the worker started on {node_name} (pid {pid})", now)
        if started:
            log.info("lease %s active: worker pid %s on %s", lease_id, pid, node_name)
            return
        # Released while the worker was starting: the release path may have
        # asked the agent before the worker existed, so stop it now.
        log.info("lease %s ended while its worker started; stopping the worker on %s", lease_id, node_name)
        await self._stop_worker(url, lease_id)

    # -- heartbeats --------------------------------------------------------------

    def heartbeat(self, who: Identity, lease_id: str) -> dict[str, Any]:
        """The client's liveness: renew ``last_heartbeat_at`` while the lease
        holds capacity. Returns the lease (ended ones too, so the client learns why)."""
        with self.writing() as session:
            lease = self._visible(session, who, lease_id, owner_only=True)
            if LeaseState(lease.state).holds_capacity:
                lease.last_heartbeat_at = self.now()
            return self._json(lease, who, session)

    # -- ending ----------------------------------------------------------------------

    async def release_by(self, who: Identity, lease_id: str, words: str | None) -> dict[str, Any]:
        """``DELETE /leases/{id}`` by its owner or an admin. Idempotent: an
        ended lease is returned as it is."""
        if words is not None and (not words.strip() or len(words) > 200):
            raise bad_request("'reason' must be 1 to 200 characters")
        with self.store.read() as session:
            lease = self._visible(session, who, lease_id)
            owner = lease.owner
        by = "its owner" if owner == who.name else f"admin {who.name}"
        reason = f"released by {by}" + (f": {words.strip()}" if words else "")
        await self.release(lease_id, LeaseState.released, reason)
        return self.get(who, lease_id)

    async def release(self, lease_id: str, final: LeaseState, reason: str, *,
                      only_if: Callable[[Lease, datetime], bool] | None = None) -> None:
        """The one release path. Ends ``lease_id`` in ``final`` (released,
        reclaimed or failed) for ``reason``; returns once it has ended.

        ``only_if(lease, now)`` is re-checked under the write lock (reclaim
        uses it so a lease that became busy meanwhile is kept). A lease that
        is already releasing is waited for; an ended one is left alone. An
        unreachable agent does not stop the release.
        """
        now = self.now()
        with self.writing() as session:
            lease = session.get(Lease, lease_id)
            if lease is None or LeaseState(lease.state).ended:
                return
            mine = lease.state != LeaseState.releasing.value
            if mine and only_if is not None and not only_if(lease, now):
                return
            if mine:
                lease.end_state, lease.reason = final.value, reason
                _transition(session, lease, LeaseState.releasing, reason, now)
                url = session.get(Node, lease.node_name).url if lease.node_name else None
        if not mine:  # someone else is releasing it: wait for them
            await self._wait_left(lease_id, LeaseState.releasing.value, self.settings.worker_stop_timeout + 5)
            return
        log.info("lease %s releasing (%s): %s", lease_id, final.value, reason)
        self._finish(lease_id, await self._stop_worker(url, lease_id) if url else None)

    def _finish(self, lease_id: str, note: str | None = None) -> None:
        """``releasing`` -> its final state; records ``ended_at`` and usage
        (the ledger record) once, and places queued requests on what it freed,
        all in one transaction. ``note``: words added to the reason of a
        released or reclaimed lease (the worker's stop was not confirmed; a
        failed lease's worker is dead or never started, so no news there)."""
        now = self.now()
        with self.writing() as session:
            self.store.lock_capacity(session)  # the queue is drained below
            lease = session.get(Lease, lease_id)
            if lease is None or lease.state != LeaseState.releasing.value:
                return
            final = LeaseState(lease.end_state or LeaseState.released.value)
            if note and final is not LeaseState.failed:
                lease.reason = f"{lease.reason}; {note}"
            lease.ended_at = now
            held = (now - lease.started_at).total_seconds() if lease.started_at else 0.0
            lease.usage_gpu_seconds = usage.close(session, lease, now)
            lease.connection = None  # the worker and its key are gone
            _transition(session, lease, final, lease.reason, now)
            used = lease.usage_gpu_seconds
            placed, over = self._drain(session, now)
        log.info("lease %s %s after %s (%.1f GPU-seconds): %s", lease_id, final.value,
                 format_duration(held), used, lease.reason)
        self._after_drain(placed, over)

    # -- the queue -------------------------------------------------------------------------

    def drain_queue(self) -> list[str]:
        """Place queued requests that fit now (the reclaim sweep, node
        registrations and nodes coming back call this; releases drain in their
        own transaction).
        Returns the ids placed."""
        with self.store.read() as session:
            if session.scalar(select(Lease.id).where(Lease.state == QUEUED).limit(1)) is None:
                return []
        with self.writing() as session:
            self.store.lock_capacity(session)
            placed, over = self._drain(session, self.now())
        self._after_drain(placed, over)
        return placed

    def _drain(self, session: Session, now: datetime) -> tuple[list[str], dict[str, str]]:
        """Within a write transaction holding the capacity lock: place what
        :func:`.queue.drain` picks (its docstring has the fairness rule).
        Returns the ids placed, and ``{id: why}`` of requests whose owner's
        quota no longer allows them (to end ``failed`` after the commit)."""
        rows = {lease.id: lease for lease in session.scalars(
            select(Lease).where(Lease.state == QUEUED).options(selectinload(Lease.gpus), selectinload(Lease.events)))
            if lease.wait_until is None or lease.wait_until > now}
        if not rows:
            return [], {}
        over = self._over_quota(session, rows.values(), now)
        waiting = [_waiting(lease) for lease in rows.values() if lease.id not in over]
        last = usage.last_used(session, [w.owner for w in waiting], now)
        placed = []

        def accept(item: wait_queue.Waiting, decision: Placement) -> bool:
            if not self.capacity.verify(session, decision):
                return False  # the index was stale: stop; the next drain decides on a fresh one
            where = self._assign(session, rows[item.lease_id], decision, now)
            self._on_dequeued((now - item.created_at).total_seconds())
            log.info("lease %s of %s placed from the queue on %s", item.lease_id, item.owner, where)
            placed.append(item.lease_id)
            return True

        session.info["capacity_index_changed"] = True  # drain takes capacity in the index as it goes
        wait_queue.drain(waiting, self.capacity.get(session, self._workload(session)), last, now, accept=accept)
        return placed, over

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

    def _after_drain(self, placed: list[str], over: dict[str, str]) -> None:
        self._start_all(placed)
        for lease_id, why in over.items():
            self.spawn(self.release(lease_id, LeaseState.failed, why, only_if=_is_queued))

    def _start_all(self, lease_ids: list[str]) -> None:
        for lease_id in lease_ids:
            self.spawn(self._start(lease_id))

    def expire_queue(self) -> list[str]:
        """End ``failed`` every queued request whose ``wait`` has passed; returns their ids."""
        now = self.now()
        with self.store.read() as session:
            due = session.scalars(select(Lease).where(Lease.state == QUEUED, Lease.wait_until <= now)).all()
            reasons = {lease.id: (f"waited {format_duration((now - lease.created_at).total_seconds())} in the "
                                  f"queue for {_waiting(lease).demand.describe()} and nothing fitting became free "
                                  "(ask again, or with a longer --wait)") for lease in due}
        for lease_id, reason in reasons.items():
            self.spawn(self.release(lease_id, LeaseState.failed, reason, only_if=_still_queued))
        return list(reasons)

    def _queue_info(self, session: Session, lease: Lease) -> tuple[int | None, float | None]:
        """``(queue_position, queue_estimate_s)`` of a queued lease."""
        queued = session.scalars(select(Lease).where(Lease.state == QUEUED)).all()
        waiting = [_waiting(x) for x in queued]
        place_in_line = wait_queue.position(lease.id, waiting,
                                            usage.last_used(session, [w.owner for w in waiting], self.now()))
        if place_in_line is None:
            return None, None
        recent = session.execute(select(Lease.started_at, Lease.ended_at)
                                 .where(Lease.ended_at.is_not(None), Lease.started_at.is_not(None))
                                 .order_by(Lease.ended_at.desc()).limit(ESTIMATE_SAMPLE)).all()
        holding = session.scalar(select(func.count()).select_from(Lease).where(Lease.state.in_(HOLDING))) or 0
        lengths = [(end - start).total_seconds() for start, end in recent]
        return place_in_line, wait_queue.estimate(place_in_line, lengths, holding)

    async def _stop_worker(self, url: str, lease_id: str) -> str | None:
        """Ask the agent to stop the lease's worker, waiting at most
        ``worker_stop_timeout``; None once stopped, else words for the
        lease's reason (the release goes on regardless)."""
        try:
            code = await self.agents.stop_worker(url, lease_id, self.settings.worker_stop_timeout)
        except GPUPoolError as exc:
            log.warning("lease %s: could not stop its worker (%s); the agent will be told to stop it "
                        "with its next heartbeat", lease_id, exc.log_message)
            return (f"its worker was not confirmed stopped ({exc.message}); the agent is told to stop it with "
                    "its next heartbeat")
        log.debug("lease %s: worker stopped (exit code %s)", lease_id, code)
        return None

    async def _wait_left(self, lease_id: str, state: str, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while loop.time() < deadline and not self.watch.closed:
            fut = self.watch.future(lease_id)
            with self.store.read() as session:
                lease = session.get(Lease, lease_id)
                if lease is None or lease.state != state:
                    fut.cancel()
                    return
            await self.watch.changed(fut, deadline - loop.time())

    # -- after a restart, and background tasks ----------------------------------------------

    def resume(self) -> None:
        """Pick up what a previous run left half-done: start the workers of
        ``starting`` leases (agents start idempotently per lease) and finish
        ``releasing`` ones. Clients and agents could not reach a stopped
        service, so their heartbeat clocks restart now: an outage longer than
        the heartbeat TTL must not reclaim every healthy lease."""
        now = self.now()
        with self.writing() as session:
            session.execute(update(Lease).where(Lease.state == LeaseState.active.value).values(last_heartbeat_at=now))
            session.execute(update(Node).where(Node.state.in_(("up", "degraded"))).values(last_heartbeat_at=now))
        unfinished = [LeaseState.starting.value, LeaseState.releasing.value]
        with self.store.read() as session:
            rows = session.execute(select(Lease.id, Lease.state).where(Lease.state.in_(unfinished))).all()
        for lease_id, state in rows:
            log.info("lease %s was %s when the service stopped; resuming", lease_id, state)
            if state == LeaseState.starting.value:
                self.spawn(self._start(lease_id))
            else:
                self.spawn(self._resume_release(lease_id))

    async def _resume_release(self, lease_id: str) -> None:
        with self.store.read() as session:
            lease = session.get(Lease, lease_id)
            url = session.get(Node, lease.node_name).url if lease and lease.node_name else None
        self._finish(lease_id, await self._stop_worker(url, lease_id) if url else None)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` in the background; its failure is logged, not lost."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background lease task failed", exc_info=task.exception())

    async def shutdown(self) -> None:
        """Answer long polls, cancel background work; leases stay as they are
        and :meth:`resume` continues them at the next start."""
        self.watch.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- helpers -----------------------------------------------------------------------

    @contextmanager
    def writing(self) -> Iterator[Session]:
        """A write transaction that, once committed, wakes long polls of the
        leases it changed and tells the capacity index which GPUs changed."""
        session = None
        try:
            with self.store.write() as session:
                yield session
        except BaseException:
            if session is not None and session.info.get("capacity_index_changed"):
                self.capacity.invalidate()  # the drain took capacity there that the rollback gave back
            raise
        self.capacity.changed(session.info)
        self.watch.notify(set(session.info.get("changed_leases", ())))

    def _visible(self, session: Session, who: Identity, lease_id: str, *, owner_only: bool = False) -> Lease:
        """The lease if ``who`` may see it (its owner, or an admin unless
        ``owner_only``); else 404, so its existence is not revealed."""
        lease = session.get(Lease, lease_id, options=[selectinload(Lease.gpus), selectinload(Lease.events)])
        if lease is None or not (lease.owner == who.name or (who.admin and not owner_only)):
            raise not_found(f"lease {lease_id}")
        return lease

    def _json(self, lease: Lease, who: Identity, session: Session | None = None) -> dict[str, Any]:
        """The lease JSON, with ``queue_position``/``queue_estimate_s`` while
        queued and ``node_state`` (both need ``session``), ``wait_until``, and
        ``idle_deadline`` with ``idle_warning`` (for the notebook's warning
        before idle reclaim)."""
        body = lease_json(lease, for_owner=lease.owner == who.name)
        body["queue_position"] = body["queue_estimate_s"] = None
        body["wait_until"] = isoformat(lease.wait_until)
        body["idle_deadline"] = isoformat(idle_deadline(lease))
        body["idle_warning"] = self.settings.idle_warning
        node = session.get(Node, lease.node_name) if session is not None and lease.node_name else None
        body["node_state"] = node.state if node is not None else None
        if lease.state == QUEUED and session is not None:
            body["queue_position"], body["queue_estimate_s"] = self._queue_info(session, lease)
        return body


def _waiting(lease: Lease) -> wait_queue.Waiting:
    return wait_queue.Waiting(lease.id, lease.owner,
                              Demand(lease.fraction, lease.gpu_count, lease.requested_memory, lease.model),
                              lease.created_at)


def _is_queued(lease: Lease, now: datetime) -> bool:
    return lease.state == QUEUED


def _still_queued(lease: Lease, now: datetime) -> bool:
    # Re-checked under the write lock: the request may have been placed since the sweep read it.
    return lease.state == QUEUED and lease.wait_until is not None and lease.wait_until <= now


def _transition(session: Session, lease: Lease, state: LeaseState, reason: str | None, at: datetime) -> None:
    """Set ``lease.state`` and store the event; the commit wakes long polls."""
    if lease.state is None or LeaseState(lease.state).holds_capacity != state.holds_capacity:
        mark_gpus(session, [g.gpu_uuid for g in lease.gpus])
    lease.state = state.value
    lease.events.append(LeaseEvent(state=state.value, at=at, reason=reason))
    session.info.setdefault("changed_leases", set()).add(lease.id)
