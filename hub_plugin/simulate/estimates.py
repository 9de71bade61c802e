"""A pure rule of the simulator's own: the dedicated baseline's peak.

No clock, no I/O: literal inputs, literal outputs (``tests/rules/test_simulator.py``
tables it). Class order, pressure parks, preemption and the ETA are the
service's rules (:mod:`gpupool.hub_plugin.rules`), which the replay calls itself.
"""

from __future__ import annotations

from typing import Iterable


def peak_concurrent(intervals: Iterable[tuple[float, float, float]]) -> float:
    """The most of ``(start, end, amount)`` intervals that overlap at once
    (an interval ends before one that starts at the same time)."""
    points = sorted([(s, 1, a) for s, e, a in intervals if e > s] + [(e, 0, -a) for s, e, a in intervals if e > s])
    level = peak = 0.0
    for _, _, change in points:
        level += change
        peak = max(peak, level)
    return peak
