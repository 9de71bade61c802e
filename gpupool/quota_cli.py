"""``gpupool quota``: your limits and usage; for admins, run-time quota overrides.

    gpupool quota [show]                      your limits and today's / this week's usage
    gpupool quota list                        admins: configured, overridden and effective quotas
    gpupool quota set SCOPE LIMIT=VALUE ...   admins: e.g. set user:ann max_gpus=2 gpu_hours_per_day=8h
    gpupool quota unset SCOPE                 admins: drop the override, the configured quota applies
    gpupool quota usage [--days 7]            admins: GPU-hours per user and group

SCOPE is ``*``, ``group:NAME`` or ``user:NAME``; VALUE ``none`` means
unlimited. Overrides are kept in the service's SQL store and survive restarts.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from .api import add_client_arguments, client_from_arguments
from .errors import GPUPoolError, Reason
from .tables import table
from .units import format_bytes, format_duration, format_gpu_hours
from .wire.quotas import MAX_USAGE_DAYS, SHOWN, Limits

LIMITS = Limits.KEYS
_UNITS = {key: unit for key, _, unit, _ in SHOWN}


def limit_words(key: str, value: Any) -> str:
    """``('max_idle_timeout', 7200)`` -> ``'2h'``; None -> ``'unlimited'`` (``'none'`` for a guarantee);
    each in the unit the wire gives the limit (:data:`gpupool.wire.quotas.SHOWN`)."""
    if value is None:
        return "none" if key == "guaranteed_gpus" else "unlimited"
    return _in_unit(_UNITS.get(key, "gpus"), value)


def _in_unit(unit: str, value: Any) -> str:
    if unit == "seconds":
        return format_duration(value)
    if unit == "hours":
        return f"{format_gpu_hours(value)} GPU-hours"
    if unit == "bytes":
        return format_bytes(value)
    return f"{value:.2f} GPU"


def _used_words(unit: str, value: Any) -> str:
    if value is None:
        return ""
    if unit == "hours":
        return format_gpu_hours(value, 2)
    return format_bytes(value) if unit == "bytes" else f"{value:.2f}"


def quota_text(body: dict[str, Any]) -> str:
    """``GET /quota`` as text: the limits beside the usage, a row per limit as the wire shows it
    (:data:`gpupool.wire.quotas.SHOWN`; a limit an older service does not send is left out)."""
    used = body["usage"]
    limits = body["limits"]
    rows = [(words, _used_words(unit, used.get(usage)) if usage else "", limit_words(key, limits[key]))
            for key, words, unit, usage in SHOWN if key in limits]
    groups = ", ".join(body["groups"]) or "none"
    head = f"user {body['user']} (groups: {groups}); days and weeks in {used['timezone']}"
    return head + "\n" + table(["limit on", "used", "limit"], rows)[0]


def quotas_text(body: dict[str, Any]) -> str:
    """``GET /admin/quotas`` as text: the effective limits per scope, and who overrode which."""
    effective, overrides = body.get("effective") or {}, body.get("overrides") or {}
    scopes = sorted(set(effective) | set(overrides), key=lambda s: (s != "*", s))
    rows = [[scope, *(limit_words(key, effective.get(scope, {})[key]) if key in effective.get(scope, {}) else "-"
                      for key in LIMITS),
             f"{overrides[scope]['updated_by']} {overrides[scope]['updated_at']}" if scope in overrides else ""]
            for scope in scopes]
    if not rows:
        return "no quotas: every limit is unlimited"
    return table(["scope", *LIMITS, "overridden by"], rows)[0] + "\n(- : not set in this scope)"


def usage_text(body: dict[str, Any]) -> str:
    """``GET /admin/usage`` as text: GPU-hours today and this week per user and group, then per day."""
    today, week = body.get("today_gpu_hours") or {}, body.get("week_gpu_hours") or {}
    rows = [[kind[:-1], name, format_gpu_hours(today.get(kind, {}).get(name, 0.0), 2), format_gpu_hours(hours, 2)]
            for kind in ("users", "groups") for name, hours in sorted((week.get(kind) or {}).items())]
    daily = body.get("daily_gpu_hours") or {}
    days = sorted({day for per_day in daily.values() for day in per_day})
    lines = [f"GPU-hours, days and weeks in {body.get('timezone', 'UTC')}",
             table(["user or group", "name", "today", "this week"], rows)[0] if rows else "no use this week"]
    if days:
        lines += ["", table(["user", *days], [[user, *(format_gpu_hours(per_day.get(day, 0.0), 2) for day in days)]
                                              for user, per_day in sorted(daily.items())])[0]]
    return "\n".join(lines)


def _value(text: str) -> Any:
    if text.lower() in ("none", "null", "unlimited"):
        return None
    try:  # a whole number stays an int, so a refusal echoes the -1 typed, not -1.0
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return text  # human units ("8h", "30m") are read by the service
    # nan and inf are no JSON numbers: sent as typed, the service refuses them in the words of any value
    # out of range, not as a body that is not JSON
    return number if math.isfinite(number) else text


def _limits(pairs: list[str]) -> dict[str, Any]:
    limits = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in LIMITS:
            raise GPUPoolError(Reason.bad_request, f"cannot read {pair!r}: write LIMIT=VALUE with LIMIT one of "
                               f"{', '.join(LIMITS)}")
        if key in limits:
            raise GPUPoolError(Reason.bad_request, f"{key} is given twice ({limits[key]!r} and {value!r}): give each "
                               "limit once")
        limits[key] = _value(value)
    return limits


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gpupool quota``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="gpupool quota", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("action", nargs="?", default="show", choices=("show", "list", "set", "unset", "usage"))
    parser.add_argument("scope", nargs="?", help="'*', 'group:NAME' or 'user:NAME' (set, unset)")
    parser.add_argument("limits", nargs="*", help="LIMIT=VALUE (set)")
    parser.add_argument("--days", type=int, default=7, help="days of daily usage (usage; default 7)")
    parser.add_argument("--json", action="store_true", help="print the service's JSON (show, list, usage)")
    add_client_arguments(parser)
    args = parser.parse_args(argv)
    if args.action in ("set", "unset") and not args.scope:
        parser.error(f"'{args.action}' needs a SCOPE ('*', 'group:NAME' or 'user:NAME')")
    if args.action == "set" and not args.limits:
        parser.error("'set' needs at least one LIMIT=VALUE")
    takes = {"set": 2, "unset": 1}.get(args.action, 0)  # show, list and usage: no SCOPE (show is your own quota)
    unexpected = ([args.scope] if args.scope else [])[takes:] + (args.limits if takes < 2 else [])
    if unexpected:  # never passed over in silence, as argparse does with an unknown option
        mine = ("; 'show' is your own quota: an admin sees each scope's limits with 'gpupool quota list' and each "
                "user's use with 'gpupool quota usage'") if args.action == "show" else ""
        parser.error(f"'{args.action}' takes {('no arguments', 'a SCOPE only', '')[takes]}: unrecognized arguments: "
                     f"{' '.join(unexpected)}{mine}")
    if not 1 <= args.days <= MAX_USAGE_DAYS:  # whatever the action: a bad option is never passed over in silence
        parser.error(f"--days must be a whole number from 1 to {MAX_USAGE_DAYS}, got {args.days}")
    client = client_from_arguments(parser, args)
    if args.action == "show":
        body = client.quota()
        print(json.dumps(body, indent=2, sort_keys=True) if args.json else quota_text(body))
    elif args.action == "list":
        body = client.admin_quotas()
        print(json.dumps(body, indent=2, sort_keys=True) if args.json else quotas_text(body))
    elif args.action == "set":
        reply = client.set_quota(args.scope, _limits(args.limits))
        print(f"{reply['scope']}: " + ", ".join(f"{k} {limit_words(k, v)}" for k, v in reply["limits"].items()))
    elif args.action == "unset":
        client.clear_quota(args.scope)
        print(f"{args.scope}: override removed; the configured quota applies")
    else:
        body = client.admin_usage(args.days)
        print(json.dumps(body, indent=2, sort_keys=True) if args.json else usage_text(body))
    return 0
