"""Pure rules the class-aware replays use: class order, pressure parks,
preemption victims, a capacity-based ETA, and the dedicated baseline.

No clock, no I/O: literal inputs, literal outputs (``tests/test_simulator.py``
tables them). The service has no request classes yet; these are the rules
the simulator models for issue 16, kept here (not in the service's modules)
until the service adopts them.

- **Class order** (:func:`class_order`): ``interactive`` requests go before
  ``batch`` ones; within a class the caller's order (oldest first) is kept.
  Batch is lower priority, not automatically preemptible.
- **Pressure parks** (:func:`pressure_parks`): while requests wait, leases
  whose worker has been idle for at least ``grace`` seconds are parked early,
  over-quota first, then batch, then the longest idle, until what they free
  covers what is waited for. A lease whose cell runs is never picked.
- **Preemption** (:func:`preemption_plan`, :func:`victims_on`): only
  leases that opted in (preemptible) may be stopped; the GPU (or the GPUs of
  one node) whose preemptible leases lose the least work, and on a GPU the
  fewest leases, least work lost first.
- **ETA** (:func:`eta`): when a waiting request fits, given the times at
  which held capacity frees (idle deadlines, parks due under pressure,
  running leases' expected ends learnt from history) and the requests ahead
  of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, TypeVar

FULL = 1000  # milli in one GPU
INTERACTIVE, BATCH = "interactive", "batch"
#: Lower rank goes first.
CLASS_RANK = {INTERACTIVE: 0, BATCH: 1}
#: Seconds an idle lease is kept while others wait (issue 16's "short grace"), default.
PRESSURE_GRACE_S = 120.0

T = TypeVar("T")


def class_order(items: Iterable[T], klass: Callable[[T], str]) -> list[T]:
    """``items`` with every interactive one before every batch one; the
    order within a class is kept (a stable sort). Raises KeyError for a
    class other than ``interactive`` or ``batch``."""
    return sorted(items, key=lambda item: CLASS_RANK[klass(item)])


@dataclass(frozen=True)
class IdleLease:
    """What :func:`pressure_parks` reads of a lease: ``idle_for`` seconds
    since its worker went idle (None: a cell runs), the GPUs it would free
    (fraction x count), its class and whether its owner is over quota."""

    id: str
    idle_for: float | None
    gpus: float
    klass: str = INTERACTIVE
    over_quota: bool = False


@dataclass(frozen=True)
class Park:
    """Park ``lease_id`` early; ``reason`` in the user's words."""

    lease_id: str
    reason: str


def pressure_parks(leases: Iterable[IdleLease], waiting: int, wanted_gpus: float,
                   grace: float = PRESSURE_GRACE_S) -> list[Park]:
    """Leases to park now because ``waiting`` requests (wanting
    ``wanted_gpus`` GPUs in all) cannot be placed. Only leases idle for at
    least ``grace`` seconds; over-quota first, then batch, then the longest
    idle; stops once the parked leases free ``wanted_gpus``. Nothing when
    nobody waits."""
    if waiting <= 0 or wanted_gpus <= 0:
        return []
    due = [lease for lease in leases if lease.idle_for is not None and lease.idle_for >= grace]
    due.sort(key=lambda lease: (not lease.over_quota, -CLASS_RANK[lease.klass], -lease.idle_for, lease.id))
    people = "1 person is" if waiting == 1 else f"{waiting} people are"
    parks, freed = [], 0.0
    for lease in due:
        if freed >= wanted_gpus:
            break
        parks.append(Park(lease.id, f"parked early: {people} waiting for a GPU"))
        freed += lease.gpus
    return parks


def preemption_plan(milli: int, count: int, free: Sequence[int], pinned: Sequence[int], cost: Sequence[float],
                    node_of: Sequence[int]) -> list[int] | None:
    """The GPUs to clear of preemptible leases so one request fits: ``count``
    whole GPUs on one node, or one ``milli`` slice when ``count == 1``.
    Per GPU g: ``free[g]`` free milli, ``pinned[g]`` milli held by leases
    that may not be stopped, ``cost[g]`` the work (GPU-seconds) its
    preemptible leases would lose, ``node_of[g]`` its node. Returns the
    cheapest GPUs (one for a slice, ``count`` on one node for whole GPUs,
    idle ones first and free), [] when the request fits already, None when
    stopping every preemptible lease would not make room."""
    whole = count > 1 or milli >= FULL
    if not whole:
        if any(f >= milli for f in free):
            return []
        fits = [(cost[g], g) for g in range(len(free)) if FULL - pinned[g] >= milli]
        return [min(fits)[1]] if fits else None
    nodes: dict[int, list[tuple[float, int]]] = {}
    for g, node in enumerate(node_of):
        if free[g] >= FULL:
            nodes.setdefault(node, []).append((0.0, g))
        elif pinned[g] == 0:
            nodes.setdefault(node, []).append((cost[g], g))
    best: tuple[float, list[int]] | None = None
    for members in nodes.values():
        if len(members) < count:
            continue
        chosen = sorted(members)[:count]
        total = sum(c for c, _ in chosen)
        if best is None or total < best[0]:
            best = (total, [g for _, g in chosen])
    if best is not None and all(free[g] >= FULL for g in best[1]):
        return []
    return None if best is None else best[1]


def victims_on(gpu_room: int, milli: int, holders: Iterable[tuple[float, int, str]]) -> list[str]:
    """Which of one GPU's preemptible ``holders`` (``(lost work, milli, id)``)
    to stop so that ``milli`` fits next to ``gpu_room`` free: least lost
    work first, as few as needed."""
    chosen = []
    for _, held, lease_id in sorted(holders):
        if gpu_room >= milli:
            break
        gpu_room += held
        chosen.append(lease_id)
    return chosen


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
