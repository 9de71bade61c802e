"""``POST /leases``: a new request checked (:mod:`.admission`), placed
(:mod:`.placing`) and written ``starting``, or ``queued`` when nothing fits
and it may wait, in one serialized write transaction; the life cycle
(:mod:`.leases`) then starts its worker.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from gpupool.errors import GPUPoolError, bad_request
from gpupool.leaseclasses import lease_class
from gpupool.schema import MAX_GPU_COUNT, LeaseState
from gpupool.wire.leases import LeaseRequest
from gpupool.units import format_duration

from .admission import Admission
from .auth import Identity
from .background import Background
from .config import PoolLeases, PoolNodes, PoolPressure
from .lease_views import LeaseViews
from .leases import LeaseBook
from .models import Lease, new_lease_id
from .placing import Placer
from .rules.priority import preemption_refusal
from .rules.scheduler import Demand, Placement, Refusal
from .state import PoolState
from .transitions import assign, transition
from .worker_calls import StartJob, start_job

log = logging.getLogger("gpupool.service.leases")

#: Most seconds ``POST /leases?start_wait=`` waits for the new lease's worker.
MAX_START_WAIT_S = 10.0
#: Seconds after a queued request's wait that its own expiry runs: past its ``wait_until`` on the store's clock.
EXPIRY_SLACK_S = 0.05


class LeaseIntake:
    """Takes new requests through ``state``; ``leases.start`` (in ``tasks``)
    starts the worker of one placed; ``views`` gives the JSON returned.
    Reads ``host_share`` (``pool_nodes``), ``heartbeat_ttl`` (``pool_leases``),
    ``allow_preemption`` and the batch settings (``pool_pressure``)."""

    def __init__(self, pool_nodes: PoolNodes, pool_leases: PoolLeases, pool_pressure: PoolPressure,
                 state: PoolState, admission: Admission, placer: Placer,
                 views: LeaseViews, leases: LeaseBook, tasks: Background) -> None:
        self.pool_nodes = pool_nodes
        self.pool_leases = pool_leases
        self.pool_pressure = pool_pressure
        self.state = state
        self.admission = admission
        self.placer = placer
        self.views = views
        self.leases = leases
        self.tasks = tasks

    async def create(self, who: Identity, body: Any, start_wait: float = 0.0) -> dict[str, Any]:
        """Validate ``body`` (a ``LeaseRequest``), check the quota and the
        per-user caps, place it and reserve the capacity in one transaction,
        and start the worker in the background.

        Returns the lease JSON: state ``starting``, or ``queued`` when nothing
        fits and the request has a ``wait``. ``start_wait`` (seconds, at most
        :data:`MAX_START_WAIT_S`): a placed lease is answered once its worker
        started (``active``, with its connection) or could not (``failed``),
        or ``starting`` when that takes longer; the start goes on regardless.
        So a client that waits for the worker anyway saves the long poll
        (``GET /leases/{id}?wait=``) that would otherwise follow. Raises 400 ``bad_request`` for bad
        input, 409 ``unknown_environment`` (with ``environments``, the names
        offered) when ``env`` names a worker environment no node offers, 429
        ``quota_exceeded`` (with ``limit``) over a quota or over
        ``c.PoolQuotas.max_active_per_user`` / ``max_queued_per_user``, and 409
        ``pool_full`` (with ``reasons``) when nothing fits and there is no ``wait``.
        """
        request = await self._request(body)
        refusal = preemption_refusal(bool(request.preemptible), self.pool_pressure.allow_preemption)
        if refusal:
            raise bad_request(refusal, setting="allow_preemption")
        wait = self.admission.wait(request.wait)
        result, job = await self.state.work.write(self._create_now, who, request, wait)
        if job is None:
            if wait:  # queued: it gives up at its wait, not at the sweep after it (reclaim_interval later)
                self.tasks.spawn_after(wait + EXPIRY_SLACK_S, self.leases.expire_queue)
            return result
        started = self.tasks.spawn(self.leases.start(result["id"], job, who if start_wait > 0 else None))
        if start_wait > 0:
            # asyncio.wait cancels nothing when the time runs out: the start goes on in the background.
            done, _ = await asyncio.wait({started}, timeout=min(start_wait, MAX_START_WAIT_S))
            if done:
                # Active: the JSON its start's transaction made; else (failed, released meanwhile) read now.
                shown = started.result() if not started.cancelled() and started.exception() is None else None
                result = shown or await self.views.get(who, result["id"])
        return result

    async def _request(self, body: Any) -> LeaseRequest:
        """``body`` read as a LeaseRequest (400 naming the field). A ``gpu_count``
        above the wire's bound (``MAX_GPU_COUNT``) is refused as one above the
        biggest node where the pool's nodes are smaller (:meth:`.Admission.beyond_the_pool`:
        what to ask for, as for any count no node has), else in the wire's words."""
        try:
            return LeaseRequest.from_json(body)
        except GPUPoolError as exc:
            count = body.get("gpu_count") if isinstance(body, dict) else None
            if not _beyond_the_wire(count):
                raise
            refused = exc
        capped = LeaseRequest.from_json({**body, "gpu_count": MAX_GPU_COUNT})  # every other field checked as ever
        await self.state.work.write(self._beyond_the_pool, replace(capped, gpu_count=int(count)))
        raise refused

    def _beyond_the_pool(self, request: LeaseRequest) -> None:
        """:meth:`.Admission.beyond_the_pool` for ``request`` (its environment aside), under the capacity lock."""
        with self.state.writing() as tx:
            self.state.store.lock_capacity(tx.session)
            self.admission.beyond_the_pool(tx.session, self._demand(request, None))

    def _demand(self, request: LeaseRequest, env: str | None) -> Demand:
        """What ``request`` asks the scheduler for, in worker environment ``env``."""
        return Demand(request.fraction, request.gpu_count, request.memory, request.model, env, request.cpus,
                      request.host_memory, self.pool_nodes.host_share)

    def _create_now(self, who: Identity, request: LeaseRequest,
                    wait: float) -> tuple[dict[str, Any], StartJob | None]:
        """The lease JSON, and what starting its worker takes (None: queued)."""
        groups = self.admission.groups_of(who)
        now = self.state.now()
        with self.state.writing() as tx:
            session = tx.session
            # The lock comes first: the quota check and the placement below
            # then see every lease committed before, and no other decision interleaves.
            self.state.store.lock_capacity(session)
            env = self.admission.environment(session, request)
            demand = self._demand(request, env)
            limits = self.admission.limits(session, who.name, groups)
            idle_timeout = self.admission.idle_timeout(request.idle_timeout, limits.max_idle_timeout)
            replaced = self.admission.replaced(session, who.name, request.replaces)
            queued = self.admission.admit(session, who.name, limits, demand, now, replaced)
            decision = self.placer.place(session, demand)
            if isinstance(decision, Placement) and lease_class(request.lease_class).yields:
                pressure = self.pool_pressure
                decision = self.placer.for_batch(session, decision, demand, now, yields=pressure.batch_yields,
                                                 headroom_nodes=pressure.batch_headroom_nodes)
            elif isinstance(decision, Placement):
                decision = self.placer.for_person(session, decision, demand)
            if isinstance(decision, Refusal):
                if not wait:
                    self.admission.refuse(who, decision)
                self.admission.may_queue(queued)
            lease = _new_lease(who, request, groups, env, idle_timeout, self.pool_leases.heartbeat_ttl, now)
            lease.replaces = replaced.id if replaced is not None else None
            # Kept once placed too: a start whose agent cannot be reached queues it again until then.
            lease.wait_until = now + timedelta(seconds=wait) if wait else None
            if isinstance(decision, Placement):
                where = assign(tx, lease, decision, now)
            else:
                where = "the queue"
                transition(tx, lease, LeaseState.queued, f"waiting up to {format_duration(wait)}: {decision.message}",
                           now)
                self.admission.queued(decision)
            session.add(lease)  # only now: assign's query would flush a lease without a state
            session.flush()
            result = self.views.json(lease, who, session, self.views.newest_view(session, lease))
            job = start_job(session, lease) if isinstance(decision, Placement) else None
        log.info("lease %s created for %s: %s on %s", lease.id, who.name, demand.describe(), where)
        return result, job


