"""Settings of what each user may hold: quotas, groups, caps (``c.PoolQuotas.*``)."""

from __future__ import annotations

from traitlets import Dict, Integer, List, TraitError, Unicode, validate
from traitlets.config import Configurable


class PoolQuotas(Configurable):
    """What each user may hold: quotas per user and group, the groups, the
    time zone usage is counted in, and the caps on leases and queued requests."""

    quotas = Dict(
        help="""Limits per user, per group and a default; see ``gpupool/hub_plugin/rules/quotas.py``
        and docs/api.md ("Quotas"). Keys are ``"*"``, ``"group:NAME"`` and ``"user:NAME"``;
        values dicts of ``max_gpus`` (GPUs held at once, sum of fractions), ``max_lease_gpus``
        (size of one lease), ``gpu_hours_per_day``, ``gpu_hours_per_week`` (hours, or
        ``"90m"``), ``max_idle_timeout`` (seconds or ``"2h"``), ``guaranteed_gpus`` (never
        parked early nor preempted), ``max_parked_memory`` (bytes or ``"32GiB"``: host RAM the
        user's leases parked in memory may hold; a park beyond it goes to disk); ``None`` means unlimited.
        A user's own entry beats their groups', the most generous group beats the
        default. Admins may override entries at run time (``gpupool quota set``).
        Default: no limits.
        ``c.PoolQuotas.quotas = {"*": {"max_gpus": 1, "gpu_hours_per_day": 8},
        "group:quants": {"max_gpus": 4}, "user:ann": {"max_idle_timeout": "4h"}}``.""",
    ).tag(config=True)

    @validate("quotas")
    def _read_quotas(self, proposal):
        from ..rules.quotas import parse_table

        try:
            return parse_table(proposal["value"])
        except ValueError as exc:
            raise TraitError(f"c.PoolQuotas.quotas: {exc}") from None

    groups = Dict(
        key_trait=Unicode(), value_trait=List(Unicode()),
        help="""Standalone group membership, group name -> user names, for quotas.
        Under JupyterHub the hub's groups are used, and these are added to them.
        Default: none. ``c.PoolQuotas.groups = {"quants": ["ann", "bob"]}``.""",
    ).tag(config=True)

    usage_timezone = Unicode(
        "UTC",
        help="""IANA time zone in which usage days and weeks (Monday first) are counted
        for ``gpu_hours_per_day`` / ``gpu_hours_per_week``; times are stored as UTC.
        Default: ``UTC``. ``c.PoolQuotas.usage_timezone = "Europe/Berlin"``.""",
    ).tag(config=True)

    @validate("usage_timezone")
    def _known_zone(self, proposal):
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(proposal["value"])
        except (ZoneInfoNotFoundError, ValueError):
            raise TraitError(f"c.PoolQuotas.usage_timezone: unknown time zone {proposal['value']!r}; "
                             "use an IANA name such as 'UTC' or 'Europe/Berlin'") from None
        return proposal["value"]

    max_active_per_user = Integer(
        10, allow_none=True, min=1,
        help="""Most leases one user may hold at once (``starting`` or ``active``), whatever
        their size (the GPU amounts are the quotas' business, ``max_gpus``); one more is
        refused with 429 ``quota_exceeded`` (``limit``: ``max_active_per_user``), and a queued
        request of a user at the cap waits until one of theirs ends. ``None``: no cap.
        Default: 10. ``c.PoolQuotas.max_active_per_user = 20``.""",
    ).tag(config=True)

    max_queued_per_user = Integer(
        10, allow_none=True, min=1,
        help="""Most requests one user may have waiting in the queue (``wait``) at once;
        one more is refused with 429 ``quota_exceeded`` (``limit``: ``max_queued_per_user``).
        It keeps one user from filling the queue that everyone's placement reads. ``None``:
        no cap. Default: 10. ``c.PoolQuotas.max_queued_per_user = 50``.""",
    ).tag(config=True)
