"""The service's state: the store, the one clock, the store threads, and what
the service keeps in memory beside the store (the capacity index, the
long-poll watch), behind one object.

Every write goes through :meth:`PoolState.writing`, which yields a
:class:`Transaction`: the session and the change set (:class:`.changes.Changes`)
its writers fill. The commit hands the change set to the capacity index and
the long-poll watch; nobody else tells them anything.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Callable, Iterator

from sqlalchemy.orm import Session

from gpupool.schema import utcnow

from .capacity import CapacityIndex
from .changes import Changes
from .db import Store
from .storework import StoreWork
from .watch import LeaseWatch


@dataclass
class Transaction:
    """One write transaction: ``session``, and ``changes``, what it changed."""

    session: Session
    changes: Changes = field(default_factory=Changes)


class PoolState:
    """The store and what is kept in memory beside it.

    ``now`` is the one clock (UTC-aware datetimes), replaceable so time can be
    moved in tests; ``work`` runs store calls off the event loop (:mod:`.storework`;
    a new one by default); ``context_overhead`` (bytes) sizes the capacity index.
    ``capacity_epoch`` counts the commits that changed capacity (the queue's sweep
    drains again only after one).
    """

    def __init__(self, store: Store, context_overhead: int, *, now: Callable[[], datetime] = utcnow,
                 work: StoreWork | None = None) -> None:
        self.store = store
        self.now = now
        self.work = work or StoreWork()
        self.watch = LeaseWatch()
        # The writer thread's alone (storework).
        self.capacity = CapacityIndex(context_overhead)
        self.capacity_epoch = 0

    def reading(self) -> Iterator[Session]:
        """A read-only session (:meth:`.db.Store.read`); on a store thread."""
        return self.store.read()

    @contextmanager
    def writing(self) -> Iterator[Transaction]:
        """A write transaction; once it commits, its change set goes to the
        capacity index and the long-poll watch. On the writer thread only (:mod:`.storework`)."""
        changes = Changes()
        try:
            with self.store.write() as session:
                yield Transaction(session, changes)
        except BaseException:
            if changes.index_taken:
                self.capacity.invalidate()  # the drain took capacity there that the rollback gave back
            raise
        self.capacity.changed(changes)
        if changes.capacity:
            self.capacity_epoch += 1
        self.watch.notify(changes.leases)