def _beyond_the_wire(count: Any) -> bool:
    """Whether ``count`` (a body's ``gpu_count``) is a whole number above ``MAX_GPU_COUNT``
    (JSON may write it ``99`` or ``99.0``)."""
    if isinstance(count, bool) or not isinstance(count, (int, float)):
        return False
    return math.isfinite(count) and count == int(count) and count > MAX_GPU_COUNT


def _new_lease(who: Identity, request: LeaseRequest, groups: tuple[str, ...], env: str | None,
               idle_timeout: float, heartbeat_ttl: float, now: datetime) -> Lease:
    """The row of a new request, before it is placed or queued."""
    return Lease(id=new_lease_id(), owner=who.name, fraction=request.fraction,
                 gpu_count=request.gpu_count, memory=request.memory or 0, kernel_id=request.kernel_id,
                 idle_timeout=idle_timeout, heartbeat_ttl=heartbeat_ttl,
                 created_at=now, usage_gpu_seconds=0.0, groups=list(groups), model=request.model,
                 requested_memory=request.memory, server_name=request.server_name, env=env,
                 lease_class=lease_class(request.lease_class).name, preemptible=bool(request.preemptible),
                 requested_cpus=request.cpus, requested_host_memory=request.host_memory,
                 on_idle=request.on_idle or "park")
