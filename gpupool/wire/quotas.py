"""The quota bodies (docs/api.md, "Quotas"): a user's :class:`Limits` (what
``PUT /api/v1/admin/quotas/{scope}`` takes, where human units are read by
``hub_plugin/rules/quotas.py``), and the :class:`Quota` that
``GET /api/v1/quota`` answers, limits beside :class:`QuotaUsage`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from .fields import Body, Spec, ref, wired


def _gpus(words: str | None = None) -> Any:
    return wired(Spec("number", words, nullable=True, minimum=0), None)


@dataclass(frozen=True)
class Limits(Body):
    """A user's resolved limits, or a scope's (partial) entry; None means
    unlimited. GPUs are sums of ``fraction x gpu_count``, GPU-hours hours,
    ``max_idle_timeout`` seconds, ``max_parked_memory`` bytes. Resolved and
    checked by the pure rules of ``hub_plugin/rules/quotas.py``, which name the
    limits by these fields; :data:`SHOWN` says how ``%gpu quota`` and
    ``gpupool quota`` show each."""

    SCHEMA: ClassVar[dict[str, Any]] = {
        "additionalProperties": False,
        "description": "null: unlimited. When set, gpu_hours_* and max_idle_timeout also take strings with a unit "
                       "('8h', '30m')"}

    max_gpus: float | None = _gpus("GPUs held, queued or parked at once (sum of fractions)")
    max_lease_gpus: float | None = _gpus("fraction x count of one lease")
    gpu_hours_per_day: float | None = _gpus()
    gpu_hours_per_week: float | None = _gpus()
    max_idle_timeout: float | None = wired(Spec("number", "seconds", nullable=True, exclusive_minimum=0), None)
    guaranteed_gpus: float | None = _gpus("GPUs never parked early nor preempted (the oldest leases first); "
                                          "null: none")
    max_parked_memory: int | None = wired(Spec("integer", "bytes of host RAM the user's leases parked in memory may "
                                               "hold on their nodes; a park beyond it goes to disk (docs/parking.md)",
                                               nullable=True, minimum=0), None)

    def to_json(self) -> dict[str, float | None]:
        """Every limit, null where unlimited."""
        return asdict(self)


#: Most days ``GET /admin/usage?days=`` reports (``gpupool quota usage --days``).
MAX_USAGE_DAYS = 92

#: How each limit is shown beside the usage it bounds: ``(limit, words, unit,
#: the QuotaUsage field it bounds or None)``, in the order of :attr:`Limits.KEYS`.
#: Units: ``gpus``, ``hours`` (GPU-hours), ``seconds``, ``bytes``.
SHOWN: tuple[tuple[str, str, str, str | None], ...] = (
    ("max_gpus", "GPUs held, queued or parked", "gpus", "holding_gpus"),
    ("max_lease_gpus", "one lease", "gpus", None),
    ("gpu_hours_per_day", "GPU-hours today", "hours", "today_gpu_hours"),
    ("gpu_hours_per_week", "GPU-hours this week", "hours", "week_gpu_hours"),
    ("max_idle_timeout", "longest idle timeout", "seconds", None),
    ("guaranteed_gpus", "guaranteed share", "gpus", None),
    ("max_parked_memory", "host memory of parked leases", "bytes", "parked_memory"),
)


_TIME = {"type": "string", "format": "date-time"}


@dataclass(frozen=True)
class QuotaUsage(Body):
    """What a user holds and has used: ``holding_gpus`` (GPUs held,
    queued or parked now), GPU-hours ``today_gpu_hours`` and ``week_gpu_hours`` in
    ``c.PoolQuotas.usage_timezone`` (``timezone``), and when each period ends
    (ISO 8601 UTC); ``parked_memory`` the host bytes their leases parked in
    memory hold now (parked time holds no GPU: it counts no GPU-hour)."""

    holding_gpus: float = wired(Spec("number"))
    today_gpu_hours: float = wired(Spec("number"))
    week_gpu_hours: float = wired(Spec("number"))
    day_resets_at: str = wired(Spec(**_TIME))
    week_resets_at: str = wired(Spec(**_TIME))
    timezone: str = wired(Spec("string"))
    parked_memory: int = wired(Spec("integer", "host bytes your leases parked in memory hold now"), 0)


@dataclass(frozen=True)
class Quota(Body):
    """``GET /api/v1/quota``: the caller's ``user`` name, ``groups``, the
    ``limits`` that apply to them, and their ``usage``."""

    user: str = wired(Spec("string"))
    groups: list[str] = wired(Spec("array", items={"type": "string"}))
    limits: Limits = wired(Spec("", extra=ref("Limits")))
    usage: QuotaUsage = wired(Spec("", extra=ref("QuotaUsage")))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
