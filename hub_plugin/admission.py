"""Whether a new lease request may be taken: its ``wait`` and ``idle_timeout``
against the pool's maximums, the user's quota and the per-user caps, the
host resources it names, the worker environment it asks for. Each refusal is
a :class:`~gpupool.errors.GPUPoolError` for the client and is counted
(``on_refusal``) for the metrics.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace
from datetime import datetime
from typing import Callable, Mapping

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpupool.errors import GPUPoolError, Reason, bad_request
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest
from gpupool.units import format_bytes, format_durations_alike

from .auth import Identity
from .config import PoolLeases, PoolQuotas
from .environments import lease_environment, unknown_environment, unusable_on
from .models import Lease
from .placing import Placer
from .quota_book import QuotaBook
from .rules.hosts import beyond_every_node
from .rules.misfits import limit_code
from .rules.quotas import Limits
from .rules.scheduler import NO_ENVIRONMENT, Demand, Refusal
from .transitions import CAPPED, QUEUED

log = logging.getLogger("gpupool.service.leases")
#: The per-user caps (``c.PoolQuotas.NAME``) :meth:`Admission._check_cap` refuses by, counted as ``quota_NAME``.
PER_USER_CAPS = ("max_active_per_user", "max_queued_per_user")

#: The states of a lease a new one may replace (a move, ``LeaseRequest.replaces``).
REPLACEABLE = (LeaseState.active.value, LeaseState.parked.value)
#: The states of a move's new lease that keep its old one replaced: not ended.
MOVING = tuple(state.value for state in LeaseState if not state.ended)


class Admission:
    """The checks of ``POST /leases``. ``on_refusal(codes)`` is told every
    refusal (code -> count: a :class:`.rules.misfits.Misfit`, or a limit's
    :func:`~.rules.misfits.limit_code`); the checks that read the store run in the
    creating transaction, after the capacity lock. ``pool_leases``: the pool's
    wait and idle timeouts; ``pool_quotas``: the per-user caps."""

    def __init__(self, pool_leases: PoolLeases, pool_quotas: PoolQuotas, quotas: QuotaBook, placer: Placer,
                 on_refusal: Callable[[Mapping[str, int]], None] | None = None) -> None:
        self.pool_leases = pool_leases
        self.pool_quotas = pool_quotas
        self.quotas = quotas
        self.placer = placer
        self._on_refusal = on_refusal or (lambda reasons: None)

    # -- before the transaction ------------------------------------------------------------------

    def wait(self, asked: float | None) -> float:
        """Seconds a request may queue (0: not at all); 400 above ``c.PoolLeases.max_wait``."""
        if not asked:
            return 0.0
        most = self.pool_leases.max_wait
        if asked > most:
            # In one unit ("2h ... 1h", not "1d 3h ... 1d"); led by the field, which the clients turn into the
            # option their users typed (gpupool.leaseargs.option_words: --wait).
            asked_words, most_words = format_durations_alike(asked, most)
            raise bad_request(f"wait {asked_words} is above this pool's maximum of {most_words}; ask for less "
                              "(an admin can raise c.PoolLeases.max_wait)", field="wait", max_wait=most)
        return asked

    def groups_of(self, who: Identity) -> tuple[str, ...]:
        """``who``'s groups (:meth:`.quota_book.QuotaBook.groups_of`): their quota follows them, the lease records them."""
        return self.quotas.groups_of(who)

    # -- in the transaction ----------------------------------------------------------------------

    def limits(self, session: Session, owner: str, groups: tuple[str, ...]) -> Limits:
        """``owner``'s quota limits as the store holds them now."""
        return self.quotas.limits(session, owner, groups)

    def idle_timeout(self, asked: float | None, most: float | None) -> float:
        """The lease's idle timeout: ``asked``, or the pool's default capped at
        ``most`` (the user's quota, by default ``c.PoolLeases.max_idle_timeout``)."""
        if asked is None:
            default = self.pool_leases.idle_timeout
            return default if most is None else min(default, most)
        if most is not None and asked > most:
            # "99h ... 24h", not "4d 3h ... 1d": the asked in the maximum's unit; --idle-timeout in the clients.
            asked_words, most_words = format_durations_alike(asked, most)
            raise bad_request(f"idle_timeout {asked_words} is above your maximum of {most_words} (max_idle_timeout: "
                              "your quota's, else the pool's); ask for less (an admin can raise "
                              "c.PoolLeases.max_idle_timeout, or max_idle_timeout in your quota)",
                              field="idle_timeout", max_idle_timeout=most)
        return asked

    def environment(self, session: Session, request: LeaseRequest) -> str | None:
        """The worker environment the lease asks for (:func:`.environments.lease_environment`);
        409 ``unknown_environment`` when ``env`` names one that no node offers."""
        if request.env is None and request.prefer_env is None:
            return None
        offered = self.placer.pool(session).environments()
        try:
            return lease_environment(request.env, request.prefer_env, offered)
        except ValueError:
            self._on_refusal({NO_ENVIRONMENT: 1})
            raise unknown_environment(request.env, offered, unusable_on(session, request.env)) from None

    def replaced(self, session: Session, owner: str, lease_id: str | None) -> Lease | None:
        """The lease a move replaces (``LeaseRequest.replaces``): ``owner``'s own
        active or parked lease; None when ``lease_id`` is None. 409
        ``invalid_state`` otherwise (the same words whether the lease is someone
        else's or none at all): a refusal by the store's state, not by the
        body's form, which the API document cannot tell apart (not a 400)."""
        if lease_id is None:
            return None
        lease = session.get(Lease, lease_id)
        if lease is None or lease.owner != owner or lease.state not in REPLACEABLE:
            state = f" (it is {lease.state})" if lease is not None and lease.owner == owner else ""
            raise GPUPoolError(Reason.invalid_state, f"'replaces' must name one of your active or parked leases; "
                               f"{lease_id[:40]!r} is not one{state}", 409, field="replaces")
        other = session.scalar(select(Lease.id).where(Lease.replaces == lease_id, Lease.state.in_(MOVING)))
        if other is not None:  # one move at a time: else each would leave the quota one more uncounted lease
            raise GPUPoolError(Reason.invalid_state, f"{lease_id} is being replaced already, by {other} (a move): "
                               "release one of them first", 409, field="replaces")
        return lease

    def admit(self, session: Session, owner: str, limits: Limits, demand: Demand, now: datetime,
              replaced: Lease | None = None) -> int:
        """400 when no node of the pool could ever take ``demand`` (:meth:`_check_pool`),
        then 429 over ``owner``'s quota or ``c.PoolQuotas.max_active_per_user``;
        ``replaced`` (a move's old lease, :meth:`replaced`) counts toward neither.
        Returns how many requests ``owner`` has queued (for :meth:`may_queue`)."""
        try:
            # First: a quota that is raised, or a lease that is released, would not make it fit.
            self._check_pool(session, demand)
            self.quotas.enforce(session, owner, limits, demand.fraction * demand.gpu_count, now, replaced)
            held, queued = _counts(session, owner)
            if replaced is not None and replaced.state in CAPPED:
                held -= 1
            self._check_cap("max_active_per_user", held)
        except GPUPoolError as exc:
            self._refused_by_limit(exc)
            raise
        return queued

    def may_queue(self, queued: int) -> None:
        """429 when ``queued`` requests already reach ``c.PoolQuotas.max_queued_per_user``."""
        try:
            self._check_cap("max_queued_per_user", queued)
        except GPUPoolError as exc:
            self._refused_by_limit(exc)
            raise

    def queued(self, refusal: Refusal) -> None:
        """A request that did not fit waits: its reasons are counted all the same."""
        self._on_refusal(refusal.reasons)

    def refuse(self, who: Identity, refusal: Refusal) -> None:
        """409 ``pool_full`` (with ``reasons``): nothing fits and the request does not wait."""
        self._on_refusal(refusal.reasons)
        log.info("lease for %s refused: %s", who.name, refusal.message)
        raise GPUPoolError(Reason.pool_full, refusal.message, 409, reasons=refusal.tally())

    def _check_cap(self, name: str, have: int) -> None:
        """429 ``quota_exceeded`` when ``have`` leases already reach ``c.PoolQuotas.<name>``."""
        cap = getattr(self.pool_quotas, name)
        if cap is None or have < cap:
            return
        if name == "max_active_per_user":
            words = (f"you hold {have} leases (starting or active), the most one user may hold at once "
                     f"(c.PoolQuotas.max_active_per_user = {cap}); release one first (%gpu release)")
        else:
            words = (f"you have {have} requests waiting in the queue, the most one user may have "
                     f"(c.PoolQuotas.max_queued_per_user = {cap}); cancel one (DELETE /api/v1/leases/ID) "
                     "or wait until one is placed")
        raise GPUPoolError(Reason.quota_exceeded, f"too many requests: {words}; an admin can raise "
                           f"c.PoolQuotas.{name}", 429, limit=name, cap=cap)

    def beyond_the_pool(self, session: Session, demand: Demand) -> None:
        """400 (counted) when no node of the pool could ever take ``demand``, as
        :meth:`admit` checks first; for a request the wire's bounds refuse (a
        ``gpu_count`` above ``MAX_GPU_COUNT``), so that the pool's own limit, where
        lower, is what the person hears: the biggest node and what to ask for."""
        try:
            self._check_pool(session, demand)
        except GPUPoolError as exc:
            self._refused_by_limit(exc)
            raise

    def _check_pool(self, session: Session, demand: Demand) -> None:
        """400 when ``demand`` names a GPU model the pool has none of, more host
        than any node has, more whole GPUs than the biggest node has, or more GPU
        memory than any GPU lets leases have; its ``limit`` names the field
        (``model``, ``cpus``, ``host_memory``, ``gpu_count``, ``memory``), which
        the refusal is counted by (:data:`.rules.misfits.POOL_LIMITS`)."""
        pool = self.placer.pool(session)
        gpus = pool.all()
        words = no_gpu_of_model(demand, gpus)
        if words is not None:
            raise bad_request(words, limit="model")
        # The cores alone first, as beyond_every_node checks them: the 400 names the field no node has enough of.
        words = beyond_every_node(replace(demand, host_memory=None), pool.hosts)
        if words is not None:
            raise bad_request(words, limit="cpus")
        words = beyond_every_node(demand, pool.hosts)
        if words is not None:
            raise bad_request(words, limit="host_memory")
        self._check_gpus(gpus, demand)

    @staticmethod
    def _check_gpus(gpus, demand: Demand) -> None:
        """400 when ``demand`` asks for more whole GPUs than the biggest node
        has, or more GPU memory than any GPU lets leases have."""
        if demand.gpu_count > 1:
            words = more_gpus_than_any_node(demand, gpus)
            if words is not None:
                raise bad_request(words, limit="gpu_count")
        words = more_memory_than_any_gpu(demand, gpus)
        if words is not None:
            raise bad_request(words, limit="memory")

    def _refused_by_limit(self, exc: GPUPoolError) -> None:
        # Counted by limit, beside the scheduler's: a quota's (429) as quota_LIMIT, the pool's own (400) as its misfit.
        self._on_refusal({limit_code(exc.extra.get("limit"), quota=exc.code == Reason.quota_exceeded): 1})


