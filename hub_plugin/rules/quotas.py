"""Quotas: who may hold how much. Pure: quota tables and usage in, limits and refusals out.

A quota table maps a scope (``"*"``, ``group:NAME``, ``user:NAME``) to a
partial set of limits (:data:`LIMIT_KEYS`); each limit resolves on its own:
the user's entry, else the most generous of the user's groups that set it,
else ``"*"``, else unlimited. Run-time overrides are merged over the
configured entry of the same scope, limit by limit. The limits, their units
and the refusals' words: docs/api.md, "Quotas".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from gpupool.schema import MIN_FRACTION, has_control_characters
from gpupool.units import format_bytes, format_gpu_hours, parse_bytes, parse_duration
from gpupool.wire.quotas import QUOTA_CEILINGS, SHOWN, Limits

#: Limit names, in the order they are shown: the fields of :class:`~gpupool.wire.quotas.Limits`.
LIMIT_KEYS = Limits.KEYS
DEFAULT_SCOPE = "*"
#: The limits :func:`check` refuses a request by (its :class:`QuotaRefusal`'s ``limit``), counted as ``quota_LIMIT``.
REFUSING_LIMITS = ("max_lease_gpus", "max_gpus", "gpu_hours_per_day", "gpu_hours_per_week")
#: Tolerance for sums of fractions (as the scheduler's).
EPSILON = 1e-9


@dataclass(frozen=True)
class QuotaRefusal:
    """Why a request exceeds a quota: ``limit`` (a :data:`LIMIT_KEYS` name),
    ``message`` (words for the user) and ``hint`` (what to ask for instead, or
    what frees room: ``; ask for at most 0.50``), said last, after any
    ``notes`` the caller adds (:meth:`words`)."""

    limit: str
    message: str
    hint: str = ""

    def words(self, *notes: str) -> str:
        """The whole refusal: the message, then ``notes`` (`` (0.50 of it in parked leases...)``), then the hint."""
        return self.message + "".join(notes) + self.hint


def check_scope(scope: Any) -> str:
    """``"*"``, ``"group:NAME"`` or ``"user:NAME"``; raises ValueError otherwise."""
    if scope == DEFAULT_SCOPE:
        return scope
    if isinstance(scope, str) and len(scope) <= 210:
        kind, _, name = scope.partition(":")
        if kind in ("user", "group") and name and name == name.strip() and not has_control_characters(name):
            return scope
    raise ValueError(f"quota scope {scope!r:.80} must be '*', 'group:NAME' or 'user:NAME' (NAME without "
                     "control characters or spaces around it, at most 210 characters in all)")


def parse_entry(entry: Any, scope: str = "?") -> dict[str, float | None]:
    """One scope's limits with human units read: ``{"max_gpus": 1.0, ...}``.
    Only the limits given appear (None: unlimited). Raises ValueError naming
    the scope and the limit."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"quota {scope!r} must be a dict of limits, got {entry!r}")
    unknown = sorted(set(entry) - set(LIMIT_KEYS))
    if unknown:
        raise ValueError(f"quota {scope!r}: unknown limit(s) {', '.join(map(str, unknown))}; "
                         f"known: {', '.join(LIMIT_KEYS)}")
    return {key: _parse_limit(key, value, scope) for key, value in entry.items()}


def parse_table(table: Any) -> dict[str, dict[str, float | None]]:
    """A whole ``c.PoolQuotas.quotas`` table, read (see :func:`parse_entry`)."""
    if not isinstance(table, Mapping):
        raise ValueError(f"quotas must be a dict of scope -> limits, got {table!r}")
    return {check_scope(scope): parse_entry(entry, scope) for scope, entry in table.items()}


