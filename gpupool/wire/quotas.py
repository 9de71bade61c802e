"""The quota bodies (docs/api.md, "Quotas"): a user's :class:`Limits` (what
``PUT /api/v1/admin/quotas/{scope}`` takes, where human units are read by
``hub_plugin/rules/quotas.py``), and the :class:`Quota` that
``GET /api/v1/quota`` answers, limits beside :class:`QuotaUsage`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from ..schema import MAX_BYTES
from .fields import Body, Spec, ref, wired
from .leases import MOST_SECONDS

#: The most GPUs a GPU limit (``max_gpus``, ``max_lease_gpus``, ``guaranteed_gpus``) may name:
#: a bound no pool reaches, so that ``max_gpus=1e99`` is refused as the typo it is.
MAX_QUOTA_GPUS = 1_000_000

#: The largest value of each limit, in its wire unit (GPUs, GPU-hours, seconds, bytes): a
#: GPU-hour limit at most what :data:`MAX_QUOTA_GPUS` could use in its day or week, the idle
#: timeout a lease's longest (``MOST_SECONDS``, 366 days), parked memory 1 PiB. Above it a limit
#: is refused (``hub_plugin/rules/quotas.py``, the one place that reads limits); use none
#: (``null``) for unlimited.
QUOTA_CEILINGS: dict[str, float] = {
    "max_gpus": MAX_QUOTA_GPUS, "max_lease_gpus": MAX_QUOTA_GPUS, "guaranteed_gpus": MAX_QUOTA_GPUS,
    "gpu_hours_per_day": 24 * MAX_QUOTA_GPUS, "gpu_hours_per_week": 7 * 24 * MAX_QUOTA_GPUS,
    "max_idle_timeout": MOST_SECONDS, "max_parked_memory": MAX_BYTES,
}


def _gpus(words: str | None = None, key: str = "max_gpus") -> Any:
    return wired(Spec("number", words, nullable=True, minimum=0, maximum=QUOTA_CEILINGS[key]), None)


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
    max_lease_gpus: float | None = _gpus("fraction x count of one lease", "max_lease_gpus")
    gpu_hours_per_day: float | None = _gpus(None, "gpu_hours_per_day")
    gpu_hours_per_week: float | None = _gpus(None, "gpu_hours_per_week")
    max_idle_timeout: float | None = wired(Spec("number", "seconds", nullable=True, exclusive_minimum=0,
                                                maximum=QUOTA_CEILINGS["max_idle_timeout"]), None)
    guaranteed_gpus: float | None = _gpus("GPUs never parked early nor preempted (the oldest leases first); "
                                          "null: none", "guaranteed_gpus")
    max_parked_memory: int | None = wired(Spec("integer", "bytes of host RAM the user's leases parked in memory may "
                                               "hold on their nodes; a park beyond it goes to disk (docs/parking.md)",
                                               nullable=True, minimum=0, maximum=QUOTA_CEILINGS["max_parked_memory"]),
                                          None)

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