def no_gpu_of_model(demand: Demand, gpus) -> str | None:
    """Words for a person when ``demand`` names a ``model`` that no registered
    GPU in ``gpus`` (:class:`.rules.scheduler.GPUState`) matches (a part of
    its name, as the scheduler matches), else None: no wait can bring one. As
    :func:`more_gpus_than_any_node`, a lost node's GPUs count (it may come
    back) and an empty pool refuses nothing here (a node may yet register)."""
    if not demand.model or not gpus:
        return None
    model = demand.model.lower()
    if any(model in g.name.lower() for g in gpus):
        return None
    names = ", ".join(sorted({g.name for g in gpus}))
    return (f"the pool has no GPU of model {demand.model}; its models: {names}; ask for one of those "
            "(--model matches any part of the name), or for no model")


def more_gpus_than_any_node(demand: Demand, gpus) -> str | None:
    """Words for a person when ``demand``'s whole GPUs (which must be on one
    node) outnumber the GPUs (of its ``model``, if it names one) of every
    registered node in ``gpus`` (:class:`.rules.scheduler.GPUState`), else None.
    A lost node's GPUs count (it may come back); an empty pool, or one with no
    GPU of that model, refuses nothing here (:func:`no_gpu_of_model` says so)."""
    model = (demand.model or "").lower()
    per_node = Counter(g.node for g in gpus if model in g.name.lower())
    if not per_node:
        return None
    node, most = min(per_node.items(), key=lambda item: (-item[1], item[0]))
    if demand.gpu_count <= most:
        return None
    kind = f" of model {demand.model}" if demand.model else ""
    noun = "GPU" if most == 1 else "GPUs"
    return (f"{demand.gpu_count} whole GPUs{kind} is more than any node has (a lease's GPUs are all on one node): "
            f"the biggest, {node}, has {most} {noun}{kind}; ask for at most {most}")


