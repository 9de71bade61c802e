"""Which node pressure clears for a waiting whole-GPU request (:func:`.priority.plan`).

Counting capacity in GPUs pool-wide frees a GPU here and one there, which an
ask for several whole GPUs on one node cannot use. Given each node's whole
free GPUs, :func:`clear` picks one node where what is free plus what may be
taken (idle leases, and running opted-in ones when preempting) covers the
ask, preferring the node that costs least: no person's idle notebook parked,
then the fewest GPUs of running work stopped. Pure: leases in, leases out.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from .scheduler import idle_counts

EPSILON = 1e-9


def clear(count: int, leases: Sequence, free_gpus: Mapping[str, float], preempting: bool,
          yields, rank_of) -> tuple[str, list] | None:
    """``(node, the leases to take there)`` (``priority.Held``) so that ``count``
    whole GPUs are free on that node, or None where no node can be cleared so. ``leases``:
    the ones pressure may take (not guaranteed, not already taken), each with
    its ``node``; ``free_gpus``: node -> whole GPUs free now (nodes absent:
    none); ``preempting``: running opted-in leases may be stopped;
    ``rank_of(lease_class)``: class rank, ``yields(lease_class)``: whether it is backfill
    (:attr:`gpupool.leaseclasses.LeaseClass.yields`). On the chosen node the later
    ranks (batch) go before interactive, idle before running; the node that parks
    the fewest idle leases of the classes that do not yield (people's notebooks) is chosen."""
    by_node: dict[str, list] = {}
    for lease in leases:
        takeable = (not lease.busy and lease.idle_since is not None) or (preempting and lease.busy
                                                                          and lease.preemptible)
        if lease.node is not None and takeable:
            by_node.setdefault(lease.node, []).append(lease)
    best, best_cost = None, None
    for node in set(by_node) | set(free_gpus):
        room = free_gpus.get(node, 0.0)
        chosen = []
        for lease in sorted(by_node.get(node, ()), key=lambda item: (-rank_of(item.lease_class), item.busy,
                                                                    item.lease_id)):
            if room >= count - EPSILON:
                break
            chosen.append(lease)
            room += lease.gpus
        if room < count - EPSILON:
            continue
        cost = (sum(1 for item in chosen if not yields(item.lease_class) and not item.busy),
                sum(item.gpus for item in chosen if item.busy), node)
        if best_cost is None or cost < best_cost:
            best, best_cost = (node, chosen), cost
    return best


def whole_free(gpus: Iterable) -> dict[str, float]:
    """Node -> how many of its GPUs are wholly free (``scheduler.GPUState``: nothing held,
    healthy), for the nodes new leases may go to (up, not degraded) with any; what
    :func:`clear` and ``priority.plan(..., free_gpus)`` reads."""
    free: dict[str, float] = {}
    for node, count in idle_counts(gpu for gpu in gpus if gpu.node_up and not gpu.node_degraded).items():
        if count:
            free[node] = float(count)
    return free
