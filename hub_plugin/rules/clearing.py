"""Which node pressure clears for a waiting whole-GPU request (:func:`.priority.plan`).

Counting capacity in GPUs pool-wide frees a GPU here and one there, which an
ask for several whole GPUs on one node cannot use. Given each node's whole
free GPUs, :func:`clear` picks one node where what is free plus what may be
taken (idle leases, and running opted-in ones when preempting) covers the
ask, preferring the node that costs least: no person's idle notebook parked,
then the fewest GPUs of running work stopped. Pure: leases in, leases out.

What taking leases frees is counted in whole GPUs, GPU by GPU (:func:`units`):
a GPU comes free when every lease on it goes, so three batch slices of 0.3 on
three GPUs free three GPUs, not 0.9, and a slice next to a lease that stays
frees none. Counted as fractions instead, a node packed with batch slices
never added up to the ask, no node could be cleared, and the request pressed in
GPUs pool-wide: each sweep preempted jobs whose own resumes took their room
back (78,205 preemptions in 300 replayed hours, one job 2,824 times;
bench/backlog_churn.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Hashable, Iterable, Mapping, Sequence

from .scheduler import idle_counts

EPSILON = 1e-9


def clear(count: int, leases: Sequence, free_gpus: Mapping[str, float], preempting: bool,
          yields, rank_of, staying: Iterable = (), kept: str | None = None) -> tuple[str, list] | None:
    """``(node, the leases to take there)`` (``priority.Held``) so that ``count``
    whole GPUs are free on that node, or None where no node can be cleared so:
    :func:`choose` among :func:`clearable` (the arguments are theirs)."""
    return choose(count, clearable(leases, free_gpus, preempting, yields, rank_of, staying), yields, kept)


@dataclass(frozen=True)
class Clearable:
    """One node as :func:`choose` reads it: ``free`` whole GPUs (with those on their way back),
    and the groups of leases pressure may take there, cheapest first, each with the whole
    GPUs it frees (``(GPUs, leases)``); ``most``: what all of them and ``free`` come to."""

    free: float
    groups: tuple[tuple[float, tuple], ...]
    most: float


def clearable(leases: Sequence, free_gpus: Mapping[str, float], preempting: bool, yields, rank_of,
              staying: Iterable = ()) -> dict[str, Clearable]:
    """Node -> :class:`Clearable`, for every node with free GPUs or leases pressure may take.
    ``leases``: the ones pressure may take (not guaranteed, not already taken), each with its
    ``node`` and ``gpu_ids``; those it cannot take (a running cell, not preemptible or not
    ``preempting``) stay, as ``staying`` do (guaranteed, or of a class the request does not
    press on): a GPU one of them holds comes free for nobody, so its group is left out;
    ``free_gpus``: node -> whole GPUs free now (nodes absent: none); ``rank_of(lease_class)``:
    class rank, ``yields(lease_class)``: whether it is backfill
    (:attr:`gpupool.leaseclasses.LeaseClass.yields`). The groups go cheapest first
    (:func:`_unit_cost`): those with no person's idle notebook, then idle before running, batch
    before interactive. One pass per plan: the requests of a sweep choose from the same."""
    takeable: dict[str, list] = {}
    blocked: dict[str, set] = {}
    for lease in leases:
        if lease.node is None:
            continue
        if (not lease.busy and lease.idle_since is not None) or (preempting and lease.busy and lease.preemptible):
            takeable.setdefault(lease.node, []).append(lease)
        else:
            blocked.setdefault(lease.node, set()).update(lease.gpu_ids)
    for lease in staying:
        if lease.node is not None:
            blocked.setdefault(lease.node, set()).update(lease.gpu_ids)
    nodes = {}
    for node in set(takeable) | set(free_gpus):
        free, stays = free_gpus.get(node, 0.0), blocked.get(node, set())
        groups = sorted(((len(gpus) if gpus else sum(lease.gpus for lease in unit), unit)
                         for gpus, unit in units(takeable.get(node, ())) if not gpus & stays),
                        key=lambda group: _unit_cost(group, yields, rank_of))
        nodes[node] = Clearable(free, tuple((worth, tuple(unit)) for worth, unit in groups),
                                free + sum(worth for worth, _ in groups))
    return nodes


def choose(count: int, nodes: Mapping[str, Clearable], yields, kept: str | None = None,
           others: Collection[str] = ()) -> tuple[str, list] | None:
    """``(node, the leases to take there)`` so that ``count`` whole GPUs are free on one of
    ``nodes`` (:func:`clearable`; not one of ``others``: kept for other requests), or None
    where none can be cleared so. On a node its cheapest groups go first; of the nodes, the
    one that parks the fewest idle leases of the classes that do not yield (people's
    notebooks), then the one stopping the fewest running GPUs, then by name. ``kept``: the
    node the last plan cleared for this request: chosen again while it can still be cleared,
    whatever the others cost now, so that its leases, already parked or told, are not let
    go for another node's (each flip preempted new jobs while the first node's, no longer
    held, resumed there, to be preempted again when it flipped back)."""
    best, best_cost = None, None
    for node, there in nodes.items():
        if there.most < count - EPSILON or node in others:
            continue
        room, chosen = there.free, []
        for worth, unit in there.groups:
            if room >= count - EPSILON:
                break
            chosen += unit
            room += worth
        if node == kept:
            return node, chosen
        cost = (sum(1 for item in chosen if not yields(item.lease_class) and not item.busy),
                sum(item.gpus for item in chosen if item.busy), node)
        if best_cost is None or cost < best_cost:
            best, best_cost = (node, chosen), cost
    return best


def units(leases: Iterable) -> list[tuple[frozenset[Hashable], list]]:
    """``leases`` (of one node) grouped by the GPUs they share: ``(GPU ids, leases)``, each
    group freeing its GPUs whole once all its leases go (slices of one GPU together, a
    lease of several GPUs with whatever shares them). A lease without ``gpu_ids`` (not
    known) is a group of its own, worth its ``gpus``: an empty set of GPU ids."""
    groups: list[tuple[frozenset, list]] = []
    for lease in leases:
        gpus, members = frozenset(lease.gpu_ids), [lease]
        if gpus:
            for other in [group for group in groups if group[0] & gpus]:
                groups.remove(other)
                gpus, members = gpus | other[0], other[1] + members
        groups.append((gpus, members))
    return groups


def _unit_cost(group: tuple[float, list], yields, rank_of) -> tuple:
    """The order a node's GPU groups (``(whole GPUs freed, leases)``) are taken in: fewest
    people's idle notebooks, then the fewest running GPUs stopped per GPU freed, then the latest
    class (batch), then by lease id."""
    worth, leases = group
    worth = worth or 1.0
    return (sum(1 for lease in leases if not yields(lease.lease_class) and not lease.busy),
            sum(lease.gpus for lease in leases if lease.busy) / worth,
            -min(rank_of(lease.lease_class) for lease in leases), min(lease.lease_id for lease in leases))


def whole_free(gpus: Iterable, leaving: Mapping[str, float] | None = None) -> dict[str, float]:
    """Node -> how many of its GPUs are wholly free (``scheduler.GPUState``: nothing held,
    healthy), for the nodes new leases may go to (up, not degraded) with any; what
    :func:`clear` and ``priority.plan(..., free_gpus)`` reads. ``leaving``: GPU uuid -> the
    fraction that leases being parked or released hold there: a GPU they alone hold counts
    as free, being on its way back. Counted whole, GPU by GPU: three slices being parked
    on three GPUs are three GPUs, so the node being cleared stays the one cleared while
    its leases are parked (summed as 2.8 GPUs, a node with five free GPUs fell short of an
    8-GPU ask for that sweep, the plan cleared another node and the first one's jobs
    resumed where they were, to be preempted again at the next sweep)."""
    usable = [gpu for gpu in gpus if gpu.node_up and not gpu.node_degraded]
    leaving = leaving or {}
    back = [gpu for gpu in usable if gpu.healthy and not gpu.is_idle and gpu.uuid in leaving
            and gpu.allocated_fraction - leaving[gpu.uuid] <= EPSILON]
    free: dict[str, float] = {}
    for gpu in back:
        free[gpu.node] = free.get(gpu.node, 0.0) + 1.0
    for node, count in idle_counts(usable).items():
        if count:
            free[node] = free.get(node, 0.0) + count
    return free
