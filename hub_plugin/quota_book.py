"""Quotas in the service: the configured table plus the run-time overrides
kept in SQL, resolved for a user and enforced inside the transaction that
reserves capacity (the rules themselves are pure, in :mod:`.rules.quotas`).

Refusals are HTTP 429 ``quota_exceeded`` with ``limit`` naming the limit
(docs/api.md, "Quotas"): the request is well-formed and the pool may even
have room, but this user may not take more now.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any, Callable, Mapping
from zoneinfo import ZoneInfo

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpupool.errors import GPUPoolError, Reason, bad_request, not_found
from gpupool.schema import isoformat
from gpupool.wire.quotas import Quota, QuotaUsage

from . import usage
from .rules import quotas
from .auth import Identity
from .config import PoolLeases, PoolQuotas
from .models import Lease, QuotaOverride

log = logging.getLogger("gpupool.service.quotas")


class QuotaBook:
    """Limits and usage per user. ``pool_quotas``: the quotas, groups and usage
    time zone; ``pool_leases``: the pool's ``max_idle_timeout``, a quota's default;
    ``now``: the service's one clock."""

    def __init__(self, pool_quotas: PoolQuotas, pool_leases: PoolLeases, now: Callable[[], datetime]) -> None:
        self.pool_quotas = pool_quotas
        self.pool_leases = pool_leases
        self.now = now
        self.tz = ZoneInfo(pool_quotas.usage_timezone)

    def groups_of(self, who: Identity) -> tuple[str, ...]:
        """``who``'s groups: the authenticator's (JupyterHub's) and ``c.PoolQuotas.groups``."""
        configured = {group for group, members in self.pool_quotas.groups.items() if who.name in members}
        return tuple(sorted(set(getattr(who, "groups", ()) or ()) | configured))

    # -- limits ----------------------------------------------------------------------------------

    def overrides(self, session: Session) -> dict[str, dict[str, float | None]]:
        """The run-time overrides, scope -> limits."""
        return {row.scope: dict(row.limits) for row in session.scalars(select(QuotaOverride))}

    def table(self, session: Session) -> dict[str, dict[str, float | None]]:
        """The effective table: configuration with the overrides merged over it."""
        return quotas.merge(self.pool_quotas.quotas, self.overrides(session))

    def limits(self, session: Session, user: str, groups: tuple[str, ...]) -> quotas.Limits:
        return quotas.resolve(user, groups, self.table(session), max_idle_timeout=self.pool_leases.max_idle_timeout)

    def enforce(self, session: Session, user: str, limits: quotas.Limits, requested: float, now: datetime,
                replaced: Lease | None = None) -> None:
        """Raise 429 ``quota_exceeded`` when ``user`` may not take ``requested``
        more GPUs now; ``replaced``: the user's lease this request moves from
        (``LeaseRequest.replaces``), not counted. Call after ``Store.lock_capacity``, in the transaction
        that then writes the lease, so concurrent requests cannot both pass."""
        today, week = usage.used(session, user, now, self.tz) if _counts_hours(limits) else (0.0, 0.0)
        held = usage.holding(session, user) - (0.0 if replaced is None else replaced.fraction * replaced.gpu_count)
        refusal = quotas.check(limits, holding=max(held, 0.0), requested=requested,
                               used_today_s=today, used_week_s=week,
                               day_resets=usage.resets_words(self.tz, usage.DAY),
                               week_resets=usage.resets_words(self.tz, usage.WEEK))
        if refusal is not None:
            notes = []
            parked = usage.parked_gpus(session, user) if refusal.limit == "max_gpus" else 0.0
            if parked:  # they count: each may resume at any time
                notes.append(f" ({parked:.2f} of it in parked leases, which keep their GPUs' worth; release one you "
                             "no longer need)")
            if replaced is not None and refusal.limit == "max_gpus":
                notes.append(f" (not counting {replaced.id}, which this lease replaces)")
            message = refusal.words(*notes)
            log.info("lease for %s refused by quota %s: %s", user, refusal.limit, message)
            raise GPUPoolError(Reason.quota_exceeded, message, 429, limit=refusal.limit)

    # -- what GET /quota shows ---------------------------------------------------------------------

    def mine(self, session: Session, who: Identity) -> dict[str, Any]:
        """``GET /api/v1/quota``: ``who``'s limits and usage (docs/api.md)."""
        now = self.now()
        groups = self.groups_of(who)
        today, week = usage.used(session, who.name, now, self.tz)
        return Quota(who.name, list(groups), self.limits(session, who.name, groups), QuotaUsage(
            holding_gpus=round(usage.holding(session, who.name), 9),
            today_gpu_hours=today / 3600.0, week_gpu_hours=week / 3600.0,
            day_resets_at=isoformat(usage.period(now, self.tz, usage.DAY)[1]),
            week_resets_at=isoformat(usage.period(now, self.tz, usage.WEEK)[1]),
            timezone=self.pool_quotas.usage_timezone, parked_memory=usage.parked_memory(session, who.name))).to_json()

    # -- admin: overrides --------------------------------------------------------------------------

    def listing(self, session: Session) -> dict[str, Any]:
        """``GET /admin/quotas``: configured, overrides (with who and when) and effective tables."""
        rows = list(session.scalars(select(QuotaOverride).order_by(QuotaOverride.scope)))
        return {"configured": self.pool_quotas.quotas,
                "overrides": {r.scope: {"limits": dict(r.limits), "updated_at": isoformat(r.updated_at),
                                        "updated_by": r.updated_by} for r in rows},
                "effective": self.table(session)}

    def set_override(self, session: Session, scope: str, body: Any, by: str) -> dict[str, float | None]:
        """``PUT /admin/quotas/{scope}``: merge ``body`` (limits, human units
        allowed, ``null`` unlimited) into the scope's override. 400 on bad input."""
        try:
            scope = quotas.check_scope(scope)
            limits = quotas.parse_entry(body, scope)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        if not limits:
            raise bad_request(f"nothing to set for {scope}: give at least one limit ({', '.join(quotas.LIMIT_KEYS)}); "
                              f"DELETE /admin/quotas/{scope} removes its override")
        row = session.get(QuotaOverride, scope)
        table = self.table(session)
        _check_guarantee(scope, {**table.get(quotas.DEFAULT_SCOPE, {}), **table.get(scope, {}), **limits})
        if row is None:
            row = QuotaOverride(scope=scope, limits={})
            session.add(row)
        row.limits = {**row.limits, **limits}  # a new dict, so the JSON column sees the change
        row.updated_at, row.updated_by = self.now(), by
        log.info("quota override for %s set by %s: %s", scope, by, row.limits)
        return dict(row.limits)

    def clear_override(self, session: Session, scope: str, by: str) -> None:
        """``DELETE /admin/quotas/{scope}``: back to the configured limits; 404 when none."""
        row = session.get(QuotaOverride, scope)
        if row is None:
            raise not_found(f"quota override for {scope}")
        session.delete(row)
        log.info("quota override for %s removed by %s", scope, by)


def _check_guarantee(scope: str, limits: Mapping[str, float | None]) -> None:
    """409 ``invalid_state`` when ``limits`` (a scope's, over the default's and what the scope has
    already) guarantee more GPUs than they let one hold."""
    guaranteed, most = limits.get("guaranteed_gpus"), limits.get("max_gpus")
    if guaranteed is not None and most is not None and guaranteed > most:
        raise GPUPoolError(Reason.invalid_state, f"quota {scope}: guaranteed_gpus {guaranteed:g} is more than its "
                           f"max_gpus {most:g}: nobody is guaranteed more than they may hold; raise max_gpus too, "
                           "or guarantee less", 409)


def _counts_hours(limits: quotas.Limits) -> bool:
    # The ledger is read only when a GPU-hour limit applies: most requests skip the query.
    return limits.gpu_hours_per_day is not None or limits.gpu_hours_per_week is not None
