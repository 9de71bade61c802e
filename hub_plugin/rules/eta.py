"""When a queued request is likely placed. Pure: what holds capacity, what
waits ahead, typical lease lengths and ``now`` in, seconds out.

Capacity frees when a lease ends. For each lease that holds capacity the
rule takes the moment it is expected to end (:func:`expected_end`):

- idle (no cell running): its idle deadline, or the earlier one pressure set
  (:mod:`.priority`), since it is parked then unless a cell starts;
- busy, batch: when it started plus the typical length of recent batch leases;
- busy, interactive: when it started plus the typical length of recent
  interactive leases;
- a moment already past (it ran longer than usual): ``now`` plus half that
  typical length, a guess that moves as time passes.

The request at place ``p`` is placed once the GPUs freed, in that order,
cover what the ``p`` requests up to and including it ask for
(:func:`eta_seconds`). Counted in GPUs (fraction x count), as the pressure
rule; where on which node is the scheduler's business.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Iterable, Mapping, Sequence

from .priority import EPSILON


@dataclass(frozen=True)
class Holding:
    """A lease holding capacity: GPUs (fraction x count), class, whether a
    cell runs, when it started (None: still starting) and when it is parked
    if it stays idle (None while busy)."""

    gpus: float
    lease_class: str
    busy: bool
    started_at: datetime | None
    idle_deadline: datetime | None = None


def typical_lengths(ended: Iterable[tuple[str, float]]) -> dict[str, float]:
    """``{class: median seconds}`` from ``(class, seconds held)`` of recently ended leases."""
    by_class: dict[str, list[float]] = {}
    for lease_class, seconds in ended:
        by_class.setdefault(lease_class, []).append(seconds)
    return {lease_class: statistics.median(lengths) for lease_class, lengths in by_class.items()}


def expected_end(lease: Holding, typical: Mapping[str, float], now: datetime) -> datetime | None:
    """When ``lease`` is expected to free its capacity (module docstring);
    None when nothing is known (a busy lease of a class without history)."""
    if not lease.busy and lease.idle_deadline is not None:
        return max(lease.idle_deadline, now)
    length = typical.get(lease.lease_class)
    if length is None:
        return None
    end = (lease.started_at or now) + timedelta(seconds=length)
    return end if end > now else now + timedelta(seconds=length / 2)


def eta_seconds(ahead_gpus: Sequence[float], holding: Sequence[Holding], typical: Mapping[str, float],
                now: datetime) -> list[float | None]:
    """For each queued request, in queue order (``ahead_gpus[i]`` is what the
    request at place ``i + 1`` asks for), seconds until enough has freed for
    it and every request before it; None once what is known to free runs
    out. Rounded to a tenth of a second."""
    timed = ((expected_end(lease, typical, now), lease.gpus) for lease in holding)
    gpus_at = sorted(((end, gpus) for end, gpus in timed if end is not None), key=lambda pair: pair[0])
    answers: list[float | None] = []
    freed, upto, need = 0.0, 0, 0.0
    for asked in ahead_gpus:
        need += asked
        while freed + EPSILON < need and upto < len(gpus_at):
            freed += gpus_at[upto][1]
            upto += 1
        if freed + EPSILON < need:
            answers.append(None)
            continue
        moment = gpus_at[upto - 1][0] if upto else now
        answers.append(round(max(0.0, (moment - now).total_seconds()), 1))
    return answers
