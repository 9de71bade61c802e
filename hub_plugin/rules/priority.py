"""Lease classes and pressure: who goes first, and what is taken back early.

Pure: leases, waiting requests and limits in, decisions out (no SQL, no
clock). The service's sweep (:mod:`gpupool.hub_plugin.pressure`), the
simulator and the tests call the same functions: the queue's class order
(:func:`class_rank`), the guaranteed share (:func:`guaranteed`) and the
pressure plan (:func:`plan`). The rules: docs/api.md, "Classes and pressure".
Capacity is counted in GPUs (fraction x count): what a waiter needs on which
node is the scheduler's business, so a plan may free a little more or less
than exactly what fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Collection, Hashable, Iterable, Mapping, Sequence

from gpupool import leaseclasses
from gpupool.leaseclasses import lease_class

from . import clearing

#: The two classes the pool ships with (:data:`gpupool.leaseclasses.LEASE_CLASSES`): names only, for
#: callers and tests; the rules read what a class does from the table, never these names.
INTERACTIVE, BATCH = "interactive", "batch"
#: Tolerance for sums of fractions (as the scheduler's).
EPSILON = 1e-9


def class_rank(name: str | None) -> int:
    """The queue rank of the class ``name`` (the table's; None: leases from before classes, the
    default class's); raises ValueError in words for an unknown class."""
    return lease_class(name).rank


def check_class(value: object) -> str:
    """``value`` when it is a known class; raises ValueError naming the classes otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"lease class {value!r:.40} is not one of {', '.join(leaseclasses.names())}")
    return lease_class(value).name


def yields(name: str | None) -> bool:
    """Whether the class ``name`` is backfill (:attr:`.LeaseClass.yields`)."""
    return lease_class(name).yields


@dataclass(frozen=True)
class Held:
    """An active lease, the one record of it the rules read (the pressure
    plan here, the ETA in :mod:`.eta`). ``gpus`` is fraction x count;
    ``busy``: a cell runs on its worker (:func:`.reclaim.is_busy`), since
    ``cell_started`` (None: not known); ``idle_since`` when its last cell ended
    (None while busy); ``idle_deadline`` its normal idle reclaim;
    ``idle_timeout`` in seconds (None: none; 0: it ends with its cell);
    ``gpu_ids`` its GPUs as the ETA's :class:`.eta.Room` names them (the
    service: UUIDs; the simulator: its placement's), by which node clearing counts
    the whole GPUs taking it frees (:func:`.clearing.units`; none: its ``gpus``)."""

    lease_id: str
    owner: str
    gpus: float
    lease_class: str
    preemptible: bool
    busy: bool
    started_at: datetime
    idle_since: datetime | None = None
    idle_deadline: datetime | None = None
    node: str | None = None
    gpu_ids: tuple[Hashable, ...] = ()
    cell_started: datetime | None = None
    idle_timeout: float | None = None


@dataclass(frozen=True)
class Asking:
    """A queued request: owner, GPUs (fraction x count), class, when asked, and how many
    GPUs it asks for (more than one: whole GPUs on one node); ``node``: the only node it
    may go to (a parked lease's resume: its worker lives there), None for any."""

    lease_id: str
    owner: str
    gpus: float
    lease_class: str
    created_at: datetime
    gpu_count: int = 1
    node: str | None = None


@dataclass(frozen=True)
class EarlyPark:
    """Park an idle lease at ``deadline`` (before its idle timeout) for ``reason`` (words for its user);
    ``grace``: the seconds that set the deadline, the pressure grace or (``cleared``) the grace on a node
    cleared for a whole-node request."""

    deadline: datetime
    reason: str
    grace: float = 0.0
    cleared: bool = False


@dataclass(frozen=True)
class Preemption:
    """Interrupt a preemptible lease's running cell at ``at`` (its user was told
    from when the plan first named it), then park it, for ``reason``."""

    at: datetime
    reason: str


@dataclass(frozen=True)
class Plan:
    """What pressure decides: early parks and preemptions by lease id, and
    the nodes ``cleared`` for a waiting request for several whole GPUs (node
    -> that request's lease id), on which no backfill is placed while it
    waits (:func:`batch_may_start`)."""

    parks: dict[str, EarlyPark]
    preemptions: dict[str, Preemption]
    cleared: dict[str, str] = field(default_factory=dict)

    def held_nodes(self, waiting: Collection[str]) -> set[str]:
        """The nodes cleared for a request still among ``waiting`` (lease ids)."""
        return {node for node, lease_id in self.cleared.items() if lease_id in waiting}

    def cleared_for_others(self, lease_id: str | None, waiting: Collection[str]) -> set[str]:
        """The nodes cleared for a request among ``waiting`` other than ``lease_id`` (None: any):
        no other request, a person's too, is placed there while that one waits
        (:func:`.queue.drain`). The room its preemptions free is that request's: taken by another
        request, or by a resume moving there, the request had a second node cleared, more jobs
        preempted (bench/backlog_churn.py, 48 replayed hours: 304 of 1,413 preemptions were on a node
        cleared for a request that was placed elsewhere, 33 requests cleared a second or third node)."""
        return {node for node, other in self.cleared.items() if other in waiting and other != lease_id}

    def deadline(self, lease: Held) -> datetime | None:
        """``lease``'s idle deadline: its own, or the earlier one this plan set (none without its own)."""
        early = self.parks.get(lease.lease_id)
        if lease.idle_deadline is None or early is None:
            return lease.idle_deadline
        return min(lease.idle_deadline, early.deadline)

    def preempt_at(self, lease: Held) -> datetime | None:
        """When this plan parks ``lease``'s running cell (None: not preempted, or not busy)."""
        preemption = self.preemptions.get(lease.lease_id)
        return preemption.at if preemption is not None and lease.busy else None


NO_PRESSURE = Plan({}, {})


def guaranteed(held: Iterable[Held], guaranteed_gpus: Mapping[str, float]) -> set[str]:
    """Ids of the leases within their owner's guaranteed share: per owner,
    oldest first, while the GPUs summed so far stay within
    ``guaranteed_gpus[owner]`` (absent: 0, nothing guaranteed)."""
    inside: set[str] = set()
    by_owner: dict[str, list[Held]] = {}
    for lease in held:
        by_owner.setdefault(lease.owner, []).append(lease)
    for owner, leases in by_owner.items():
        room = guaranteed_gpus.get(owner) or 0.0
        for lease in sorted(leases, key=lambda item: (item.started_at, item.lease_id)):
            if lease.gpus > room + EPSILON:
                break
            room -= lease.gpus
            inside.add(lease.lease_id)
    return inside


def waiting_words(owners: int) -> str:
    """``"3 people are waiting for a GPU"``."""
    return f"{owners} {'person is' if owners == 1 else 'people are'} waiting for a GPU"


@dataclass(frozen=True)
class Rule:
    """The settings :func:`plan` runs with: the service's (``c.PoolPressure``, :meth:`of`) or a
    replayed policy's. ``grace``: ``pressure_grace``; ``notice``: ``preemption_notice``;
    ``allow_preemption``; ``preemption_grace`` (None: ``grace``); ``batch_first``;
    ``clear_nodes`` (``pressure_clears_nodes``): the plan is given each node's whole free
    GPUs and clears one node per waiting interactive request for several whole GPUs;
    ``clear_grace`` (``pressure_clear_grace``; None: ``grace``): an idle lease on such a cleared
    node is parked this long after that request was asked (or at once if it goes idle later)."""

    grace: float
    notice: float = 0.0
    allow_preemption: bool = False
    preemption_grace: float | None = None
    batch_first: bool = False
    clear_nodes: bool = False
    clear_grace: float | None = None

    @classmethod
    def of(cls, settings) -> "Rule":
        """The rule of ``settings`` (the service's ``c.PoolPressure``, or anything with its names)."""
        return cls(settings.pressure_grace, settings.preemption_notice, settings.allow_preemption,
                   settings.preemption_grace, settings.batch_first, settings.pressure_clears_nodes,
                   settings.pressure_clear_grace)

    def wants_free_gpus(self, asking: Iterable[Asking]) -> bool:
        """Whether :meth:`plan` reads ``free_gpus`` for ``asking``: the caller reads each
        node's free GPUs only then."""
        return self.clear_nodes and any(lease_class(item.lease_class).preempts
                                        and item.gpu_count > 1 for item in asking)

    def plan(self, held: Sequence[Held], asking: Sequence[Asking], guaranteed_gpus: Mapping[str, float],
             free_gpus: Mapping[str, float] | None = None, freeing: Mapping[str, float] | None = None,
             kept: Mapping[str, str] | None = None) -> Plan:
        """:func:`plan` with these settings; ``free_gpus`` (node -> whole GPUs free) and ``kept``
        (the last plan's :attr:`Plan.cleared`) are used only with ``clear_nodes``."""
        return plan(held, asking, self, guaranteed_gpus, free_gpus if self.clear_nodes else None, freeing, kept)


def plan(held: Sequence[Held], asking: Sequence[Asking], rule: Rule, guaranteed_gpus: Mapping[str, float],
         free_gpus: Mapping[str, float] | None = None, freeing: Mapping[str, float] | None = None,
         kept: Mapping[str, str] | None = None) -> Plan:
    """Early parks and preemptions while ``asking`` waits (module docstring), by ``rule``.

    ``rule.grace``: seconds a lease may stay idle under pressure (counted from
    when it went idle, or from when the oldest request pressing on it was
    asked, whichever is later, so its user learns of it first); ``notice``:
    seconds between the oldest press and a preemptible cell's interrupt beyond
    ``preemption_grace`` (None: ``grace``; a running batch cell's user is
    warned by the notice itself, so a pool may start it at once);
    ``batch_first``: running preemptible batch leases are taken before idle
    interactive ones (:func:`_victims`); ``free_gpus`` (node -> whole GPUs
    free, or on their way back: :func:`.clearing.whole_free`; None: not known): a
    waiting interactive request for several whole GPUs has one node cleared for it
    (:func:`.clearing.clear`), the one ``kept`` cleared for it (node -> lease id: the
    last plan's :attr:`Plan.cleared`) while that can still be cleared; the rest is
    counted in GPUs; ``clear_grace`` (None: ``grace``): an idle lease on a node so
    cleared is parked at the later of when it went idle and that request's
    ``created_at`` + ``clear_grace``, if that is sooner. Only early parks before
    a lease's own ``idle_deadline`` are returned. No clock: deadlines are absolute, so the same inputs give the
    same plan at every sweep, and the sweep compares them with its ``now``.
    What a higher class's waiters free is theirs: a batch waiter counts only
    on batch leases not already taken for interactive ones. ``freeing`` (node ->
    GPUs): what leases being parked or released hold still, already on its way
    back; it counts first, the waiters of its node first, so that a sweep during
    a park's move does not take a second lease for the same waiter.
    """
    if not asking:
        return NO_PRESSURE
    spare = {node: gpus for node, gpus in (freeing or {}).items() if gpus > EPSILON}
    safe = guaranteed(held, guaranteed_gpus)
    open_leases = [lease for lease in held if lease.lease_id not in safe]
    parks: dict[str, EarlyPark] = {}
    preemptions: dict[str, Preemption] = {}
    cleared_for: dict[str, str] = {}
    # A class's waiters press on the leases of its rank and after (interactive on every lease, batch
    # only on batch leases); a class that does not press is left out of the waiters.
    asking = [item for item in asking if lease_class(item.lease_class).presses]
    for rank in sorted({class_rank(item.lease_class) for item in asking}):
        pressing = [item for item in asking if class_rank(item.lease_class) <= rank]
        kind = next(item for item in leaseclasses.LEASE_CLASSES if item.rank == rank)  # ranks are unique
        bound = {node: sum(item.gpus for item in asking if item.node == node and class_rank(item.lease_class) == rank)
                 for node in {item.node for item in asking if item.node is not None}}
        for node in bound:  # a resume takes what frees on its own node first
            used = min(bound[node], spare.get(node, 0.0))
            bound[node] -= used
            spare[node] = spare.get(node, 0.0) - used
        need = sum(item.gpus for item in asking if class_rank(item.lease_class) == rank and item.node is None)
        for node in sorted(spare, key=str):  # the rest of what frees serves anyone
            used = min(need, spare[node])
            need -= used
            spare[node] -= used
        since = min(item.created_at for item in pressing)
        reason = f"parked early: {waiting_words(len({item.owner for item in pressing}))}"
        targets = [lease for lease in open_leases if class_rank(lease.lease_class) >= rank
                   and lease.lease_id not in parks and lease.lease_id not in preemptions]
        # Only a class that preempts (a person waiting) interrupts a running cell: a batch waiter backfills
        # what frees up, else a standing backlog would preempt its own kind at every sweep.
        preempting = rule.allow_preemption and kind.preempts
        grace, clear_grace = rule.grace, rule.clear_grace
        after = grace if rule.preemption_grace is None else rule.preemption_grace

        def take(lease: Held, asked: datetime | None = None) -> None:
            if lease.busy:
                preemptions[lease.lease_id] = Preemption(since + timedelta(seconds=after + rule.notice),
                                                         reason.replace("parked early", "preempted"))
            else:
                park = EarlyPark(max(lease.idle_since, since) + timedelta(seconds=grace), reason, grace)
                if asked is not None and clear_grace is not None:  # on the node cleared for ``asked``'s request
                    cleared = max(lease.idle_since, asked + timedelta(seconds=clear_grace))
                    if cleared < park.deadline:
                        park = EarlyPark(cleared, reason, clear_grace, cleared=True)
                if lease.idle_deadline is None or park.deadline < lease.idle_deadline:
                    parks[lease.lease_id] = park

        if free_gpus is not None and kind.preempts:
            # ``free_gpus`` counts what is on its way back, GPU by GPU (:func:`.clearing.whole_free`), so
            # a node whose leases are being parked for a request stays the cheapest to clear for it.
            # A node the last plan cleared for a request still waiting stays that request's while it can.
            waiting = {item.lease_id for item in asking}
            mine = {lease_id: node for node, lease_id in (kept or {}).items() if lease_id in waiting}
            nodes = None  # what each node can free, read once for this class's requests
            for item in sorted(asking, key=lambda ask: ask.created_at):
                if class_rank(item.lease_class) != rank or item.gpu_count < 2 or item.node is not None:
                    continue
                if nodes is None:
                    nodes = clearing.clearable(targets, free_gpus, preempting, yields, class_rank,
                                               _staying(held, targets, parks, preemptions))
                theirs = set(mine.values()) - {mine.get(item.lease_id)}  # kept for the other requests
                cleared = clearing.choose(item.gpu_count, nodes, yields, mine.get(item.lease_id), theirs)
                need -= item.gpus
                if cleared is None:
                    # No node can be cleared now (a person's cell runs on each): it presses on nothing until
                    # one can. Counted in GPUs pool-wide it freed a GPU here and there that it cannot use,
                    # which the preempted jobs' own resumes took back before the next sweep, round after
                    # round (1,028 preemptions of 53 jobs in 300 replayed hours, bench/backlog_churn.py).
                    continue
                node, leases = cleared
                cleared_for[node] = item.lease_id
                for lease in leases:
                    take(lease, item.created_at)
                targets = [lease for lease in targets if lease.node != node]
                nodes.pop(node)
        for lease in _victims(targets, preempting, rule.batch_first):
            if need <= EPSILON:
                break
            take(lease)
            need -= lease.gpus
        # A resume waits for room on its own node: it presses only on the leases there.
        for node in sorted(node for node, here in bound.items() if here > EPSILON):
            here = bound[node]
            for lease in _victims([t for t in targets if t.node == node], preempting, rule.batch_first):
                if here <= EPSILON:
                    break
                if lease.lease_id in parks or lease.lease_id in preemptions:
                    continue  # taken for another waiter: its room is that one's
                take(lease)
                here -= lease.gpus
    return Plan(parks, preemptions, cleared_for)


def _staying(held: Sequence[Held], targets: Sequence[Held], parks: Mapping[str, EarlyPark],
             preemptions: Mapping[str, Preemption]) -> list[Held]:
    """The leases of ``held`` that stay whatever this waiter's plan takes: not among its
    ``targets`` and not already taken (``parks``, ``preemptions``) for another. The GPUs they
    hold come free for no one (:func:`.clearing.clear`)."""
    ids = {lease.lease_id for lease in targets}
    return [lease for lease in held
            if lease.lease_id not in ids and lease.lease_id not in parks and lease.lease_id not in preemptions]


def acting(plan_: Plan, now: datetime) -> tuple[set[str], set[str], datetime | None]:
    """What ``plan_`` does at ``now``: the ids of the leases to park (early deadline passed),
    of those to preempt (their time passed), and its next moment after ``now`` (None: none)."""
    parks = {lease for lease, park in plan_.parks.items() if park.deadline <= now}
    preempts = {lease for lease, preemption in plan_.preemptions.items() if preemption.at <= now}
    later = ([park.deadline for park in plan_.parks.values() if park.deadline > now]
             + [preemption.at for preemption in plan_.preemptions.values() if preemption.at > now])
    return parks, preempts, min(later) if later else None


def _victims(leases: Sequence[Held], preempting: bool, batch_first: bool) -> list[Held]:
    """What pressure takes, in order: idle leases (:func:`_idle_first`), then, when ``preempting``,
    running preemptible ones (:func:`_preemptible`); with ``batch_first`` every batch lease, idle or
    running, goes before any interactive one (a preemptible batch job yields before a person's idle
    notebook is parked)."""
    idle, busy = _idle_first(leases), _preemptible(leases) if preempting else []
    if not batch_first:
        return idle + busy
    return ([lease for lease in idle if yields(lease.lease_class)]
            + [lease for lease in busy if yields(lease.lease_class)]
            + [lease for lease in idle if not yields(lease.lease_class)]
            + [lease for lease in busy if not yields(lease.lease_class)])


def _idle_first(leases: Iterable[Held]) -> list[Held]:
    """Idle leases in the order they are parked: batch first, then the longest idle."""
    idle = [lease for lease in leases if not lease.busy and lease.idle_since is not None]
    return sorted(idle, key=lambda lease: (-class_rank(lease.lease_class), lease.idle_since, lease.lease_id))


def _preemptible(leases: Iterable[Held]) -> list[Held]:
    """Busy leases that opted in, in the order they are preempted: batch first, then by node, the node
    with the most such GPUs first (what is freed comes in whole nodes, which whole-GPU asks need, not
    a GPU on every node), then the newest (least work lost)."""
    busy = [lease for lease in leases if lease.busy and lease.preemptible]
    on_node: dict[str | None, float] = {}
    for lease in busy:
        on_node[lease.node] = on_node.get(lease.node, 0.0) + lease.gpus
    return sorted(busy, key=lambda lease: (-class_rank(lease.lease_class), -on_node[lease.node] if lease.node else 0.0,
                                           lease.node or "", -lease.started_at.timestamp(), lease.lease_id))


def batch_may_start(placement_node_idle: bool, idle_nodes: int, headroom_nodes: int,
                    interactive_waiting: bool, node_held: bool = False) -> bool:
    """May a batch request (new, or a parked one's resume) take the placement
    the scheduler found for it?

    Never on a node held for a person (``node_held``): one their parked lease
    waits to resume on, or one pressure clears for their request for several
    whole GPUs (:attr:`Plan.cleared`). What frees there is that person's: a
    preempted job's own resume, or new backfill, placed back there would only
    be preempted again at the next sweep, round after round. Not while an interactive request waits, where
    the pool asks it (``interactive_waiting``: ``c.PoolPressure.batch_yields``):
    what frees up, or what pressure frees for that request, is the person's,
    not backfill's. And not on an idle node (``placement_node_idle``: nothing
    allocated on it) while only ``headroom_nodes`` or fewer nodes are idle
    (``idle_nodes``, counted before the placement): whole nodes kept for
    interactive whole-node asks."""
    if interactive_waiting or node_held:
        return False
    return not placement_node_idle or idle_nodes > headroom_nodes


def preemption_refusal(preemptible: bool, allow_preemption: bool) -> str | None:
    """Words refusing ``preemptible`` on a pool whose ``c.PoolPressure.allow_preemption`` is off, else None."""
    if preemptible and not allow_preemption:
        return ("this pool allows no preemption (c.PoolPressure.allow_preemption = False), so a lease cannot be "
                "preemptible; ask without --preemptible (an admin can set c.PoolPressure.allow_preemption = True)")
    return None
