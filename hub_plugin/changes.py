"""What one write transaction changed, filled by the writers and handed on
at commit (:meth:`.state.PoolState.writing`).

The capacity index re-reads only the GPUs named here, and long polls of the
leases named here wake up. A writer that forgets a change costs a rebuild of
the index (:meth:`.capacity.CapacityIndex.verify` catches it) or a long poll
that answers at its timeout, never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field


@dataclass
class Changes:
    """The change set of one transaction.

    ``leases``: ids whose state changed (long polls wake); ``gpus``: UUIDs
    whose capacity changed; ``nodes``: names whose every GPU changed (the
    node's state, say); ``all``: which GPUs the pool has may have changed
    (read every GPU again); ``index_taken``: the transaction took capacity in
    the in-memory index itself (a queue drain), so a rollback must forget the index.
    """

    leases: set[str] = field(default_factory=set)
    gpus: set[str] = field(default_factory=set)
    nodes: set[str] = field(default_factory=set)
    all: bool = False
    index_taken: bool = False

    def lease(self, lease_id: str) -> None:
        """``lease_id`` changed state."""
        self.leases.add(lease_id)

    def gpu_capacity(self, uuids: Collection[str]) -> None:
        """The capacity of ``uuids`` changed."""
        self.gpus.update(uuids)

    def node(self, name: str) -> None:
        """Every GPU of node ``name`` changed (its state, say)."""
        self.nodes.add(name)

    def every_gpu(self) -> None:
        """Which GPUs the pool has changed."""
        self.all = True

    @property
    def capacity(self) -> bool:
        """Whether any capacity changed (the queue is worth draining again)."""
        return self.all or bool(self.gpus) or bool(self.nodes)
