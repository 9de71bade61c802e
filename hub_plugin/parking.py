"""Park in place and resume: the life cycle's peer for leases that give their
GPU share back without ending their worker (:class:`Parking`: ``park``,
``resume_by``). The store side is :mod:`.parked`; as in :mod:`.leases`, the
coroutines run their SQL on store threads in functions named ``_..._now``.
What parks, which tier, and how a resume finds room: docs/parking.md, "Life
cycle" and "The service's part".
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Awaitable, Callable, TypeVar

from sqlalchemy import select

from gpupool.errors import GPUPoolError, Reason
from gpupool.schema import LeaseState
from gpupool.wire.parking import ParkRequest, WorkerParked, WorkerResumed

from . import parked, usage
from .auth import Identity, forbidden
from .background import Background
from .lease_queue import Drained, LeaseQueue
from .lease_views import LeaseViews
from .leases import LeaseBook
from .models import Lease, Node
from .quota_book import QuotaBook
from .rules import quotas
from .rules.reclaim import ParkCode, Reclaim, lost_words
from .state import PoolState
from .worker_calls import StartJob, WorkerCalls

log = logging.getLogger("gpupool.service.parking")

T = TypeVar("T")
#: Seconds between two looks, during a move's agent calls, at whether a node of the move was lost.
LOST_LOOK_S = 1.0

#: Most seconds ``POST /leases/{id}/park`` waits for the park before answering (the lease is then
#: still ``parking``; a long poll follows it): under the clients' 30 s timeout.
ANSWER_S = 20.0
#: Park outcomes (:class:`Outcome`).
PARKED, BUSY, FAILED, GONE = "parked", "busy", "failed", "gone"


@dataclass(frozen=True)
class Outcome:
    """What :meth:`Parking.park` did: ``kind`` (``parked``; ``busy``: a cell runs, kept
    active; ``failed``: the agent could not park it; ``gone``: nothing to do, the lease
    had left ``active`` or no longer qualified) and ``words`` for a person."""

    kind: str
    words: str = ""


class Parking:
    """Parks and resumes leases through ``state`` and the agents (``workers``);
    ends what cannot be parked through ``leases`` (the one release path), whose
    queue places resumes; ``quotas`` for ``max_parked_memory``; ``views`` for
    the JSON answered; ``on_parked(code, tier)`` counts each park and
    ``on_resumed(seconds)`` observes how long each resume took from its
    placement (metrics); ``away_for``: seconds a lost node's agent may be
    silent and still come back for its leases (``node_ttl + parked_node_grace``)."""

    def __init__(self, state: PoolState, workers: WorkerCalls, tasks: Background,
                 views: LeaseViews, leases: LeaseBook, queue: LeaseQueue, quota_book: QuotaBook,
                 on_parked: Callable[[str, str], None] = lambda code, tier: None,
                 on_resumed: Callable[[float], None] = lambda seconds: None, away_for: float = 600.0) -> None:
        self.state = state
        self.away_for = away_for
        self.workers = workers
        self.tasks = tasks
        self.views = views
        self.leases = leases
        self.queue = queue
        self.quotas = quota_book
        self.on_parked = on_parked
        self.on_resumed = on_resumed

    # -- parking -----------------------------------------------------------------------------------

    async def park(self, lease_id: str, code: ParkCode, reason: str, *,
                   only_if: Callable[[Lease, datetime], bool] | None = None) -> Outcome:
        """Park ``lease_id`` for ``code`` and ``reason`` (words); returns the :class:`Outcome`.
        ``only_if(lease, now)`` is re-checked under the write lock (the sweep's rule: a cell
        may have started since it read the lease)."""
        begun = await self.state.work.write(self._begin_now, lease_id, code, reason, only_if)
        if isinstance(begun, Outcome):
            return begun
        url, request = begun
        log.info("lease %s parking (%s, %s): %s", lease_id, code, request.tier, request.reason)
        return await self._ask(lease_id, ParkCode(code), url, request)

    async def _ask(self, lease_id: str, code: ParkCode, url: str, request: ParkRequest) -> Outcome:
        try:
            answer = await self.workers.park(url, lease_id, request)
        except GPUPoolError as exc:
            return await self._not_parked(lease_id, code, request, exc)
        drained = await self.state.work.write(self._done_now, lease_id, answer)
        if drained is None:
            return Outcome(GONE, "the lease left parking while its agent parked it")
        log.info("lease %s parked %s in %.2fs (%d GPU bytes moved, %d host bytes held)", lease_id, answer.tier,
                 answer.seconds, answer.gpu_bytes_moved, answer.host_bytes)
        self.on_parked(str(code), answer.tier)
        self.leases.after_drain(drained)
        return Outcome(PARKED)

    async def _not_parked(self, lease_id: str, code: ParkCode, request: ParkRequest, exc: GPUPoolError) -> Outcome:
        """The agent did not park it: back ``active`` while the worker runs on (a cell runs; the
        owner's and preemption's parks; an idle or pressure park whose agent did not answer while its
        node is not lost, a restart say, after which it re-adopts the worker: the next sweep asks
        again), else released as a reclaim (the lease ends, its worker stopped)."""
        if exc.code == Reason.worker_busy:
            await self.state.work.write(self._kept_now, lease_id, "a cell is running on its worker")
            return Outcome(BUSY, exc.message)
        words = f"it could not be parked in place ({exc.message})"
        log.warning("lease %s: %s", lease_id, words)
        if code in (ParkCode.owner, ParkCode.preemption):
            await self.state.work.write(self._kept_now, lease_id, words)
            return Outcome(FAILED, words)
        kept = exc.code == Reason.agent_unreachable and await self.state.work.write(
            self._kept_now, lease_id, f"{words}; it is parked once its agent answers", True)
        if not kept:
            await self.leases.release(lease_id, LeaseState.reclaimed, f"{request.reason}; {words}",
                                      code=Reclaim(str(code)), only_if=_parking)
        return Outcome(FAILED, words)

    def _begin_now(self, lease_id: str, code: ParkCode, reason: str,
                   only_if: Callable[[Lease, datetime], bool] | None) -> tuple[str, ParkRequest] | Outcome:
        """``active`` -> ``parking``; ``(agent url, the ParkRequest)``, or the :class:`Outcome` of not parking."""
        now = self.state.now()
        with self.state.writing() as tx:
            lease = tx.session.get(Lease, lease_id)
            if lease is None or lease.state != LeaseState.active.value or (only_if and not only_if(lease, now)):
                return Outcome(GONE, "the lease is not active (any more)")
            node = tx.session.get(Node, lease.node_name)
            if node is None or node.checkpointer is None:
                return Outcome(FAILED, cannot_park_words(lease.node_name))
            tier, beyond, room = self._tier(tx.session, lease)
            reason = reason if beyond is None else f"{reason}; {beyond}"
            parked.begin(tx, lease, code, reason, tier, now)
            return node.url, ParkRequest(reason, tier, parked.running_cell(code), room)

    def _tier(self, session, lease: Lease) -> tuple[str, str | None, int | None]:
        """Where the park goes under the owner's ``max_parked_memory`` (:func:`.rules.quotas.park_tier`),
        and what the cap leaves for it (None: no cap). Its size is guessed here as the GPU memory its worker
        uses (what moves to host RAM); the agent, which knows the worker's resident memory too, spills it
        when the two pass what is left."""
        limits = self.quotas.limits(session, lease.owner, tuple(lease.groups or ()))
        held = usage.parked_memory(session, lease.owner)
        tier, beyond = quotas.park_tier(limits, held, lease.worker_memory_used or 0)
        cap = limits.max_parked_memory
        return tier, beyond, None if cap is None else max(0, cap - held)

    def _done_now(self, lease_id: str, answer: WorkerParked) -> Drained | None:
        """``parking`` -> ``parked`` with what the agent answered, and the queue drained on the
        share it gave back, in one transaction; None when the lease left ``parking`` meanwhile."""
        now = self.state.now()
        with self.state.writing() as tx:
            self.state.store.lock_capacity(tx.session)  # the queue is drained below
            lease = tx.session.get(Lease, lease_id)
            if lease is None or lease.state != LeaseState.parking.value:
                return None
            parked.done(tx, lease, answer, now)
            drained = self.queue.drain_in(tx, now)
            if lease.park_code == ParkCode.preemption:
                # Its cell waits, frozen: the service resumes it once room comes, after those waiting now.
                lease.resume_requested_at = now
            return drained

    def _kept_now(self, lease_id: str, why: str, unless_lost: bool = False) -> bool:
        """``parking`` -> ``active`` again (``why``: words); with ``unless_lost``, not when its node
        is lost for good, silent past ``away_for`` (the lease stays ``parking``). Whether it was kept."""
        with self.state.writing() as tx:
            lease = tx.session.get(Lease, lease_id)
            if lease is None or lease.state != LeaseState.parking.value:
                return False
            node = tx.session.get(Node, lease.node_name) if lease.node_name else None
            if unless_lost and node is not None and self._gone(node):
                return False
            parked.kept(tx, lease, why, self.state.now())
            return True

    # -- resuming -------------------------------------------------------------------------------

    async def resume_worker(self, job: StartJob) -> None:
        """The agent's resume of a lease the queue placed from a park (``starting``): ``active``
        with the connection it answers; if it cannot resume it (its worker stays parked there)
        the lease is ``parked`` again, its share back; one whose worker is gone ends ``failed``.
        A lease placed on another node moves there (:meth:`_move`)."""
        if job.moved_from is not None:
            await self._move(job)
            return
        lease_id = job.request.lease_id
        try:
            answer = await self.workers.resume(job)
        except GPUPoolError as exc:
            log.warning("lease %s: resume on %s failed: %s", lease_id, job.node, exc.message)
            if exc.code == Reason.not_found:
                await self.leases.release(lease_id, LeaseState.failed, f"its parked worker is gone from {job.node} "
                                          f"({exc.message}): its variables and state there are gone")
            else:
                await self._back_parked(lease_id, f"its resume on {job.node} failed ({exc.message}); it stays "
                                        "parked: resume again to retry", move=False)
            return
        seconds = await self.state.work.write(self._resumed_now, lease_id, answer)
        if seconds is not None:
            log.info("lease %s resumed on %s in %.2fs (pid %s)", lease_id, job.node, seconds, answer.pid)
            self.on_resumed(seconds)

    async def _move(self, job: StartJob) -> None:
        """A move (``c.PoolLeases.resume_moves``; docs/parking.md). A lease parked in memory
        moves worker to worker (:meth:`_moved_from_memory`); a spilled one, or one whose move
        from memory failed, through the old node's disk: (a) the old node's agent spills the
        worker to its disk (``POST .../park``, ``tier: disk``; a spilled one answers at once),
        (b) the new node's agent starts a worker on the lease's new GPUs and loads the spill,
        fetched from the old agent (``POST .../resume`` with ``spill_from``). Either way (c) the
        old agent then removes its copy (:meth:`_remove_old`). A failure at (a) or (b) (an agent
        unreachable or refusing) leaves the lease ``parked`` on its old node, with its old GPUs
        and the failure's words, the new node's share given back; a node lost then is the
        lost-node rule's, as for any parked lease."""
        lease_id, old, new = job.request.lease_id, job.moved_from, job.node
        reason = f"moving to {new}: {old} has no room"
        if job.spill_from is None:
            await self._back_parked(lease_id, f"it could not move to {new}: its old node {old} is no longer known")
            return
        moving = await self.state.work.read(self._moving_now, lease_id)
        if moving is None:
            return  # it left starting (released) before the move began
        running, tier = moving
        if tier == "memory" and await self._moved_from_memory(job):
            return
        try:
            spill = await self._unless_lost((old,), self.workers.park(job.spill_from, lease_id,
                                                                      ParkRequest(reason, "disk", running)))
            if spill.tier != "disk":
                raise GPUPoolError(Reason.cannot_park, f"the agent on {old} kept it {spill.tier}, not on disk", 502)
        except GPUPoolError as exc:
            log.warning("lease %s: move to %s failed: %s did not spill it: %s", lease_id, new, old, exc.message)
            await self._back_parked(lease_id, f"it could not move to {new}: the agent on {old} did not spill it to disk "
                                f"({exc.message}); it stays parked on {old}: resume again to retry")
            return
        if not await self.state.work.write(self._spilled_now, lease_id, spill):
            await self._remove_old(job, "it was released while its move's spill was written")
            return
        log.info("lease %s spilled on %s (%d bytes) to move to %s", lease_id, old, spill.disk_bytes, new)
        try:
            answer = await self._unless_lost((old, new), self.workers.resume(job))
        except GPUPoolError as exc:
            log.warning("lease %s: move to %s failed: %s", lease_id, new, exc.message)
            await self._back_parked(lease_id, f"its move to {new} failed ({exc.message}); it stays parked on {old}, "
                                f"on its disk: resume again to retry")
            return
        await self._moved(job, answer)

    async def _moved_from_memory(self, job: StartJob) -> bool:
        """Move a lease parked in memory worker to worker: the new node's agent starts a worker
        that takes the namespace the old worker offers on its data plane (``POST .../resume``
        with ``move_from``; :mod:`gpupool.node.workers.warmmove`), then the old worker is ended.
        False when the new node's agent could not do it (logged): the old worker is left offered,
        and the move goes through the old node's disk instead (its spill takes the offered worker
        as it is). When an agent cannot be reached at all, no disk helps: the lease is ``parked``
        again on its old node (True)."""
        lease_id, old, new = job.request.lease_id, job.moved_from, job.node
        try:
            answer = await self._unless_lost((old, new), self.workers.resume(job, from_memory=True))
        except GPUPoolError as exc:
            if exc.code == Reason.agent_unreachable:
                log.warning("lease %s: move to %s failed: %s", lease_id, new, exc.message)
                await self._back_parked(lease_id, f"its move to {new} failed ({exc.message}); it stays parked on "
                                        f"{old}: resume again to retry")
                return True
            log.warning("lease %s: its move from %s's memory to %s failed (%s); it moves through %s's disk", lease_id,
                        old, new, exc.message, old)
            return False
        await self._moved(job, answer)
        return True

    async def _moved(self, job: StartJob, answer: WorkerResumed) -> None:
        """The move of ``job`` is done (the new node's ``answer``): ``active`` there, the old copy
        removed; a lease that left the move meanwhile (released) has its new worker stopped too."""
        lease_id = job.request.lease_id
        seconds = await self.state.work.write(self._resumed_now, lease_id, answer)
        if seconds is not None:
            log.info("lease %s resumed on %s (moved from %s) in %.2fs (pid %s)", lease_id, job.node, job.moved_from,
                     seconds, answer.pid)
            self.on_resumed(seconds)
        elif note := await self.workers.stop(job.url, lease_id):
            log.warning("lease %s: its new worker on %s was not stopped after its move: %s", lease_id, job.node, note)
        # The state was copied (or the lease ended meanwhile): the old node's copy goes either way.
        await self._remove_old(job, "its move is over")

    async def _remove_old(self, job: StartJob, why: str) -> None:
        """Remove the lease's copy on the old node, its offered worker or its spill (``DELETE
        /workers/{id}`` there); one left behind (the agent unreachable) is stopped by that
        node's reconcile, whose heartbeat reports it for a lease that no longer lives there."""
        note = await self.workers.stop(job.spill_from, job.request.lease_id)
        if note:
            log.warning("lease %s: its copy on %s was not removed (%s): %s", job.request.lease_id, job.moved_from,
                        why, note)

    async def _unless_lost(self, nodes: tuple[str, ...], call: Awaitable[T]) -> T:
        """What the agent ``call`` answers, or, as soon as one of ``nodes`` is marked ``lost`` (no
        heartbeat for ``c.PoolNodes.node_ttl``), GPUPoolError ``agent_unreachable`` with the call
        cancelled: a move does not hold its new node's share for ``worker_park_timeout`` waiting
        on an agent that is gone (a stopped one accepts connections and never answers)."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=LOST_LOOK_S)
                if done:
                    return task.result()
                lost = await self.state.work.read(self._lost_now, nodes)
                if lost:
                    raise GPUPoolError(Reason.agent_unreachable, f"node {lost} was lost (no heartbeat for "
                                       "c.PoolNodes.node_ttl)", 502)
        finally:
            task.cancel()

    def _lost_now(self, nodes: tuple[str, ...]) -> str | None:
        """The first of ``nodes`` that is ``lost`` now; None when none is."""
        with self.state.reading() as session:
            return session.scalar(select(Node.name).where(Node.name.in_(nodes), Node.state == "lost").limit(1))

    def _moving_now(self, lease_id: str) -> tuple[str, str | None] | None:
        """What the move's spill does with a cell frozen mid-way (as a park of its code would) and
        the tier its state is in; None when ``lease_id`` is not moving (any more)."""
        with self.state.reading() as session:
            lease = session.get(Lease, lease_id)
            if lease is None or lease.state != LeaseState.starting.value or not parked.is_move(lease):
                return None
            return parked.running_cell(lease.park_code), lease.park_tier

    def _spilled_now(self, lease_id: str, answer: WorkerParked) -> bool:
        """Record the move's spill (:func:`.parked.spilled`); False when the lease left the move."""
        with self.state.writing() as tx:
            lease = tx.session.get(Lease, lease_id)
            if lease is None or lease.state != LeaseState.starting.value or not parked.is_move(lease):
                return False
            parked.spilled(tx, lease, answer)
            return True

    async def _back_parked(self, lease_id: str, why: str, move: bool = True) -> None:
        self.leases.after_drain(await self.state.work.write(self._back_parked_now, lease_id, why, move))

    def _back_parked_now(self, lease_id: str, why: str, move: bool) -> Drained:
        """A resume the agents could not do (``why``, words): ``starting`` -> ``parked`` again
        (:func:`.parked.unresumed`; a ``move``: on its old node, :func:`.parked.unmoved`), the share
        it took given back and the queue drained on it."""
        now = self.state.now()
        with self.state.writing() as tx:
            self.state.store.lock_capacity(tx.session)
            lease = tx.session.get(Lease, lease_id)
            if lease is None or lease.state != LeaseState.starting.value \
                    or not (parked.is_move(lease) if move else parked.is_resume(lease)):
                return Drained()
            (parked.unmoved if move else parked.unresumed)(tx, lease, why, now)
            return self.queue.drain_in(tx, now)

    def _resumed_now(self, lease_id: str, answer: WorkerResumed) -> float | None:
        """``starting`` -> ``active`` (:func:`.parked.resumed`); the seconds since it was placed,
        or None when the lease left ``starting`` meanwhile."""
        now = self.state.now()
        with self.state.writing() as tx:
            lease = tx.session.get(Lease, lease_id)
            if lease is None or lease.state != LeaseState.starting.value or not parked.is_resume(lease):
                return None
            placed_at = lease.events[-1].at if lease.events else now
            parked.resumed(tx, lease, answer, now)
            return max(0.0, (now - placed_at).total_seconds())

    # -- the owner's calls ------------------------------------------------------------------------

    async def park_by(self, who: Identity, lease_id: str) -> dict[str, Any]:
        """``POST /leases/{id}/park`` by its owner: park it now; returns the lease (``parked``,
        or still ``parking`` after :data:`ANSWER_S`). Idempotent for a lease parking or parked; a
        parked one's resume asked and not yet placed is withdrawn (it stays parked: an
        interrupted ``%gpu release``, or a park asked again). Raises 404 (not visible), 403 (an
        admin's: only its owner parks it), 409 ``invalid_state`` (not active: also a resume
        under way), ``cannot_park`` (its node cannot), ``worker_busy`` (a cell runs)."""
        state, node = await self.state.work.read(self._owned_now, who, lease_id)
        if state == LeaseState.parking.value:
            await self.views.wait_out(lease_id, state, ANSWER_S)
        elif state == LeaseState.parked.value:
            await self.state.work.write(self._stay_parked_now, lease_id)
        else:
            if state != LeaseState.active.value:
                raise GPUPoolError(Reason.invalid_state, f"lease {lease_id} is {state}: only an active lease can be "
                                   "parked", 409, state=state)
            task = self.tasks.spawn(self.park(lease_id, ParkCode.owner, "parked by its owner"))
            finished, _ = await asyncio.wait({task}, timeout=ANSWER_S)
            outcome = task.result() if finished else None
            if outcome is not None and outcome.kind == BUSY:
                raise _busy(lease_id)
            if outcome is not None and outcome.kind == FAILED:
                raise GPUPoolError(Reason.cannot_park, f"lease {lease_id} was not parked: {outcome.words}; it stays "
                                   f"active on {node} (release it to give its GPU back)", 409)
        return await self.views.get(who, lease_id)

    async def resume_by(self, who: Identity, lease_id: str, in_place: bool = False) -> dict[str, Any]:
        """``POST /leases/{id}/resume`` by its owner: a parked (or parking) lease waits for
        room on its node (or, with ``c.PoolLeases.resume_moves``, another), then resumes;
        idempotent (an active or starting lease is answered as it is). ``in_place``: asked ahead
        of a cell (the user is back at the notebook), so it waits for its own node, until a
        resume without it is asked. A lease whose node is lost waits for its agent to come back
        (:meth:`_gone`); lost for good, it ends ``failed``, saying what was lost. Returns the
        lease. Raises 404, 403 (an admin's), 409 ``invalid_state`` (queued, releasing, ended)."""
        lost = await self.state.work.write(self._resume_now, who, lease_id, in_place)
        if lost:
            await self.leases.release(lease_id, LeaseState.failed, lost, only_if=_parked_or_parking)
        else:
            await self.leases.drain_queue()  # its room may be there already
        return await self.views.get(who, lease_id)

    def _stay_parked_now(self, lease_id: str) -> None:
        """Withdraw a parked lease's resume asked and not yet placed: it leaves the queue."""
        with self.state.writing() as tx:
            lease = tx.session.get(Lease, lease_id)
            if lease is not None and lease.state == LeaseState.parked.value and lease.resume_requested_at is not None:
                lease.resume_requested_at, lease.resume_in_place = None, False
                tx.changes.lease(lease.id)

    def _owned_now(self, who: Identity, lease_id: str) -> tuple[str, str | None]:
        """``(state, node)`` of ``who``'s own lease; 404 / 403 otherwise. (Whether a cell runs is
        the agent's to say: the service hears of a cell's end up to a heartbeat later.)"""
        with self.state.reading() as session:
            lease = self._owned(session, who, lease_id)
            return lease.state, lease.node_name

    def _resume_now(self, who: Identity, lease_id: str, in_place: bool) -> str | None:
        """Ask for the resume (``in_place``: only ahead of a cell; a resume asked without it since
        may move); the words to end it with when its node is lost, else None."""
        with self.state.writing() as tx:
            lease = self._owned(tx.session, who, lease_id)
            if lease.state in (LeaseState.active.value, LeaseState.starting.value):
                return None
            if lease.state not in (LeaseState.parking.value, LeaseState.parked.value):
                raise GPUPoolError(Reason.invalid_state, f"lease {lease_id} is {lease.state}: only a parked lease can "
                                   "be resumed; ask for a new one", 409, state=lease.state)
            node = tx.session.get(Node, lease.node_name)
            if node is None or self._gone(node):
                return lost_words(lease.node_name, lease.id) + (f" ({node.state_reason})" if node else "")
            if lease.resume_requested_at is None:
                lease.resume_requested_at, lease.resume_in_place = self.state.now(), in_place
                tx.changes.lease(lease.id)
            elif lease.resume_in_place and not in_place:
                lease.resume_in_place = False
                tx.changes.lease(lease.id)
            return None

    def _gone(self, node: Node) -> bool:
        """Whether ``node`` is lost for good: silent for ``away_for`` (``node_ttl`` and
        ``c.PoolNodes.parked_node_grace``). Lost for less, its agent may come back with the
        parked workers (re-adopted, or saved to its disk when it stopped): a resume waits for it."""
        return node.state == "lost" and (self.state.now() - node.last_heartbeat_at).total_seconds() >= self.away_for

    def _owned(self, session, who: Identity, lease_id: str) -> Lease:
        lease = self.views.visible(session, who, lease_id)  # 404 unless visible
        if lease.owner != who.name:
            raise forbidden(f"only its owner may park or resume lease {lease_id} (an admin may release it)")
        return lease

    # -- after a restart ------------------------------------------------------------------------

    async def restart(self) -> None:
        """Pick up the parks a previous run left half-done: ask the agent again (a worker it
        parked already is answered as it is). Resumes half-done are the life cycle's
        (:meth:`.leases.LeaseBook.resume`: ``starting`` leases)."""
        for lease_id, code, url, request in await self.state.work.read(self._parking_now):
            log.info("lease %s was parking when the service stopped; asking its agent again", lease_id)
            self.tasks.spawn(self._ask(lease_id, code, url, request))

    def _parking_now(self) -> list[tuple[str, ParkCode, str, ParkRequest]]:
        with self.state.reading() as session:
            rows = session.execute(select(Lease.id, Lease.park_code, Lease.park_reason, Lease.park_tier, Node.url)
                                   .join(Node, Node.name == Lease.node_name)
                                   .where(Lease.state == LeaseState.parking.value)).all()
        return [(row.id, ParkCode(row.park_code or ParkCode.idle), row.url,
                 ParkRequest(row.park_reason or "", row.park_tier or "memory", parked.running_cell(row.park_code)))
                for row in rows]


def cannot_park_words(node: str | None) -> str:
    """Why a lease on ``node`` cannot be parked in place, in words naming the fix."""
    return (f"the agent on {node} cannot park in place (it reports no checkpointer: an agent from before parking, "
            "or c.AgentParking.checkpointer found none that works there)")


def _busy(lease_id: str) -> GPUPoolError:
    return GPUPoolError(Reason.worker_busy, f"a cell is running on lease {lease_id}'s worker: a park does not touch "
                        "a running cell; park it once the cell ends (or interrupt the cell)", 409)


def _parking(lease: Lease, now: datetime) -> bool:
    return lease.state == LeaseState.parking.value


def _parked_or_parking(lease: Lease, now: datetime) -> bool:
    return lease.state in (LeaseState.parked.value, LeaseState.parking.value)
