"""The wait queue: in which order queued requests get capacity. Pure: queued
requests, GPU states and time in, placements out.

Whenever capacity frees (a lease ends, a node registers, every reclaim
sweep) :func:`drain` places queued requests: classes first (:mod:`.priority`),
then who used the pool least recently; a request that does not fit is
passed over for later ones that do (backfill). A parked lease's resume waits
in the same line, ahead of its class's new requests (a preempted lease's
behind them: :func:`goes_ahead`), for room on its own node
(:func:`.resume.place`), or, where moves are allowed, on another node with
room (:func:`.resume.place_elsewhere`). The order in full: docs/api.md, "Queue".
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Collection, Iterable, Mapping, Sequence

from .placement_index import PlacementIndex
from . import resume as resume_rule
from .priority import batch_may_start, class_rank, yields
from .resume import Resume
from .scheduler import Demand, GPUState, Placement, Refusal


@dataclass(frozen=True)
class Waiting:
    """A queued request: its lease id, owner, demand, when it was asked and its
    class; ``resume``: a parked lease's resume (then ``created_at`` is when the
    resume was asked for)."""

    lease_id: str
    owner: str
    demand: Demand
    created_at: datetime
    lease_class: str | None = None  # None: the default class (gpupool.leaseclasses)
    resume: Resume | None = None


def sort_key(lease_class: str | None, created_at: datetime | float, tiebreak: object,
             used: datetime | float | None = None, *, resume: bool = False) -> tuple:
    """Where one waiting request goes in the queue order (module docstring), as a sort key: its
    class's rank first; a ``resume`` ahead of its class's new requests, in the order asked
    (``created_at``); then owners who never used the pool (``used`` None) before the least
    recently ``used``; then the oldest; ``tiebreak`` (the lease id) last. ``created_at`` and
    ``used``: datetimes, or any one comparable clock (the simulator's seconds). The service's
    queue and the simulator's replay of it (:mod:`gpupool.hub_plugin.simulate.waiting`) sort by it."""
    if resume:
        return (class_rank(lease_class), False, False, created_at, created_at, tiebreak)
    return (class_rank(lease_class), True, used is not None, created_at if used is None else used, created_at, tiebreak)


def order(waiting: Iterable[Waiting], last_used: Mapping[str, datetime | None]) -> list[Waiting]:
    """``waiting`` in the order they get capacity (module docstring)."""
    return sorted(waiting, key=lambda item: sort_key(item.lease_class, item.created_at, item.lease_id,
                                                     last_used.get(item.owner), resume=goes_ahead(item.resume)))


def goes_ahead(resume: Resume | None) -> bool:
    """Whether a waiting item is a resume that goes ahead of its class's new requests: every
    resume but a preempted lease's, which waits behind the requests already waiting (the room
    its preemption freed is theirs), ordered as a new request asked when it was parked."""
    return resume is not None and not resume.preempted


def position(lease_id: str, waiting: Iterable[Waiting], last_used: Mapping[str, datetime | None]) -> int | None:
    """1-based place of ``lease_id`` in the queue, or None when it is not queued."""
    for number, item in enumerate(order(waiting, last_used), start=1):
        if item.lease_id == lease_id:
            return number
    return None


def positions(queued: Iterable[tuple], last_used: Mapping[str, datetime | None]) -> dict[str, int]:
    """``{lease id: 1-based place}`` of ``queued`` ``(lease id, owner, created_at,
    class[, resume])`` rows (``resume`` true: a parked lease's resume, its
    ``created_at`` when that was asked; further columns are ignored), in
    :func:`order`'s order: one sort, however many places are asked for."""
    keyed = sorted((sort_key(row[3] if len(row) > 3 else None, row[2], row[0], last_used.get(row[1]),
                             resume=bool(row[4]) if len(row) > 4 else False), row[0])
                   for row in queued)
    return {lease_id: place for place, (_, lease_id) in enumerate(keyed, start=1)}


def newest_position(owner: str, lease_class: str, queued: Mapping[tuple[str, str], int],
                    last_used: Mapping[str, datetime | None]) -> int:
    """The place of a ``lease_class`` request ``owner`` has just queued, from how
    many requests each owner has queued per class (``queued[(owner, class)]``,
    the new one included) and when each last used the pool: it is the newest,
    so every queued request of a class before its own, and of its class whose
    owner comes before or with its owner in :func:`order`, is ahead of it.
    Needs no row per request."""
    return sum(count for (other, other_class), count in queued.items()
               if before_newest(other, other_class, owner, lease_class, last_used))  # its own counted: its place


def before_newest(other: str, other_class: str, owner: str, lease_class: str,
                  last_used: Mapping[str, datetime | None]) -> bool:
    """Whether a queued ``other_class`` request of ``other`` is ahead of (or is) a
    ``lease_class`` request ``owner`` has just queued (:func:`newest_position`)."""
    # :func:`sort_key` without the rows: every queued request was asked before the newest one.
    return (sort_key(other_class, datetime.min, "", last_used.get(other))
            < sort_key(lease_class, datetime.max, "", last_used.get(owner)))


def drain(waiting: Sequence[Waiting], gpus: Sequence[GPUState] | PlacementIndex,
          last_used: Mapping[str, datetime | None], now: datetime, *,
          accept: Callable[[Waiting, Placement], bool] | None = None,
          room: Mapping[str, int] | None = None, batch_yields: bool = False,
          headroom_nodes: int = 0, held_nodes: Collection[str] = (),
          resume_moves: bool = False, cleared: Mapping[str, str] | None = None) -> list[tuple[Waiting, Placement]]:
    """Queued requests to place on ``gpus`` (GPU states, or an index that is
    then updated with what is placed) now, in the order placed; each
    placement sees the capacity the earlier ones took. ``accept(item,
    placement)``, when given, is asked before each placement is taken; False
    stops the drain there (the service checks the decision against the store).
    ``room``, when given, is how many more requests each owner may have placed
    (``c.PoolQuotas.max_active_per_user``); an owner without room is passed over.
    A resume goes to its own node (:func:`.resume.place`); refused there, with
    ``resume_moves`` (``c.PoolLeases.resume_moves``), to another node with room
    (:func:`.resume.place_elsewhere`: its placement's ``node`` is not the resume's).
    A batch request is placed only where :func:`.priority.batch_may_start` allows:
    never on ``held_nodes`` (cleared by pressure for a person's request:
    :meth:`.priority.Plan.held_nodes`) nor on the node of a person's resume that
    fits nowhere it may go (one that moves holds no node); ``batch_yields``: not while an interactive request is left
    waiting; ``headroom_nodes``: not on an idle node while that many or fewer are idle.
    ``cleared`` (node -> lease id: :attr:`.priority.Plan.cleared` of the requests still waiting):
    a node pressure clears for a request is that request's while it waits: no other request, a
    person's too, is placed there, nor a resume moved there (its own node's room it takes back)
    (:meth:`.priority.Plan.cleared_for_others`).

    Capacity only shrinks during a drain, so a demand that did not fit once is
    not tried again: a thousand equal requests that do not fit cost one try."""
    index = gpus if isinstance(gpus, PlacementIndex) else PlacementIndex(gpus)
    last = dict(last_used)
    left = list(waiting)
    rooms = dict(room) if room is not None else None
    unfit: set[Demand] = set()
    placed: list[tuple[Waiting, Placement]] = []
    stuck: set[str] = set()  # resumes that did not fit: capacity only shrinks, so not tried again
    held = set(held_nodes)  # and the nodes where a person's resume did not fit: no batch placed there
    cleared = dict(cleared or {})
    while left:
        for item in order(left, last):
            others = {node for node, lease_id in cleared.items() if lease_id != item.lease_id}
            if item.resume is not None:
                if item.lease_id in stuck:
                    continue
                decision = _place_resume(item.resume, index)
                if not isinstance(decision, Placement) and resume_moves:
                    decision = resume_rule.place_elsewhere(item.resume, index, others)
                if not isinstance(decision, Placement):
                    stuck.add(item.lease_id)
                    if not yields(item.lease_class):
                        held.add(item.resume.node)
                    continue
            elif (item.demand in unfit and item.lease_id not in cleared.values()) \
                    or (rooms is not None and rooms.get(item.owner, 0) <= 0):
                continue  # (a request with a node cleared for it may fit there where others may not go)
            else:
                decision = index.place(item.demand, explain=False)
                if isinstance(decision, Placement) and decision.node in held and yields(item.lease_class):
                    decision = index.place_off(item.demand, held | others)  # backfill goes elsewhere
                elif isinstance(decision, Placement) and decision.node in others:
                    decision = index.place_off(item.demand, others)  # that room was freed for another
                if not isinstance(decision, Placement):
                    unfit.add(item.demand)
                    continue
            if yields(item.lease_class) and (batch_yields or headroom_nodes or decision.node in held):
                # In queue order every request still left of a class that does not yield did not fit:
                # a person waits.
                person = batch_yields and any(not yields(other.lease_class) for other in left)
                if not batch_may_start(index.node_idle(decision.node), index.idle_nodes(), headroom_nodes, person,
                                       decision.node in held):
                    if item.resume is not None:
                        stuck.add(item.lease_id)
                    else:  # capacity only shrinks: it is not allowed later in this drain either
                        unfit.add(item.demand)
                    continue
            if accept is not None and not accept(item, decision):
                return placed
            index.take(decision)
            last[item.owner] = now
            if rooms is not None and item.resume is None:  # a resume is a lease its owner holds already
                rooms[item.owner] = rooms.get(item.owner, 0) - 1
            left.remove(item)
            placed.append((item, decision))
            break
        else:
            break
    return placed


def _place_resume(ask: Resume, index: PlacementIndex) -> Placement | Refusal:
    """Where ``ask`` resumes on ``index`` now (:func:`.resume.place`)."""
    node_gpus = index.node_gpus(ask.node)
    return resume_rule.place(ask, index.states, node_gpus, index.hosts.get(ask.node), index.workload)


def estimate(queue_position: int, recent_hold_seconds: Sequence[float], holding: int) -> float | None:
    """A rough wait in seconds for the request at ``queue_position``:
    ``position x median length of recent leases / leases holding capacity now``
    (leases end one after another, each freeing room for about one request).
    None without any ended lease to learn from."""
    if not recent_hold_seconds:
        return None
    return round(queue_position * statistics.median(recent_hold_seconds) / max(1, holding), 1)
