"""When a queued request is likely placed: the one ETA rule of the service
and the simulator. Pure: the pool's free room, what holds capacity, what
waits, typical cell lengths and ``now`` in, seconds out.

Capacity frees when a lease ends. For each lease that holds capacity the
rule takes the moment it is expected to end (:func:`expected_end`):

- idle (no cell running): its idle deadline, or the earlier one pressure set
  (:mod:`.priority`), since it is parked then unless a cell starts;
- busy: when its running cell started plus the typical length of recent
  cells of its class (a cell already past it: ``now`` plus half that length,
  a guess that moves as time passes), then ``after_cell`` seconds more (the
  idle time before it is parked: the idle timeout, or the pressure grace
  while anyone waits; 0 for a job that ends with its cell).

Then the requests are placed in queue order, each once the ones before it
are, as capacity frees in time order (:func:`eta_seconds`): a slice on the
first GPU with room, whole GPUs on the first node with that many wholly
free. It is an estimate: GPU memory, models, environments and the fairness
of who goes first among equals are the scheduler's business, not modelled.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Hashable, Iterable, Mapping, Sequence

from .priority import EPSILON


@dataclass(frozen=True)
class Room:
    """The pool as the ETA places requests on it: each GPU's free fraction
    now (0 where nothing may be placed: a lost or degraded node, an unhealthy
    GPU) and its node."""

    free: tuple[float, ...]
    node_of: tuple[Hashable, ...]


@dataclass(frozen=True)
class Holding:
    """A lease holding capacity: the indexes of its GPUs in the :class:`Room`
    and the ``fraction`` of each it holds; its class; whether a cell runs and
    since when (None: unknown, e.g. an agent that does not say); when it is
    parked if it stays idle (None while busy); ``after_cell`` seconds from a
    cell's end until it lets go (module docstring; None: it does not, with no
    idle timeout and nothing to press it)."""

    gpus: tuple[int, ...]
    fraction: float
    lease_class: str
    busy: bool
    cell_started: datetime | None
    idle_deadline: datetime | None = None
    after_cell: float | None = 0.0


def typical_lengths(ran: Iterable[tuple[str, float]]) -> dict[str, float]:
    """``{class: median seconds}`` from ``(class, seconds)`` of recently ended cells."""
    by_class: dict[str, list[float]] = {}
    for lease_class, seconds in ran:
        by_class.setdefault(lease_class, []).append(seconds)
    return {lease_class: statistics.median(lengths) for lease_class, lengths in by_class.items()}


def expected_end(lease: Holding, typical: Mapping[str, float], now: datetime) -> datetime | None:
    """When ``lease`` is expected to free its capacity (module docstring);
    None when nothing is known (a busy lease of a class without history)."""
    if not lease.busy and lease.idle_deadline is not None:
        return max(lease.idle_deadline, now)
    length = typical.get(lease.lease_class)
    if length is None or lease.after_cell is None:
        return None
    end = (lease.cell_started or now) + timedelta(seconds=length)
    end = end if end > now else now + timedelta(seconds=length / 2)
    return end + timedelta(seconds=lease.after_cell)


def eta_seconds(asks: Sequence[tuple[float, int]], room: Room, holding: Sequence[Holding],
                typical: Mapping[str, float], now: datetime) -> list[float | None]:
    """For each queued request, in queue order (``(fraction, count)``: a slice
    of one GPU when ``count`` is 1, else ``count`` whole GPUs on one node),
    seconds until it is placed after every request before it; None once what
    is known to free does not make room. Rounded to a tenth of a second."""
    free = list(room.free)
    ends = [(end, lease) for lease in holding if (end := expected_end(lease, typical, now)) is not None]
    ends.sort(key=lambda pair: pair[0])
    answers: list[float | None] = []
    moment, upto = now, 0
    for fraction, count in asks:
        while not _take(free, room.node_of, fraction, count):
            if upto == len(ends):
                return answers + [None] * (len(asks) - len(answers))
            moment, lease = ends[upto]
            upto += 1
            for g in lease.gpus:
                free[g] += lease.fraction
        answers.append(round(max(0.0, (moment - now).total_seconds()), 1))
    return answers


def _take(free: list[float], node_of: Sequence[Hashable], fraction: float, count: int) -> bool:
    """Take the first fit for one request from ``free`` (changed in place); False when none fits."""
    if count == 1 and fraction < 1.0 - EPSILON:
        for g, room in enumerate(free):
            if room + EPSILON >= fraction:
                free[g] -= fraction
                return True
        return False
    whole: dict[Hashable, list[int]] = {}
    for g, room in enumerate(free):
        if room + EPSILON >= 1.0:
            on_node = whole.setdefault(node_of[g], [])
            on_node.append(g)
            if len(on_node) == count:
                for h in on_node:
                    free[h] -= 1.0
                return True
    return False
