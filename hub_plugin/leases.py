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
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Callable, Coroutine, Iterator

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, selectinload

from gpupool.errors import GPUPoolError, bad_request, not_found
from gpupool.schema import LeaseRequest, LeaseState, isoformat, utcnow
from gpupool.units import format_duration
from gpupool.wire.workers import WorkerRequest, WorkerStarted

from . import usage
from .rules import queue as wait_queue
from .agent_client import AgentClient
from .auth import Identity
from .capacity import HOLDING, CapacityIndex, mark_gpus
from .config import GPUPool
from .db import Store
from .rules.hosts import beyond_every_node, host_limits
from .models import GPU, Lease, LeaseEvent, LeaseGPU, Node, new_lease_id
from .pressure import Pressure
from .rules.priority import INTERACTIVE, preemption_refusal
from .quota_book import QuotaBook
from .storework import StoreWork
from .environments import lease_environment, unknown_environment, unusable_on
from .rules.scheduler import NO_ENVIRONMENT, Demand, Placement, Refusal
from .rules.workload import DEFAULT_WORKLOAD, Workload, workload_of
from .views import lease_json
from .watch import LeaseWatch

log = logging.getLogger("gpupool.service.leases")

#: Most seconds a long poll (``GET /leases/{id}?wait=``) may wait.
MAX_WAIT_S = 60.0
#: Most leases ``GET /leases`` returns (the newest).
LIST_LIMIT = 500
#: Seconds after which the reclaim sweep drains the queue even when no capacity changed here.
FULL_DRAIN_S = 30.0
#: The scheduler's expected workload is the mix of the last this many requests ...
WORKLOAD_WINDOW = 1000
#: ... once there are at least this many (before: rules.workload.DEFAULT_WORKLOAD); recomputed every this many.
WORKLOAD_MIN = 50
QUEUED = LeaseState.queued.value
#: The states ``c.GPUPool.max_active_per_user`` counts: a lease releasing is on its way out.
CAPPED = (LeaseState.starting.value, LeaseState.active.value)


