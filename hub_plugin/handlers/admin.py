"""``/api/v1/admin``: quota overrides and usage of everyone (admins only:
``c.GPUPool.admin_users``, or the hub's admin scope under JupyterHub)."""

from __future__ import annotations

import re
from datetime import timedelta

from gpupool.errors import bad_request
from gpupool.schema import isoformat
from gpupool.wire.quotas import MAX_USAGE_DAYS

from .. import usage
from ..rules import quotas
from ..auth import Identity, forbidden
from .base import APIHandler


class AdminHandler(APIHandler):
    """Base: :meth:`require_admin` gives the calling admin, else 403."""

    def require_admin(self) -> Identity:
        who = self.require_user()
        if not who.admin:
            raise forbidden(f"only pool admins may call /admin ({self.ctx.authenticator.admin_hint})")
        return who


class QuotaListHandler(AdminHandler):
    """``GET /admin/quotas``: configured, overridden and effective quota tables."""

    async def get(self) -> None:
        self.require_admin()
        self.write_json(await self.ctx.work.read(self._listing_now))

    def _listing_now(self) -> dict:
        with self.ctx.pool.state.reading() as session:
            return self.ctx.pool.quotas.listing(session)


class QuotaOverrideHandler(AdminHandler):
    """``PUT /admin/quotas/{scope}`` merges limits into the scope's override;
    ``DELETE`` removes the override (the configured limits apply again).
    ``scope`` arrives percent-decoded by tornado's router."""

    async def put(self, scope: str) -> None:
        who = self.require_admin()
        limits = await self.ctx.work.write(self._set_now, scope, self.json_body(), who.name)
        self.write_json({"scope": scope, "limits": limits})

    def _set_now(self, scope: str, body, by: str):
        with self.ctx.pool.state.writing() as tx:  # no capacity changes: an empty change set
            return self.ctx.pool.quotas.set_override(tx.session, scope, body, by)

    async def delete(self, scope: str) -> None:
        who = self.require_admin()
        try:
            quotas.check_scope(scope)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        await self.ctx.work.write(self._clear_now, scope, who.name)
        self.write_json({"scope": scope, "limits": None})

    def _clear_now(self, scope: str, by: str) -> None:
        with self.ctx.pool.state.writing() as tx:
            self.ctx.pool.quotas.clear_override(tx.session, scope, by)


class UsageHandler(AdminHandler):
    """``GET /admin/usage?days=7``: GPU-hours per user and group for today,
    this week, and per user per day over the last ``days`` days."""

    async def get(self) -> None:
        self.require_admin()
        text = self.get_query_argument("days", "7")
        if not re.fullmatch(r"[0-9]{1,3}", text) or not 1 <= int(text) <= MAX_USAGE_DAYS:
            raise bad_request(f"'days' must be a whole number from 1 to {MAX_USAGE_DAYS}, got {text!r:.40}")
        days = int(text)
        book = self.ctx.pool.quotas
        now = book.now()
        tz = book.tz
        day_lo, day_hi = usage.period(now, tz, usage.DAY)
        week_lo, week_hi = usage.period(now, tz, usage.WEEK)
        first = now.astimezone(tz).date() - timedelta(days=days - 1)
        lo = usage.period(now - timedelta(days=days - 1), tz, usage.DAY)[0]
        today, week, rows = await self.ctx.work.read(self._usage_now, (day_lo, day_hi), (week_lo, week_hi),
                                                     min(lo, week_lo), now)
        per_user: dict[str, dict[str, float]] = {}
        for owner in sorted({r.owner for r in rows}):
            mine = [r for r in rows if r.owner == owner]
            per_user[owner] = {d.isoformat(): s / 3600.0 for d, s in usage.daily(mine, tz, first, days).items()}
        hours = lambda sums: {k: {n: s / 3600.0 for n, s in v.items()} for k, v in sums.items()}  # noqa: E731
        self.write_json({"timezone": self.ctx.settings.quotas.usage_timezone, "now": isoformat(now),
                         "today_gpu_hours": hours(today), "week_gpu_hours": hours(week),
                         "daily_gpu_hours": per_user})


    def _usage_now(self, day: tuple, week: tuple, since, now):
        """(today's sums, this week's sums, intervals from ``since`` to the end of today)."""
        with self.ctx.pool.state.reading() as session:
            return (usage.summary(session, *day, now), usage.summary(session, *week, now),
                    usage.intervals(session, since, day[1], now))


routes = [
    (r"/api/v1/admin/quotas", QuotaListHandler),
    (r"/api/v1/admin/quotas/([^/]+)", QuotaOverrideHandler),
    (r"/api/v1/admin/usage", UsageHandler),
]
