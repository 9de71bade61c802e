"""When a queued request is likely placed: the one ETA rule of the service
and the simulator. Pure: the pool's free room, what holds capacity, what
waits, typical cell lengths and ``now`` in, seconds out.

Each lease that holds capacity is expected to end at a moment
(:func:`expected_end`: an idle one at its idle deadline, a busy one after a
typical cell of its class, sooner where a waiting request presses on it);
the requests are then placed in queue order as capacity frees in time order
(:func:`eta_seconds`). The rule in full: docs/api.md, "Classes and pressure"
(ETA). It is an estimate: GPU memory, models, environments and the fairness
of who goes first among equals are the scheduler's business, not modelled.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Collection, Hashable, Iterable, Mapping, Sequence

from gpupool.leaseclasses import lease_class

from .priority import EPSILON, NO_PRESSURE, Held, Plan, class_rank


@dataclass(frozen=True)
class Room:
    """The pool as the ETA places requests on it: each GPU's free fraction
    now (0 where nothing may be placed: a lost or degraded node, an unhealthy
    GPU), its node, and its id (what a :class:`.priority.Held`'s ``gpu_ids``
    name: the service's UUIDs)."""

    free: tuple[float, ...]
    node_of: tuple[Hashable, ...]
    ids: tuple[Hashable, ...] = ()


def typical_lengths(ran: Iterable[tuple[str, float]]) -> dict[str, float]:
    """``{class: median seconds}`` from ``(class, seconds)`` of recently ended cells."""
    by_class: dict[str, list[float]] = {}
    for lease_class, seconds in ran:
        by_class.setdefault(lease_class, []).append(seconds)
    return {lease_class: statistics.median(lengths) for lease_class, lengths in by_class.items()}


def expected_end(lease: Held, typical: Mapping[str, float], now: datetime, grace: float | None = None,
                 plan: Plan = NO_PRESSURE) -> datetime | None:
    """When ``lease`` is expected to free its capacity (module docstring), pressed with
    ``grace`` seconds (None: not pressed) and parked or preempted as ``plan`` says; None
    when nothing is known (a busy lease of a class without history) or it never lets go."""
    if not lease.busy:
        deadline = plan.deadline(lease)
        if grace is not None:
            early = max(now, lease.idle_since or now) + timedelta(seconds=grace)
            deadline = min(deadline, early) if deadline is not None else early
        return None if deadline is None else max(deadline, now)
    preempt_at = plan.preempt_at(lease)
    if grace is not None and preempt_at is not None:  # parked mid-cell then, its share freed
        return max(preempt_at, now)
    length = typical.get(lease.lease_class)
    after = lease.idle_timeout if grace is None or lease.idle_timeout is None else min(lease.idle_timeout, grace)
    after = grace if after is None else after
    if length is None or after is None:
        return None
    end = (lease.cell_started or now) + timedelta(seconds=length)
    end = end if end > now else now + timedelta(seconds=length / 2)
    return end + timedelta(seconds=after)


def eta_seconds(asks: Sequence[tuple], room: Room, holding: Sequence[Held], typical: Mapping[str, float],
                now: datetime, grace: float | None = None, plan: Plan = NO_PRESSURE,
                guaranteed: Collection[str] = (), ids: Sequence[str | None] = ()) -> list[float | None]:
    """For each queued request, in queue order (``(fraction, count, class)``: a slice
    of one GPU when ``count`` is 1, else ``count`` whole GPUs on one node; a fourth item,
    the indexes in ``room`` of the only GPUs it may take, for a parked lease's resume),
    seconds until it is placed after every request before it, as the active leases
    ``holding`` free their GPUs (those of ``room``); None once what is known to free
    does not make room. ``grace``: the pressure grace (None: pressure parks nothing
    early); ``plan``: the pressure plan, whose early parks and preemptions come first;
    ``guaranteed``: ids of the leases within their owner's guaranteed share, which no
    waiter presses on. ``ids``: each ask's lease id (None or absent: not known); a node
    the plan cleared for a request (:attr:`.priority.Plan.cleared`) is that request's
    until it is placed here: no other ask takes room there (:meth:`.priority.Plan.cleared_for_others`),
    but a resume its own GPUs. Rounded to a tenth of a second."""
    index = {gpu: i for i, gpu in enumerate(room.ids)}
    free = list(room.free)
    released = [False] * len(holding)
    timelines: dict[int, deque] = {}  # by the asking class's rank: (expected end, lease index), soonest first
    answers: list[float | None] = []
    moment = now
    cleared = dict(plan.cleared)  # node -> the request it is held for, until that one is placed here
    for k, (fraction, count, lease_class, *only) in enumerate(asks):
        me = ids[k] if k < len(ids) else None
        allowed = _off_held(only[0] if only else None, room.node_of, cleared, me)
        rank = class_rank(lease_class)
        if rank not in timelines:
            ends = ((expected_end(lease, typical, now, grace if _presses(lease_class, lease, guaranteed) else None,
                                  plan), i)
                    for i, lease in enumerate(holding))
            timelines[rank] = deque(sorted((end, i) for end, i in ends if end is not None))
        line = timelines[rank]
        while not _take(free, room.node_of, fraction, count, allowed):
            while line and released[line[0][1]]:
                line.popleft()
            if not line:
                return answers + [None] * (len(asks) - len(answers))
            end, i = line.popleft()
            released[i] = True
            moment = max(moment, end)
            lease = holding[i]
            for gpu in lease.gpu_ids:
                if gpu in index:
                    free[index[gpu]] += lease.gpus / len(lease.gpu_ids)
        answers.append(round(max(0.0, (moment - now).total_seconds()), 1))
        if me is not None:
            cleared = {node: owner for node, owner in cleared.items() if owner != me}
    return answers


def _off_held(allowed: Sequence[int] | None, node_of: Sequence[Hashable], cleared: Mapping[Hashable, str],
              me: str | None) -> Sequence[int] | None:
    """The GPU indexes an ask may take (``allowed``; None: any) less those of nodes ``cleared`` for
    another request than ``me``; a resume's own GPUs (the first of its ``allowed``) stay: it takes
    back its own room (:func:`.queue.drain`)."""
    held = {node for node, owner in cleared.items() if owner != me}
    if not held:
        return allowed
    own = node_of[allowed[0]] if allowed else None
    order = range(len(node_of)) if allowed is None else allowed
    return [g for g in order if node_of[g] not in held or node_of[g] == own]


def _presses(asking: str | None, lease: Held, guaranteed: Collection[str]) -> bool:
    """Whether a waiting request of class ``asking`` presses on ``lease`` (module docstring): a class
    that presses (:attr:`gpupool.leaseclasses.LeaseClass.presses`) on the leases of its rank and after,
    outside their owner's guaranteed share."""
    return (lease.lease_id not in guaranteed and lease_class(asking).presses
            and class_rank(asking) <= class_rank(lease.lease_class))


def _take(free: list[float], node_of: Sequence[Hashable], fraction: float, count: int,
          allowed: Sequence[int] | None = None) -> bool:
    """Take the first fit for one request from ``free`` (changed in place), of the GPUs
    ``allowed`` only (indexes, in the order tried; None: any); False when none fits."""
    order = range(len(free)) if allowed is None else allowed
    if count == 1 and fraction < 1.0 - EPSILON:
        for g in order:
            room = free[g]
            if room + EPSILON >= fraction:
                free[g] -= fraction
                return True
        return False
    whole: dict[Hashable, list[int]] = {}
    for g in order:
        room = free[g]
        if room + EPSILON >= 1.0:
            on_node = whole.setdefault(node_of[g], [])
            on_node.append(g)
            if len(on_node) == count:
                for h in on_node:
                    free[h] -= 1.0
                return True
    return False
