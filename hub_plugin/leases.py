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
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Callable, Coroutine, Iterator

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from gpupool.errors import GPUPoolError, bad_request, not_found
from gpupool.schema import LeaseRequest, LeaseState, utcnow
from gpupool.units import format_duration

from .agent_client import AgentClient
from .auth import Identity
from .capacity import HOLDING, gpu_states
from .config import GPUPool
from .db import Store
from .models import GPU, Lease, LeaseEvent, LeaseGPU, Node, new_lease_id
from .scheduler import Demand, Refusal, place
from .views import lease_json
from .watch import LeaseWatch

log = logging.getLogger("gpupool.service.leases")

#: Most seconds a long poll (``GET /leases/{id}?wait=``) may wait.
MAX_WAIT_S = 60.0
#: Most leases ``GET /leases`` returns (the newest).
LIST_LIMIT = 500


class LeaseBook:
    """Creates, reads and ends leases.

    ``settings`` are the service's ``c.GPUPool``; ``now`` is the one clock
    (UTC-aware datetimes), replaceable so time can be moved in tests;
    ``on_refusal(reasons)`` is told every refusal (for metrics).
    """

    def __init__(self, settings: GPUPool, store: Store, agents: AgentClient, *,
                 now: Callable[[], datetime] = utcnow,
                 on_refusal: Callable[[dict[str, int]], None] | None = None) -> None:
        self.settings = settings
        self.store = store
        self.agents = agents
        self.now = now
        self.watch = LeaseWatch()
        self._on_refusal = on_refusal
        self._tasks: set[asyncio.Task] = set()

    # -- reading ---------------------------------------------------------------

    def get(self, who: Identity, lease_id: str) -> dict[str, Any]:
        """The lease as ``who`` may see it. 404 when it is someone else's."""
        with self.store.read() as session:
            return self._json(self._visible(session, who, lease_id), who)

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
        ``active``: only those holding capacity; ``kernel_id``: only that kernel's."""
        query = select(Lease).where(Lease.owner == who.name)
        if active:
            query = query.where(Lease.state.in_(HOLDING))
        if kernel_id:
            query = query.where(Lease.kernel_id == kernel_id)
        query = query.options(selectinload(Lease.gpus), selectinload(Lease.events))
        with self.store.read() as session:
            rows = session.scalars(query.order_by(Lease.created_at.desc()).limit(LIST_LIMIT)).all()
            return [self._json(lease, who) for lease in reversed(rows)]

    # -- creating --------------------------------------------------------------

    def create(self, who: Identity, body: Any) -> dict[str, Any]:
        """Validate ``body`` (a ``LeaseRequest``), place it and reserve the
        capacity in one transaction, and start the worker in the background.

        Returns the lease JSON (state ``starting``). Raises 400 ``bad_request``
        for bad input and 409 ``pool_full`` (with ``reasons``) when nothing fits.
        """
        request = LeaseRequest.from_json(body)
        idle_timeout = self._idle_timeout(request.idle_timeout)
        demand = Demand(request.fraction, request.gpu_count, request.memory, request.model)
        now = self.now()
        with self.writing() as session:
            self.store.lock_capacity(session)
            decision = place(demand, gpu_states(session, self.settings.context_overhead))
            if isinstance(decision, Refusal):
                self._refused(who, decision)
            gpus = {g.uuid: g for g in session.scalars(select(GPU).where(GPU.uuid.in_(decision.gpus)))}
            lease = Lease(id=new_lease_id(), owner=who.name, fraction=decision.fraction, gpu_count=request.gpu_count,
                          memory=decision.memory, node_name=decision.node, kernel_id=request.kernel_id,
                          idle_timeout=idle_timeout, heartbeat_ttl=self.settings.heartbeat_ttl,
                          created_at=now, usage_gpu_seconds=0.0)
            lease.gpus = [LeaseGPU(gpu_uuid=u, name=gpus[u].name, index=gpus[u].index) for u in decision.gpus]
            where = ", ".join(f"GPU {g.index} ({g.name})" for g in lease.gpus)
            _transition(session, lease, LeaseState.starting, f"placed on {decision.node}: {where}", now)
            session.add(lease)
            session.flush()
            result = self._json(lease, who)
        log.info("lease %s created for %s: %s on %s %s", lease.id, who.name, demand.describe(),
                 decision.node, where)
        self.spawn(self._start(lease.id))
        return result

    def _idle_timeout(self, asked: float | None) -> float:
        if asked is None:
            return self.settings.idle_timeout
        if asked > self.settings.max_idle_timeout:
            raise bad_request(f"idle_timeout {format_duration(asked)} is above this pool's maximum of "
                              f"{format_duration(self.settings.max_idle_timeout)}; ask for less "
                              "(an admin can raise c.GPUPool.max_idle_timeout)",
                              max_idle_timeout=self.settings.max_idle_timeout)
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
            return self._json(lease, who)

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
        if url:
            await self._stop_worker(url, lease_id)
        self._finish(lease_id)

    def _finish(self, lease_id: str) -> None:
        """``releasing`` -> its final state; records ``ended_at`` and usage once."""
        now = self.now()
        with self.writing() as session:
            lease = session.get(Lease, lease_id)
            if lease is None or lease.state != LeaseState.releasing.value:
                return
            final = LeaseState(lease.end_state or LeaseState.released.value)
            lease.ended_at = now
            held = (now - lease.started_at).total_seconds() if lease.started_at else 0.0
            lease.usage_gpu_seconds = lease.fraction * lease.gpu_count * max(0.0, held)
            lease.connection = None  # the worker and its key are gone
            _transition(session, lease, final, lease.reason, now)
            usage = lease.usage_gpu_seconds
        log.info("lease %s %s after %s (%.1f GPU-seconds): %s", lease_id, final.value,
                 format_duration(held), usage, lease.reason)

    async def _stop_worker(self, url: str, lease_id: str) -> None:
        try:
            code = await self.agents.stop_worker(url, lease_id, self.settings.worker_stop_timeout)
        except GPUPoolError as exc:
            log.warning("lease %s: could not stop its worker (%s); the agent will be told to stop it "
                        "with its next heartbeat", lease_id, exc.log_message)
            return
        log.debug("lease %s: worker stopped (exit code %s)", lease_id, code)

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
        ``releasing`` ones."""
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
        if url:
            await self._stop_worker(url, lease_id)
        self._finish(lease_id)

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
        """A write transaction that wakes long polls of the leases it changed,
        once committed."""
        with self.store.write() as session:
            yield session
            changed = set(session.info.get("changed_leases", ()))
        self.watch.notify(changed)

    def _visible(self, session: Session, who: Identity, lease_id: str, *, owner_only: bool = False) -> Lease:
        """The lease if ``who`` may see it (its owner, or an admin unless
        ``owner_only``); else 404, so its existence is not revealed."""
        lease = session.get(Lease, lease_id, options=[selectinload(Lease.gpus), selectinload(Lease.events)])
        if lease is None or not (lease.owner == who.name or (who.admin and not owner_only)):
            raise not_found(f"lease {lease_id}")
        return lease

    @staticmethod
    def _json(lease: Lease, who: Identity) -> dict[str, Any]:
        return lease_json(lease, for_owner=lease.owner == who.name)


def _transition(session: Session, lease: Lease, state: LeaseState, reason: str | None, at: datetime) -> None:
    """Set ``lease.state`` and store the event; the commit wakes long polls."""
    lease.state = state.value
    lease.events.append(LeaseEvent(state=state.value, at=at, reason=reason))
    session.info.setdefault("changed_leases", set()).add(lease.id)