def more_memory_than_any_gpu(demand: Demand, gpus) -> str | None:
    """Words for a person when ``demand`` names more memory per GPU than any
    registered GPU (of its ``model``, if it names one) lets leases have
    (``memory_usable``: its total less what the agent reserves), else None. As
    :func:`more_gpus_than_any_node`, a lost node's GPUs count and an empty
    pool refuses nothing here."""
    if demand.memory is None:
        return None
    model = (demand.model or "").lower()
    candidates = [g for g in gpus if model in g.name.lower()]
    if not candidates:
        return None
    largest = max(candidates, key=lambda g: (g.memory_usable, g.node))
    if demand.memory <= largest.memory_usable:
        return None
    kind = f" of model {demand.model}" if demand.model else ""
    return (f"{format_bytes(demand.memory)} of GPU memory is more than any GPU{kind} offers: the largest, "
            f"{largest.name} on {largest.node}, lets a lease have {format_bytes(largest.memory_usable)}; ask for "
            "at most that (--memory)")


def _counts(session: Session, owner: str) -> tuple[int, int]:
    """``owner``'s leases ``(holding: starting or active, queued)``, for the per-user caps."""
    rows = dict(session.execute(select(Lease.state, func.count()).where(
        Lease.owner == owner, Lease.state.in_(CAPPED + (QUEUED,))).group_by(Lease.state)).all())
    return sum(rows.get(state, 0) for state in CAPPED), rows.get(QUEUED, 0)
