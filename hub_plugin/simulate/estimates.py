"""Pure rules of the simulator's own: a capacity-based ETA and the
dedicated baseline.

No clock, no I/O: literal inputs, literal outputs (``tests/test_simulator.py``
tables them). Class order, pressure parks and preemption are the service's
rules (:mod:`gpupool.hub_plugin.rules.priority`), which the replay calls itself.

- **ETA** (:func:`eta`): when a waiting request fits, given the times at
  which held capacity frees (idle deadlines, parks due under pressure,
  running leases' expected ends learnt from history) and the requests ahead
  of it, placed on the node (first fit) as whole GPUs or a slice; the
  service's :mod:`gpupool.hub_plugin.rules.eta` counts GPUs only.
"""

from __future__ import annotations

from typing import Iterable, Sequence

FULL = 1000  # milli in one GPU


def eta(milli: int, count: int, ahead: Sequence[tuple[int, int]], free: Sequence[int], node_of: Sequence[int],
        frees: Iterable[tuple[float, Sequence[int], int]], now: float) -> float | None:
    """Seconds from ``now`` until a request (``count`` whole GPUs, or a
    ``milli`` slice when ``count == 1``) fits, if ``ahead`` (``(milli,
    count)`` requests queued before it, in order) are placed first and
    capacity frees as ``frees`` says: ``(when, gpu indexes, milli per GPU)``
    per lease, ``when`` in the same clock as ``now``. ``free[g]`` is GPU
    g's free milli now. None when what is known to free never makes room.
    A request takes the first GPU (node) that fits, as an estimate of
    placement."""
    room = list(free)
    queue = list(ahead) + [(milli, count)]
    events = sorted(frees, key=lambda event: event[0])
    at = now
    i = 0
    while True:
        while queue and _take(room, node_of, *queue[0]):
            queue.pop(0)
        if not queue:
            return max(0.0, at - now)
        if i >= len(events):
            return None
        at, gpus, per_gpu = events[i]
        i += 1
        for g in gpus:
            room[g] += per_gpu


def _take(room: list[int], node_of: Sequence[int], milli: int, count: int) -> bool:
    """Take the first fit for one request in ``room`` (changed in place)."""
    if count == 1 and milli < FULL:
        for g, f in enumerate(room):
            if f >= milli:
                room[g] -= milli
                return True
        return False
    idle: dict[int, list[int]] = {}
    for g, f in enumerate(room):
        if f >= FULL:
            idle.setdefault(node_of[g], []).append(g)
            if len(idle[node_of[g]]) == count:
                for h in idle[node_of[g]]:
                    room[h] -= FULL
                return True
    return False


def peak_concurrent(intervals: Iterable[tuple[float, float, float]]) -> float:
    """The most of ``(start, end, amount)`` intervals that overlap at once
    (an interval ends before one that starts at the same time)."""
    points = sorted([(s, 1, a) for s, e, a in intervals if e > s] + [(e, 0, -a) for s, e, a in intervals if e > s])
    level = peak = 0.0
    for _, _, change in points:
        level += change
        peak = max(peak, level)
    return peak
