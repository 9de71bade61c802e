"""A replay's parked leases, node by node: where each one's worker is, in
which tier, and the node's parked-memory budget (``c.AgentParking.parked_memory``,
:func:`.costs.parked_budget`).

As the agent keeps it: a parked worker's state counts on its node's RAM;
when a park takes the node past its budget, the longest-parked workers are
spilled to its disk, one after the other, until the rest fit; a worker that
alone would not fit spills at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rules.scheduler import Placement


@dataclass(eq=False, slots=True)
class ParkedLease:
    """A parked session's worker: the ``placement`` it held (its node and GPUs),
    its state's ``size`` in bytes, since when (``since``, seconds) and its
    ``tier`` (``memory``: frozen in the node's RAM; ``disk``: spilled)."""

    placement: Placement
    size: int
    since: float
    tier: str = "memory"


class ParkedNodes:
    """Parked workers per node (keyed by session id), each node with ``budget`` bytes of RAM for them."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.leases: dict[int, ParkedLease] = {}
        self.in_memory: dict[str, dict[int, None]] = {}  # node -> sessions in RAM, longest-parked first
        self.held: dict[str, int] = {}  # node -> bytes its parked workers hold in RAM
        self.spills = 0

    def park(self, sid: int, lease: ParkedLease) -> list[int]:
        """Park ``sid``'s worker in its node's RAM; returns the sessions spilled to make it fit."""
        node = lease.placement.node
        self.leases[sid] = lease
        self.in_memory.setdefault(node, {})[sid] = None
        self.held[node] = self.held.get(node, 0) + lease.size
        spilled = []
        while self.held[node] > self.budget:
            spilled.append(self._spill(next(iter(self.in_memory[node]))))
        return spilled

    def _spill(self, sid: int) -> int:
        lease = self.leases[sid]
        lease.tier = "disk"
        del self.in_memory[lease.placement.node][sid]
        self.held[lease.placement.node] -= lease.size
        self.spills += 1
        return sid

    def pop(self, sid: int) -> ParkedLease | None:
        """``sid``'s parked worker, no longer parked (resumed or ended); None if it has none."""
        lease = self.leases.pop(sid, None)
        if lease is not None and lease.tier == "memory":
            del self.in_memory[lease.placement.node][sid]
            self.held[lease.placement.node] -= lease.size
        return lease

    def get(self, sid: int) -> ParkedLease | None:
        return self.leases.get(sid)