class LeaseBook:
    """Creates, reads and ends leases.

    ``settings`` are the service's ``c.GPUPool``; ``now`` is the one clock
    (UTC-aware datetimes), replaceable so time can be moved in tests;
    ``on_refusal(reasons)`` is told every refusal and ``on_dequeued(seconds)``
    how long each queued request waited when it is placed (for metrics);
    ``work`` runs the store calls off the event loop (:mod:`.storework`; a
    new one by default).

    The public methods are coroutines for the event loop. Each runs its SQL
    through ``work`` in functions named ``_..._now``, which run on a store
    thread and must not touch the loop: what they decide to start in the
    background (workers, releases) they return, and the coroutine spawns it.
    """

    def __init__(self, settings: GPUPool, store: Store, agents: AgentClient, *,
                 now: Callable[[], datetime] = utcnow,
                 on_refusal: Callable[[dict[str, int]], None] | None = None,
                 on_dequeued: Callable[[float], None] = lambda seconds: None,
                 work: StoreWork | None = None) -> None:
        self.settings = settings
        self.store = store
        self.agents = agents
        self.now = now
        self.work = work or StoreWork()
        self.watch = LeaseWatch()
        self._on_refusal = on_refusal
        self._on_dequeued = on_dequeued
        self._tasks: set[asyncio.Task] = set()
        # The writer thread's alone (storework): the capacity index and the recent requests.
        self.capacity = CapacityIndex(settings.context_overhead)
        self._capacity_epoch = 0  # commits that changed capacity, and how many the last drain had seen
        self._drained_epoch, self._drained_at = -1, 0.0
        self._recent: deque[Demand] | None = None  # recent requests, read from the store at first use
        self._shapes: Workload | None = None
        # A lambda, so a clock replaced on this book is the quotas' clock too.
        self.quotas = QuotaBook(settings, lambda: self.now())
        # The reclaim sweep's pressure plan (early parks, preemptions), read by every lease JSON.
        self.pressure = Pressure(settings, self.quotas.table)

    # -- reading ---------------------------------------------------------------

    async def get(self, who: Identity, lease_id: str) -> dict[str, Any]:
        """The lease as ``who`` may see it. 404 when it is someone else's."""
        return await self.work.read(self._get_now, who, lease_id)

    def _get_now(self, who: Identity, lease_id: str) -> dict[str, Any]:
        with self.store.read() as session:
            lease = self._visible(session, who, lease_id)
            return self._json(lease, who, session, self._queue_view(session, [lease]))

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
            try:
                lease = await self.get(who, lease_id)
            except BaseException:
                fut.cancel()
                raise
            state = state or lease["state"]
            left = deadline - loop.time()
            if lease["state"] != state or left <= 0 or self.watch.closed:
                fut.cancel()
                return lease
            await self.watch.changed(fut, left)

    async def list(self, who: Identity, *, active: bool = True, kernel_id: str | None = None) -> list[dict[str, Any]]:
        """``who``'s own leases, oldest first (at most the newest 500);
        ``active``: only those holding capacity or queued; ``kernel_id``: only that kernel's.
        Takes a fixed number of queries, whatever the number of leases or of queued requests."""
        return await self.work.read(self._list_now, who, active, kernel_id)

    def _list_now(self, who: Identity, active: bool, kernel_id: str | None) -> list[dict[str, Any]]:
        query = select(Lease).where(Lease.owner == who.name)
        if active:
            query = query.where(Lease.state.in_((*HOLDING, QUEUED)))
        if kernel_id:
            query = query.where(Lease.kernel_id == kernel_id)
        query = query.options(selectinload(Lease.gpus), selectinload(Lease.events))
        with self.store.read() as session:
            rows = session.scalars(query.order_by(Lease.created_at.desc()).limit(LIST_LIMIT)).all()
            queue = self._queue_view(session, rows)
            nodes = self._node_states(session, rows)
            return [self._json(lease, who, session, queue, nodes) for lease in reversed(rows)]

    # -- creating --------------------------------------------------------------

    async def create(self, who: Identity, body: Any) -> dict[str, Any]:
        """Validate ``body`` (a ``LeaseRequest``), check the quota and the
        per-user caps, place it and reserve the capacity in one transaction,
        and start the worker in the background.

        Returns the lease JSON: state ``starting``, or ``queued`` when nothing
        fits and the request has a ``wait``. Raises 400 ``bad_request`` for bad
        input, 409 ``unknown_environment`` (with ``environments``, the names
        offered) when ``env`` names a worker environment no node offers, 429
        ``quota_exceeded`` (with ``limit``) over a quota or over
        ``c.GPUPool.max_active_per_user`` / ``max_queued_per_user``, and 409
        ``pool_full`` (with ``reasons``) when nothing fits and there is no ``wait``.
        """
        request = LeaseRequest.from_json(body)
        refusal = preemption_refusal(bool(request.preemptible), self.settings.allow_preemption)
        if refusal:
            raise bad_request(refusal, setting="allow_preemption")
        wait = self._wait(request.wait)
        result, placed = await self.work.write(self._create_now, who, request, wait)
        if placed:
            self.spawn(self._start(result["id"]))
        return result

    def _create_now(self, who: Identity, request: LeaseRequest, wait: float) -> tuple[dict[str, Any], bool]:
        groups = self.quotas.groups_of(who)
        now = self.now()
        with self.writing() as session:
            # The lock comes first: the quota check and the placement below
            # then see every lease committed before, and no other decision interleaves.
            self.store.lock_capacity(session)
            env = self._environment(session, request)
            demand = Demand(request.fraction, request.gpu_count, request.memory, request.model, env, request.cpus,
                            request.host_memory, self.settings.host_share)
            limits = self.quotas.limits(session, who.name, groups)
            idle_timeout = self._idle_timeout(request.idle_timeout, limits.max_idle_timeout)
            try:
                self.quotas.enforce(session, who.name, limits, request.fraction * request.gpu_count, now)
                held, queued = self._counts(session, who.name)
                self._check_cap("max_active_per_user", held)
                self._check_host(session, demand)
            except GPUPoolError as exc:
                self._refused_by_limit(exc)
                raise
            decision = self._place(session, demand)
            if isinstance(decision, Refusal) and not wait:
                self._refused(who, decision)
            if isinstance(decision, Refusal):
                try:
                    self._check_cap("max_queued_per_user", queued)
                except GPUPoolError as exc:
                    self._refused_by_limit(exc)
                    raise
            lease = Lease(id=new_lease_id(), owner=who.name, fraction=request.fraction,
                          gpu_count=request.gpu_count, memory=request.memory or 0, kernel_id=request.kernel_id,
                          idle_timeout=idle_timeout, heartbeat_ttl=self.settings.heartbeat_ttl,
                          created_at=now, usage_gpu_seconds=0.0, groups=list(groups), model=request.model,
                          requested_memory=request.memory, server_name=request.server_name, env=env,
                          lease_class=request.lease_class or INTERACTIVE, preemptible=bool(request.preemptible),
                          requested_cpus=request.cpus, requested_host_memory=request.host_memory)
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
            result = self._json(lease, who, session, self._newest_view(session, lease))
        log.info("lease %s created for %s: %s on %s", lease.id, who.name, demand.describe(), where)
        return result, isinstance(decision, Placement)

    @staticmethod
    def _counts(session: Session, owner: str) -> tuple[int, int]:
        """``owner``'s leases ``(holding: starting or active, queued)``, for the per-user caps."""
        rows = dict(session.execute(select(Lease.state, func.count()).where(
            Lease.owner == owner, Lease.state.in_(CAPPED + (QUEUED,))).group_by(Lease.state)).all())
        return sum(rows.get(state, 0) for state in CAPPED), rows.get(QUEUED, 0)

    def _check_cap(self, name: str, have: int) -> None:
        """429 ``quota_exceeded`` when ``have`` leases already reach ``c.GPUPool.<name>``."""
        cap = getattr(self.settings, name)
        if cap is None or have < cap:
            return
        if name == "max_active_per_user":
            words = (f"you hold {have} leases (starting or active), the most one user may hold at once "
                     f"(c.GPUPool.max_active_per_user = {cap}); release one first (%gpu release)")
        else:
            words = (f"you have {have} requests waiting in the queue, the most one user may have "
                     f"(c.GPUPool.max_queued_per_user = {cap}); cancel one (DELETE /api/v1/leases/ID) "
                     "or wait until one is placed")
        raise GPUPoolError("quota_exceeded", f"too many requests: {words}; an admin can raise "
                           f"c.GPUPool.{name}", 429, limit=name, cap=cap)

    def _check_host(self, session: Session, demand: Demand) -> None:
        """400 when ``demand`` names more host CPUs or memory than the biggest node has."""
        words = beyond_every_node(demand, self.capacity.get(session, self._workload(session)).hosts)
        if words is not None:
            raise bad_request(words, limit="host")

    def _refused_by_limit(self, exc: GPUPoolError) -> None:
        if self._on_refusal is not None:  # counted by limit, beside the scheduler's reasons
            self._on_refusal({f"quota {exc.extra.get('limit')}": 1})

    def _environment(self, session: Session, request: LeaseRequest) -> str | None:
        """The worker environment the lease asks for (:func:`.environments.lease_environment`);
        409 ``unknown_environment`` when ``env`` names one that no node offers."""
        if request.env is None and request.prefer_env is None:
            return None
        offered = self.capacity.get(session, self._workload(session)).environments()
        try:
            return lease_environment(request.env, request.prefer_env, offered)
        except ValueError:
            if self._on_refusal is not None:
                self._on_refusal({NO_ENVIRONMENT: 1})
            raise unknown_environment(request.env, offered, unusable_on(session, request.env)) from None

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
        lease.env = decision.env  # the node's default when the request named none: %gpu status shows it
        lease.cpus, lease.host_memory = decision.cpus, decision.host_memory
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
        job = await self.work.read(self._start_job, lease_id)
        if job is None:
            return
        url, node_name, request = job
        try:
            started = await self.agents.start_worker(url, request, self.settings.worker_start_timeout)
        except GPUPoolError as exc:
            log.warning("lease %s: worker start on %s failed: %s", lease_id, node_name, exc.message)
            await self.release(lease_id, LeaseState.failed,
                               f"the worker could not start on {node_name}: {exc.message}")
            return
        if await self.work.write(self._started_now, lease_id, started, node_name):
            log.info("lease %s active: worker pid %s on %s", lease_id, started.pid, node_name)
            return
        # Released while the worker was starting: the release path may have
        # asked the agent before the worker existed, so stop it now.
        log.info("lease %s ended while its worker started; stopping the worker on %s", lease_id, node_name)
        await self._stop_worker(url, lease_id)

    def _start_job(self, lease_id: str) -> tuple[str, str, WorkerRequest] | None:
        """``(agent url, node name, POST /workers request)`` of a ``starting`` lease, else None."""
        with self.store.read() as session:
            lease = session.get(Lease, lease_id, options=[selectinload(Lease.gpus)])
            if lease is None or lease.state != LeaseState.starting.value:
                return None
            node = session.get(Node, lease.node_name)
            # env: placed where the agent reported it usable; one restarted since without it refuses, in words.
            request = WorkerRequest(lease.id, lease.owner, tuple(g.gpu_uuid for g in lease.gpus), lease.fraction,
                                    lease.memory, env=lease.env, **host_limits(lease, node))
            return node.url, node.name, request

    def _started_now(self, lease_id: str, started: WorkerStarted, node_name: str) -> bool:
        """``starting`` -> ``active`` with the worker's connection; False when the lease left ``starting``."""
        now = self.now()
        with self.writing() as session:
            lease = session.get(Lease, lease_id)
            if lease is None or lease.state != LeaseState.starting.value:
                return False
            lease.connection = started.connection
            lease.worker_pid = started.pid
            lease.worker_state = "idle"  # the kernel answered, no cell has run yet
            lease.started_at = lease.last_heartbeat_at = lease.idle_since = now
            _transition(session, lease, LeaseState.active,
                        f"the worker started on {node_name} (pid {lease.worker_pid})", now)
            return True

    # -- heartbeats --------------------------------------------------------------

    async def heartbeat(self, who: Identity, lease_id: str) -> dict[str, Any]:
        """The client's liveness: renew ``last_heartbeat_at`` while the lease
        holds capacity. Returns the lease (ended ones too, so the client learns why)."""
        return await self.work.write(self._heartbeat_now, who, lease_id)

    def _heartbeat_now(self, who: Identity, lease_id: str) -> dict[str, Any]:
        with self.writing() as session:
            lease = self._visible(session, who, lease_id, owner_only=True)
            if LeaseState(lease.state).holds_capacity:
                lease.last_heartbeat_at = self.now()
            return self._json(lease, who, session, self._queue_view(session, [lease]))

    # -- ending ----------------------------------------------------------------------

    async def release_by(self, who: Identity, lease_id: str, words: str | None) -> dict[str, Any]:
        """``DELETE /leases/{id}`` by its owner or an admin. Idempotent: an
        ended lease is returned as it is."""
        if words is not None and (not words.strip() or len(words) > 200):
            raise bad_request("'reason' must be 1 to 200 characters")
        owner = await self.work.read(self._owner_now, who, lease_id)
        by = "its owner" if owner == who.name else f"admin {who.name}"
        reason = f"released by {by}" + (f": {words.strip()}" if words else "")
        await self.release(lease_id, LeaseState.released, reason)
        return await self.get(who, lease_id)

    def _owner_now(self, who: Identity, lease_id: str) -> str:
        with self.store.read() as session:
            return self._visible(session, who, lease_id).owner

    async def release(self, lease_id: str, final: LeaseState, reason: str, *,
                      only_if: Callable[[Lease, datetime], bool] | None = None) -> None:
        """The one release path. Ends ``lease_id`` in ``final`` (released,
        reclaimed or failed) for ``reason``; returns once it has ended.

        ``only_if(lease, now)`` is re-checked under the write lock (reclaim
        uses it so a lease that became busy meanwhile is kept). A lease that
        is already releasing is waited for; an ended one is left alone. An
        unreachable agent does not stop the release.
        """
        begun = await self.work.write(self._begin_release, lease_id, final, reason, only_if)
        if begun is None:
            return
        mine, url = begun
        if not mine:  # someone else is releasing it: wait for them
            await self._wait_left(lease_id, LeaseState.releasing.value, self.settings.worker_stop_timeout + 5)
            return
        log.info("lease %s releasing (%s): %s", lease_id, final.value, reason)
        await self._finish(lease_id, await self._stop_worker(url, lease_id) if url else None)

    def _begin_release(self, lease_id: str, final: LeaseState, reason: str,
                       only_if: Callable[[Lease, datetime], bool] | None) -> tuple[bool, str | None] | None:
        """Make the lease ``releasing``: ``(True, agent url or None)``; ``(False, None)``
        when someone else is releasing it; None when there is nothing to do."""
        now = self.now()
        with self.writing() as session:
            lease = session.get(Lease, lease_id)
            if lease is None or LeaseState(lease.state).ended:
                return None
            if lease.state == LeaseState.releasing.value:
                return False, None
            if only_if is not None and not only_if(lease, now):
                return None
            lease.end_state, lease.reason = final.value, reason
            _transition(session, lease, LeaseState.releasing, reason, now)
            if lease.node_name is None:
                # Never placed (queued): no worker to stop, no capacity to free, so it
                # ends here, and a long poll wakes to its final state, not to releasing.
                self._end(session, lease, now)
                return None
            return True, session.get(Node, lease.node_name).url

    async def _finish(self, lease_id: str, note: str | None = None) -> None:
        self._after_drain(*await self.work.write(self._finish_now, lease_id, note))

    def _finish_now(self, lease_id: str, note: str | None = None) -> tuple[list[str], dict[str, str]]:
        """``releasing`` -> its final state; records ``ended_at`` and usage
        (the ledger record) once, and places queued requests on what it freed,
        all in one transaction. ``note``: words added to the reason of a
        released or reclaimed lease (the worker's stop was not confirmed; a
        failed lease's worker is dead or never started, so no news there).
        Returns what the drain placed and failed."""
        now = self.now()
        with self.writing() as session:
            self.store.lock_capacity(session)  # the queue is drained below
            lease = session.get(Lease, lease_id)
            if lease is None or lease.state != LeaseState.releasing.value:
                return [], {}
            self._end(session, lease, now, note)
            return self._drain(session, now)

    @staticmethod
    def _end(session: Session, lease: Lease, now: datetime, note: str | None = None) -> None:
        """A ``releasing`` lease to its final state, with ``ended_at`` and its usage (the ledger record)."""
        final = LeaseState(lease.end_state or LeaseState.released.value)
        if note and final is not LeaseState.failed:
            lease.reason = f"{lease.reason}; {note}"
        lease.ended_at = now
        held = (now - lease.started_at).total_seconds() if lease.started_at else 0.0
        lease.usage_gpu_seconds = usage.close(session, lease, now)
        lease.connection = None  # the worker and its key are gone
        _transition(session, lease, final, lease.reason, now)
        log.info("lease %s %s after %s (%.1f GPU-seconds): %s", lease.id, final.value,
                 format_duration(held), lease.usage_gpu_seconds, lease.reason)

    # -- the queue -------------------------------------------------------------------------

    async def drain_queue(self, *, sweep: bool = False) -> list[str]:
        """Place queued requests that fit now (the reclaim sweep, node
        registrations and nodes coming back call this; releases drain in their
        own transaction). Returns the ids placed.

        ``sweep``: the periodic call. Then, when no committed transaction
        changed capacity since the last drain (and that was less than
        :data:`FULL_DRAIN_S` ago, which also catches changes another service
        on the same store made), only the quotas of the queued are checked
        again: a thousand queued requests are not placed anew five times a second."""
        if not await self.work.read(self._any_queued):
            return []
        if sweep and self._drained_epoch == self._capacity_epoch and time.monotonic() - self._drained_at < FULL_DRAIN_S:
            self._after_drain([], await self.work.read(self._over_quota_now))
            return []
        placed, over = await self.work.write(self._drain_now)
        self._after_drain(placed, over)
        return placed

    def _any_queued(self) -> bool:
        with self.store.read() as session:
            return session.scalar(select(Lease.id).where(Lease.state == QUEUED).limit(1)) is not None

    def _over_quota_now(self) -> dict[str, str]:
        """:meth:`_over_quota` of the queue, reading one lease per owner (their groups)
        and the ids only of owners who are over."""
        now = self.now()
        with self.store.read() as session:
            firsts = session.execute(select(func.min(Lease.id)).where(Lease.state == QUEUED)
                                     .group_by(Lease.owner)).scalars().all()
            sample = session.execute(select(Lease.id, Lease.owner, Lease.groups).where(Lease.id.in_(firsts))).all()
            over = self._over_quota(session, sample, now)
            owners = {row.owner: over[row.id] for row in sample if row.id in over}
            if not owners:
                return {}
            return {lease_id: owners[owner] for lease_id, owner in session.execute(
                select(Lease.id, Lease.owner).where(Lease.state == QUEUED, Lease.owner.in_(sorted(owners))))}

    def _drain_now(self) -> tuple[list[str], dict[str, str]]:
        self._drained_epoch, self._drained_at = self._capacity_epoch, time.monotonic()
        with self.writing() as session:
            self.store.lock_capacity(session)
            return self._drain(session, self.now())

    def _drain(self, session: Session, now: datetime) -> tuple[list[str], dict[str, str]]:
        """Within a write transaction holding the capacity lock: place what
        :func:`.queue.drain` picks (its docstring has the fairness rule).
        Returns the ids placed, and ``{id: why}`` of requests whose owner's
        quota no longer allows them (to end ``failed`` after the commit).
        The queue is read as plain columns; only the leases placed are loaded
        whole, so a thousand queued requests cost one light query."""
        rows = [row for row in session.execute(
            select(Lease.id, Lease.owner, Lease.fraction, Lease.gpu_count, Lease.requested_memory, Lease.model,
                   Lease.env, Lease.requested_cpus, Lease.requested_host_memory, Lease.created_at, Lease.wait_until,
                   Lease.groups, Lease.lease_class).where(Lease.state == QUEUED))
            if row.wait_until is None or row.wait_until > now]
        if not rows:
            return [], {}
        over = self._over_quota(session, rows, now)
        share = self.settings.host_share
        waiting = [wait_queue.Waiting(row.id, row.owner, Demand(row.fraction, row.gpu_count, row.requested_memory,
                                                                row.model, row.env, row.requested_cpus,
                                                                row.requested_host_memory, share), row.created_at,
                                                         row.lease_class)
                   for row in rows if row.id not in over]
        owners = {w.owner for w in waiting}
        last = usage.last_used(session, owners, now)
        placed = []

        def accept(item: wait_queue.Waiting, decision: Placement) -> bool:
            if not self.capacity.verify(session, decision):
                return False  # the index was stale: stop; the next drain decides on a fresh one
            where = self._assign(session, session.get(Lease, item.lease_id), decision, now)
            self._on_dequeued((now - item.created_at).total_seconds())
            log.info("lease %s of %s placed from the queue on %s", item.lease_id, item.owner, where)
            placed.append(item.lease_id)
            return True

        session.info["capacity_index_changed"] = True  # drain takes capacity in the index as it goes
        wait_queue.drain(waiting, self.capacity.get(session, self._workload(session)), last, now, accept=accept,
                         room=self._room(session, owners))
        return placed, over

    def _room(self, session: Session, owners: set[str]) -> dict[str, int] | None:
        """How many more leases each of ``owners`` may hold (``c.GPUPool.max_active_per_user``; None: no cap)."""
        cap = self.settings.max_active_per_user
        if cap is None:
            return None
        held = dict(session.execute(select(Lease.owner, func.count()).where(
            Lease.owner.in_(sorted(owners)), Lease.state.in_(CAPPED)).group_by(Lease.owner)).all())
        return {owner: max(0, cap - held.get(owner, 0)) for owner in owners}

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
        """On the loop, after a drain committed: start what it placed, fail what it must."""
        for lease_id in placed:
            self.spawn(self._start(lease_id))
        for lease_id, why in over.items():
            self.spawn(self.release(lease_id, LeaseState.failed, why, only_if=_is_queued))

    async def expire_queue(self) -> list[str]:
        """End ``failed`` every queued request whose ``wait`` has passed; returns their ids."""
        reasons = await self.work.read(self._expired_now)
        for lease_id, reason in reasons.items():
            self.spawn(self.release(lease_id, LeaseState.failed, reason, only_if=_still_queued))
        return list(reasons)

    def _expired_now(self) -> dict[str, str]:
        now = self.now()
        with self.store.read() as session:
            due = session.scalars(select(Lease).where(Lease.state == QUEUED, Lease.wait_until <= now)).all()
            return {lease.id: (f"waited {format_duration((now - lease.created_at).total_seconds())} in the "
                               f"queue for {_waiting(lease).demand.describe()} and nothing fitting became free "
                               "(ask again, or with a longer --wait)") for lease in due}

    def _newest_view(self, session: Session, lease: Lease) -> "QueueView | None":
        """:meth:`_queue_view` of a request just queued, from per-owner counts (no row per queued request)."""
        if lease.state != QUEUED:
            return None
        counts, gpus = {}, {}
        for owner, lease_class, count, asked in session.execute(
                select(Lease.owner, Lease.lease_class, func.count(), func.sum(Lease.fraction * Lease.gpu_count))
                .where(Lease.state == QUEUED).group_by(Lease.owner, Lease.lease_class)):
            counts[(owner, lease_class)], gpus[(owner, lease_class)] = count, asked
        last = usage.last_used(session, {owner for owner, _ in counts}, self.now())
        place = wait_queue.newest_position(lease.owner, lease.lease_class, counts, last)
        ahead = wait_queue.newest_position(lease.owner, lease.lease_class, gpus, last)  # GPUs, its own included
        return QueueView({lease.id: place}, {lease.id: self.pressure.etas([ahead], self.now())[0]})

    def _queue_view(self, session: Session, leases) -> "QueueView | None":
        """What the queued ones of ``leases`` need for ``queue_position`` and
        ``queue_estimate_s``: the queue's order, read once as three columns and
        sorted once (a fixed number of queries, however many leases are shown;
        the queue itself is at most users x ``c.GPUPool.max_queued_per_user``);
        None when none of ``leases`` is queued."""
        if not any(lease.state == QUEUED for lease in leases):
            return None
        queued = session.execute(select(Lease.id, Lease.owner, Lease.created_at, Lease.lease_class,
                                        Lease.fraction * Lease.gpu_count).where(Lease.state == QUEUED)).all()
        last = usage.last_used(session, {row[1] for row in queued}, self.now())
        places = wait_queue.positions(queued, last)
        asked = {row[0]: row[4] for row in queued}
        in_line = sorted(places, key=places.get)
        return QueueView(places, dict(zip(in_line, self.pressure.etas([asked[i] for i in in_line], self.now()))))

    async def _stop_worker(self, url: str, lease_id: str) -> str | None:
        """Ask the agent to stop the lease's worker, waiting at most
        ``worker_stop_timeout``; None once stopped, else words for the
        lease's reason (the release goes on regardless)."""
        try:
            code = await self.agents.stop_worker(url, lease_id, self.settings.worker_stop_timeout)
        except GPUPoolError as exc:
            log.warning("lease %s: could not stop its worker (%s); the agent will be told to stop it "
                        "with its next heartbeat", lease_id, exc.message)
            return (f"its worker was not confirmed stopped ({exc.message}); the agent is told to stop it with "
                    "its next heartbeat")
        log.debug("lease %s: worker stopped (exit code %s)", lease_id, code)
        return None

    async def _wait_left(self, lease_id: str, state: str, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while loop.time() < deadline and not self.watch.closed:
            fut = self.watch.future(lease_id)
            try:
                now_in = await self.work.read(self._state_now, lease_id)
            except BaseException:
                fut.cancel()
                raise
            if now_in != state:
                fut.cancel()
                return
            await self.watch.changed(fut, deadline - loop.time())

    def _state_now(self, lease_id: str) -> str | None:
        with self.store.read() as session:
            return session.scalar(select(Lease.state).where(Lease.id == lease_id))

    # -- after a restart, and background tasks ----------------------------------------------

    async def resume(self) -> None:
        """Pick up what a previous run left half-done: start the workers of
        ``starting`` leases (agents start idempotently per lease) and finish
        ``releasing`` ones. Clients and agents could not reach a stopped
        service, so their heartbeat clocks restart now: an outage longer than
        the heartbeat TTL must not reclaim every healthy lease."""
        for lease_id, state in await self.work.write(self._resume_now):
            log.info("lease %s was %s when the service stopped; resuming", lease_id, state)
            if state == LeaseState.starting.value:
                self.spawn(self._start(lease_id))
            else:
                self.spawn(self._resume_release(lease_id))

    def _resume_now(self) -> list[tuple[str, str]]:
        now = self.now()
        with self.writing() as session:
            session.execute(update(Lease).where(Lease.state == LeaseState.active.value).values(last_heartbeat_at=now))
            session.execute(update(Node).where(Node.state.in_(("up", "degraded"))).values(last_heartbeat_at=now))
        unfinished = [LeaseState.starting.value, LeaseState.releasing.value]
        with self.store.read() as session:
            return [tuple(row) for row in session.execute(
                select(Lease.id, Lease.state).where(Lease.state.in_(unfinished))).all()]

    async def _resume_release(self, lease_id: str) -> None:
        url = await self.work.read(self._node_url_now, lease_id)
        await self._finish(lease_id, await self._stop_worker(url, lease_id) if url else None)

    def _node_url_now(self, lease_id: str) -> str | None:
        with self.store.read() as session:
            lease = session.get(Lease, lease_id)
            return session.get(Node, lease.node_name).url if lease and lease.node_name else None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` in the background; its failure is logged, not lost. On the loop only."""
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
        and :meth:`resume` continues them at the next start. The store threads
        are left to whoever closes the store (``work.close()``)."""
        self.watch.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- helpers -----------------------------------------------------------------------

    @contextmanager
    def writing(self) -> Iterator[Session]:
        """A write transaction that, once committed, wakes long polls of the
        leases it changed and tells the capacity index which GPUs changed.
        On the writer thread only (:mod:`.storework`)."""
        session = None
        try:
            with self.store.write() as session:
                yield session
        except BaseException:
            if session is not None and session.info.get("capacity_index_changed"):
                self.capacity.invalidate()  # the drain took capacity there that the rollback gave back
            raise
        self.capacity.changed(session.info)
        if any(session.info.get(mark) for mark in ("capacity_all", "capacity_gpus", "capacity_nodes")):
            self._capacity_epoch += 1  # the next sweep drains the queue again
        self.watch.notify(set(session.info.get("changed_leases", ())))

    def _visible(self, session: Session, who: Identity, lease_id: str, *, owner_only: bool = False) -> Lease:
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

    @staticmethod
    def _node_states(session: Session, leases) -> dict[str, str]:
        names = sorted({lease.node_name for lease in leases if lease.node_name})
        if not names:
            return {}
        return dict(session.execute(select(Node.name, Node.state).where(Node.name.in_(names))).all())

    def _json(self, lease: Lease, who: Identity, session: Session, queue: "QueueView | None" = None,
              nodes: dict[str, str] | None = None) -> dict[str, Any]:
        """The lease JSON, with ``queue_position``/``queue_estimate_s`` while
        queued (from ``queue``, see :meth:`_queue_view`) and ``node_state``
        (from ``nodes``, else read), ``wait_until``, and ``idle_deadline`` with
        ``idle_warning`` (for the notebook's warning before idle reclaim)."""
        body = lease_json(lease, for_owner=lease.owner == who.name)
        body["queue_position"] = body["queue_estimate_s"] = None
        body["wait_until"] = isoformat(lease.wait_until)
        self.pressure.annotate(body, lease)  # idle_deadline, early under pressure; pressure; preempt_at
        body["idle_warning"] = self.settings.idle_warning
        if nodes is None:
            nodes = self._node_states(session, [lease])
        body["node_state"] = nodes.get(lease.node_name) if lease.node_name else None
        if lease.state == QUEUED and queue is not None:
            place = queue.positions.get(lease.id)
            if place is not None:
                body["queue_position"] = place
                body["queue_estimate_s"] = queue.etas.get(lease.id)
        return body


@dataclass(frozen=True)
class QueueView:
    """The queue as one read saw it: lease id -> 1-based place, and lease id ->
    seconds until it is likely placed (:mod:`.rules.eta`; None: nothing known frees enough)."""

    positions: dict[str, int]
    etas: dict[str, float | None]


def _waiting(lease: Lease) -> wait_queue.Waiting:
    return wait_queue.Waiting(lease.id, lease.owner,
                              Demand(lease.fraction, lease.gpu_count, lease.requested_memory, lease.model, lease.env,
                                     lease.requested_cpus, lease.requested_host_memory),
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