def _parse_limit(key: str, value: Any, scope: str) -> float | None:
    if value is None:
        return None
    where = f"quota {scope!r}: {key}"
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a number, got {value!r}")
    try:
        if key == "max_idle_timeout":
            number: float = parse_duration(value)
        elif key == "max_parked_memory":
            number = 0 if value in (0, "0") else parse_bytes(value)  # 0: every park goes to disk
        elif key.startswith("gpu_hours"):
            number = float(value) if isinstance(value, (int, float)) else _hours(value)
        else:
            number = _gpus(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    ceiling = QUOTA_CEILINGS[key]  # above it, a typo (1e99): none says unlimited
    if not math.isfinite(number) or not 0 <= number <= ceiling:
        raise ValueError(f"{where} must be a number from 0 to {_ceiling_words(key, ceiling)} (none for unlimited), "
                         f"got {value!r:.80}")
    return number


def _ceiling_words(key: str, ceiling: float) -> str:
    """``1,000,000 GPUs``, ``24,000,000 GPU-hours``, ``31,622,400 seconds (366 days)``, ``1 PiB``."""
    unit = next(unit for name, _, unit, _ in SHOWN if name == key)
    if unit == "seconds":
        return f"{ceiling:,} seconds ({ceiling // 86400:g} days)"
    if unit == "bytes":
        return f"{ceiling:,} bytes (1 PiB)" if ceiling == 2**50 else f"{ceiling:,} bytes"
    return f"{ceiling:,} {'GPU-hours' if unit == 'hours' else 'GPUs'}"


def _gpus(value: Any) -> float:
    """``1``, ``0.5`` or ``"0.5"`` -> GPUs; ValueError in words otherwise."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError("must be a number of GPUs (e.g. 1.5) or none (null in JSON) for unlimited, "
                         f"got {value!r:.80}") from None


def _hours(text: str) -> float:
    """``"8"`` -> 8 hours; ``"90m"`` -> 1.5 hours."""
    try:
        return float(text)
    except ValueError:
        return parse_duration(text) / 3600.0


def merge(configured: Mapping[str, Mapping[str, float | None]],
          overrides: Mapping[str, Mapping[str, float | None]]) -> dict[str, dict[str, float | None]]:
    """The effective table: each override merged over the configured entry of its scope."""
    table = {scope: dict(entry) for scope, entry in configured.items()}
    for scope, entry in overrides.items():
        table.setdefault(scope, {}).update(entry)
    return table


def resolve(user: str, groups: Iterable[str], table: Mapping[str, Mapping[str, float | None]], *,
            max_idle_timeout: float | None = None) -> Limits:
    """``user``'s limits from ``table`` (read, see :func:`parse_table`): user
    over group over default, the most generous group winning (module docstring)."""
    own = table.get(f"user:{user}", {})
    group_entries = [table[f"group:{g}"] for g in sorted(set(groups)) if f"group:{g}" in table]
    default = table.get(DEFAULT_SCOPE, {})
    values: dict[str, float | None] = {}
    for key in LIMIT_KEYS:
        if key in own:
            values[key] = own[key]
        elif any(key in entry for entry in group_entries):
            values[key] = _most_generous((entry[key] for entry in group_entries if key in entry),
                                         none_is_most=key != "guaranteed_gpus")
        elif key in default:
            values[key] = default[key]
        else:
            values[key] = max_idle_timeout if key == "max_idle_timeout" else None
    return Limits(**values)


def _most_generous(values: Iterable[float | None], none_is_most: bool = True) -> float | None:
    """The largest of ``values``; None (unlimited) beats any number unless
    ``none_is_most`` is False (a guarantee: None is nothing guaranteed)."""
    values = list(values)
    if none_is_most:
        return None if any(v is None for v in values) else max(values)
    numbers = [v for v in values if v is not None]
    return max(numbers) if numbers else None


def check(limits: Limits, *, holding: float, requested: float, used_today_s: float, used_week_s: float,
          day_resets: str, week_resets: str) -> QuotaRefusal | None:
    """Whether a request for ``requested`` GPUs (fraction x count) fits
    ``limits`` for a user who holds (or waits for) ``holding`` GPUs and has
    used ``used_today_s`` / ``used_week_s`` GPU-seconds; ``day_resets`` /
    ``week_resets`` are words like ``"00:00 UTC"``. None when it fits."""
    if limits.max_lease_gpus is not None and requested > limits.max_lease_gpus + EPSILON:
        return QuotaRefusal("max_lease_gpus", f"lease too large: at most {limits.max_lease_gpus:.2f} GPU per lease; "
                            f"requested {requested:.2f}")
    if limits.max_gpus is not None and holding + requested > limits.max_gpus + EPSILON:
        if holding <= EPSILON and limits.max_gpus < MIN_FRACTION - EPSILON:  # nothing to release would help
            return QuotaRefusal("max_gpus", f"quota exceeded: your quota allows no GPUs (max_gpus "
                                f"{limits.max_gpus:g}); requested {requested:.2f}",
                                "; ask the pool's admin to raise your max_gpus (gpupool quota shows your limits)")
        return QuotaRefusal("max_gpus", f"quota exceeded: you hold {holding:.2f} of {limits.max_gpus:.2f} GPU; "
                            f"requested {requested:.2f}", _what_fits(limits, limits.max_gpus - holding))
    for limit, word, used, resets in (("gpu_hours_per_day", "daily", used_today_s, day_resets),
                                      ("gpu_hours_per_week", "weekly", used_week_s, week_resets)):
        allowed = getattr(limits, limit)
        if allowed is not None and used / 3600.0 >= allowed - EPSILON:
            # The use as it is, also beyond the limit (a running lease goes on using): as `gpupool quota` shows it
            shown = allowed if abs(used / 3600.0 - allowed) <= EPSILON else used / 3600.0
            return QuotaRefusal(limit, f"{word} GPU-hours used up ({format_gpu_hours(shown)} "
                                f"of {format_gpu_hours(allowed)}); resets {resets}")
    return None


def _what_fits(limits: Limits, room: float) -> str:
    """The hint of a ``max_gpus`` refusal when ``room`` GPUs are left: the most one
    request may ask for (a slice below 1, else whole GPUs; within ``max_lease_gpus``),
    as ``%gpu acquire`` takes it; or, when not even the smallest slice fits, what frees room."""
    if limits.max_lease_gpus is not None:
        room = min(room, limits.max_lease_gpus)
    if room < 1 - EPSILON:
        room = math.floor(room * 100 + EPSILON * 100) / 100  # down: a rounded-up amount would not fit
        if room < MIN_FRACTION:
            return "; nothing more fits: release a lease or cancel a queued request first (gpupool status lists them)"
        return f"; ask for at most {room:.2f}"
    return f"; ask for at most {math.floor(room + EPSILON)}"


def park_tier(limits: Limits, parked_bytes: int, estimate: int) -> tuple[str, str | None]:
    """Where a park of about ``estimate`` host bytes goes for a user whose leases
    parked in memory hold ``parked_bytes`` now: ``("memory", None)``, or
    ``("disk", words)`` when that would pass ``limits.max_parked_memory``."""
    cap = limits.max_parked_memory
    if cap is None or parked_bytes + estimate <= cap:
        return "memory", None
    return "disk", (f"parked to disk: your leases parked in memory hold {format_bytes(parked_bytes)} of host memory "
                    f"and this one about {format_bytes(estimate)} more, beyond your max_parked_memory of "
                    f"{format_bytes(cap)}")
