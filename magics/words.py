"""How the ``%gpu`` magics word what they did: the ``gpupool:`` line, a
lease's usage and time held, what a push or pull moved (what a lease holds:
:func:`gpupool.tables.slice_words` and ``host_words``)."""

from __future__ import annotations

import textwrap
from typing import Any

from gpupool.schema import parse_time
from gpupool.transfer import describe


def say(text: str) -> None:
    """One line of the magics' own words: ``gpupool: TEXT`` on stdout."""
    print(f"gpupool: {text}", flush=True)


def dedent(text: str | None) -> str:
    """A docstring for ``%gpu help``: its first line, then the rest dedented."""
    head, _, body = (text or "").partition("\n")
    return head + "\n" + textwrap.dedent(body)


def usage_words(gpu_seconds: float) -> str:
    """``'42.0 GPU-seconds'`` below six minutes, else ``'1.25 GPU-hours'``."""
    return f"{gpu_seconds:.1f} GPU-seconds" if gpu_seconds < 360 else f"{gpu_seconds / 3600:.2f} GPU-hours"


def held_seconds(lease) -> float | None:
    """Seconds from the lease's start to its end, None while either is unknown."""
    start, end = parse_time(lease.started_at), parse_time(lease.ended_at)
    return (end - start).total_seconds() if start and end else None


def transfer_note(verb: str, items: list[dict[str, Any]], errors: dict[str, str]) -> str:
    """``"; VERB 2 variables: x (...), y (...); not moved: z (why)"``, or ``""``."""
    parts = []
    if items:
        count = f"{len(items)} variable{'s' if len(items) != 1 else ''}"
        parts.append(f"{verb} {count}: {describe(items)}")
    if errors:
        parts.append("not moved: " + "; ".join(f"{name} ({why})" for name, why in errors.items()))
    return "; " + "; ".join(parts) if parts else ""
