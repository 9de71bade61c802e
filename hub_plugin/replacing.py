"""A lease whose worker start met an unreachable agent, placed again.

When ``POST /workers`` gets no answer from a node's agent (``agent_unreachable``:
nothing listens, no route, no answer within ``worker_start_timeout``), the
request is not the user's fault and other nodes may have room, so the lease
does not fail there. :func:`place_again` decides, in one write transaction
that holds the capacity lock (the same rules as a new request's placement
in :mod:`.intake` and the queue's drain in :mod:`.lease_queue`):

- another node has room: the lease's GPUs on the node tried are given back
  and the new node's taken (``starting`` again, the event saying why);
- none has, and the request asked to ``wait`` (and its wait has not passed):
  the GPUs are given back and the lease is ``queued`` again, in its place
  (the queue orders by its ``created_at``, which is kept) until its ``wait_until``;
- else: the words to end it ``failed`` with, naming the nodes tried; the
  caller ends it through the one release path (:meth:`.leases.LeaseBook.release`).

It asks for what the request asked (:func:`.lease_queue.asked`: its fraction,
GPU count, memory, model, host cores and memory) in the worker environment it
was placed in (the first node's default, by name, when the request named none).
A batch request placed again is not held off the nodes pressure clears for a
person (:meth:`.placing.Placer.for_batch`): it was admitted already.

The caller (:meth:`.leases.LeaseBook.start`) keeps the nodes tried and starts
what was placed; each node is tried once, so a lease cannot go round for ever.
A lease never started holds no usage span (``held_since`` is None), so none of
this is charged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Sequence

from gpupool.schema import LeaseState, isoformat

from . import usage
from .lease_queue import asked
from .models import Lease
from .placing import Placer
from .rules.scheduler import Placement
from .state import Transaction
from .transitions import assign, transition
from .worker_calls import StartJob, start_job

log = logging.getLogger("gpupool.service.leases")


@dataclass(frozen=True)
class PlacedAgain:
    """What :func:`place_again` did: ``job``, the worker to start on the lease's new node;
    ``failed``, the words to end the lease ``failed`` with (nothing was changed); both
    None: the lease is ``queued`` again."""

    job: StartJob | None = None
    failed: str | None = None


def place_again(tx: Transaction, lease: Lease, placer: Placer, host_share: float, tried: Sequence[str],
                words: str, now: datetime) -> PlacedAgain:
    """Place ``lease`` (``starting`` on ``tried[-1]``, whose agent could not be
    reached: ``words``) on a node not in ``tried``, or queue it again (module
    docstring). ``host_share``: ``c.PoolNodes.host_share``. Inside a write
    transaction holding the capacity lock, on the writer thread."""
    node = tried[-1]
    failed = f"the worker could not start on {node}: {words}"
    demand = asked(lease, host_share)
    decision = placer.place_off(tx.session, demand, set(tried))
    nodes = ", ".join(tried)
    if not isinstance(decision, Placement):
        if lease.wait_until is None or lease.wait_until <= now:
            why = "it asked not to wait" if lease.wait_until is None else "its wait is over"
            return PlacedAgain(failed=f"{failed}; no other node has room for it now and {why} "
                                      f"(nodes tried: {nodes}): {decision.message}")
    old = [g.gpu_uuid for g in lease.gpus]
    tx.changes.gpu_capacity(old)  # given back (the transition below names only what it holds then)
    if isinstance(decision, Placement):
        lease.gpus = []  # the old rows go before the new ones are written
        tx.session.flush()
        where = assign(tx, lease, decision, now, after=failed)
        tx.changes.gpu_capacity(decision.gpus)  # starting -> starting: the transition names none
        log.info("lease %s placed again on %s after its worker could not start on %s (nodes tried: %s)",
                 lease.id, where, node, nodes)
        return PlacedAgain(job=start_job(tx.session, lease))
    queue_again(tx, lease, f"{failed}; back in the queue, in its place, until {isoformat(lease.wait_until)}: "
                f"no other node has room now (nodes tried: {nodes}): {decision.message}", now)
    log.info("lease %s queued again after its worker could not start on %s (nodes tried: %s)", lease.id, node,
             nodes)
    return PlacedAgain()


#: A node's ``state_reason`` once its agent said it stops (its last heartbeat, or its answer to a start).
LEAVING_REASON = "its agent stopped"


def queue_after_stop(tx: Transaction, lease: Lease, node: str, away_for: float, now: datetime) -> None:
    """A new ``lease`` whose start on ``node`` its agent's stop cut short (nothing of its user's
    was there yet) back to ``queued``, in its place (:func:`queue_again`), waiting at least
    ``away_for`` seconds (``node_ttl + parked_node_grace``: the agent may be restarting)."""
    lease.wait_until = max(lease.wait_until or now, now + timedelta(seconds=away_for))
    queue_again(tx, lease, f"its node {node}'s agent stopped while its worker started; queued again, in its "
                f"place, until {isoformat(lease.wait_until)}", now)


def queue_again(tx: Transaction, lease: Lease, words: str, now: datetime) -> None:
    """``lease`` (placed, never used: ``starting``, or ``active`` with a worker that never ran a
    cell) back to ``queued`` for ``words``: its GPUs given back (named in the change set), what
    the placement set cleared as when it was asked, and a span of usage it opened closed. Its
    ``created_at`` is kept, so it waits in its place, ahead of newer requests; the caller drains
    the queue. Inside a write transaction, on the writer thread."""
    tx.changes.gpu_capacity([g.gpu_uuid for g in lease.gpus])  # the transition names only what it holds then
    usage.close_span(tx.session, lease, now)
    lease.gpus = []
    lease.node_name = None
    lease.memory = lease.requested_memory or 0  # as when it was asked: the placement sets it
    lease.cpus = lease.host_memory = None
    lease.connection = lease.worker_pid = lease.worker_state = lease.idle_since = None
    transition(tx, lease, LeaseState.queued, words, now)
