"""The lease life cycle: the one place a lease changes state (:class:`LeaseBook`:
start, release, and the hand-off to parking). Its public methods are
coroutines for the event loop; their SQL runs on a store thread in functions
named ``_..._now``, which must not touch the loop. The states and who moves a
lease between them: docs/code.md, "The lease life cycle".
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any, Awaitable, Callable

from sqlalchemy import select, update

from gpupool.errors import GPUPoolError, Reason, bad_request
from gpupool.schema import LeaseState, WorkerState
from gpupool.wire.workers import WorkerStarted

from . import parked
from .agent_client import AgentGone
from .auth import Identity
from .background import Background
from .config import PoolNodes
from .lease_queue import Drained, LeaseQueue
from .lease_views import LeaseViews
from .models import Lease, Node
from .replacing import LEAVING_REASON, PlacedAgain, place_again, queue_after_stop
from .rules.reclaim import PARKED_STATES
from .state import PoolState
from .transitions import end, is_queued, still_queued, transition
from .worker_calls import StartJob, WorkerCalls

log = logging.getLogger("gpupool.service.leases")


class LeaseBook:
    """Starts and ends leases, and places and expires what waits.

    ``pool_nodes``: the service's ``worker_stop_timeout``; ``state`` the store and its
    clock; ``workers`` asks the agents; ``tasks`` runs what goes on in the
    background; ``views`` gives the lease JSON; ``queue`` drains the queue;
    ``resume_worker(job)`` asks the agent to resume a lease placed from a park
    (:meth:`.parking.Parking.resume_worker`).
    """

    def __init__(self, pool_nodes: PoolNodes, state: PoolState, workers: WorkerCalls, tasks: Background,
                 views: LeaseViews, queue: LeaseQueue,
                 resume_worker: Callable[[StartJob], Awaitable[None]] | None = None) -> None:
        self.pool_nodes = pool_nodes
        self.state = state
        self.workers = workers
        self.tasks = tasks
        self.views = views
        self.queue = queue
        self.resume_worker = resume_worker
        # Lease id -> the nodes whose agent could not be reached for its worker's start, in order
        # (:meth:`_place_again`); until it starts or ends. A restart forgets them: one more try each.
        self._tried: dict[str, list[str]] = {}

    # -- starting --------------------------------------------------------------

    async def start(self, lease_id: str, job: StartJob | None = None,
                    who: Identity | None = None) -> dict[str, Any] | None:
        """Ask the agent for the worker (or, for a lease resuming from a park, to
        resume it); ``active`` on success. When the agent could not be reached
        (``agent_unreachable``) the lease is placed on another node and started
        there, or queued again (:mod:`.replacing`; each node tried once); when the
        agent answered with an error the release path ends the lease
        ``failed`` with the agent's reason. ``job``: what to ask, when the
        caller read it in the transaction that placed the lease (a new lease:
        one store read less before the agent is asked); else it is read now, and
        nothing is done unless the lease is ``starting``. ``who``: the caller
        waits for the start (``POST /leases?start_wait=``); returns the lease
        JSON as ``who`` sees it once ``active``, made in the transaction that
        made it so (no read after it). Else, or when it did not start, None."""
        job = job or await self.workers.job(lease_id)
        if job is None:
            return None
        if job.resume:
            await self.resume_worker(job)
            return None
        while True:
            try:
                started = await self.workers.start(job)
                break
            except GPUPoolError as exc:
                log.warning("lease %s: worker start on %s failed: %s", lease_id, job.node, exc.message)
                if exc.code == Reason.agent_stopping:  # nothing of the user's there yet: in line again
                    if await self.state.work.write(self._queued_after_stop_now, lease_id, job.node, job.url):
                        await self.drain_queue()
                    return None
                if isinstance(exc, AgentGone):  # nothing new goes there until its agent heartbeats again
                    await self.state.work.write(self._agent_gone_now, job.node, job.url)
                if exc.code == Reason.agent_unreachable:  # not the request's fault: another node may have room
                    job = await self._place_again(lease_id, job, exc.message)
                    if job is not None:
                        continue
                    return None
                await self.release(lease_id, LeaseState.failed,
                                   f"the worker could not start on {job.node}: {exc.message}",
                                   only_if=lambda lease, now: _starting_on(lease, job.node))
                return None
        self._tried.pop(lease_id, None)
        shown = await self.state.work.write(self._started_now, lease_id, started, job.node, who)
        if shown is not None:
            log.info("lease %s active: worker pid %s on %s", lease_id, started.pid, job.node)
            return shown or None
        # Released while the worker was starting (the release path may have asked the agent
        # before the worker existed), or queued again (its agent stopped): stop it now.
        log.info("lease %s left starting on %s while its worker started; stopping the worker there", lease_id,
                 job.node)
        await self.workers.stop(job.url, lease_id)
        return None

    async def _place_again(self, lease_id: str, job: StartJob, words: str) -> StartJob | None:
        """After the agent of ``job``'s node could not be reached (``words``): the
        job on another node (:func:`.replacing.place_again`); None when the lease
        is queued again, ended ``failed`` here (every node with room tried, or a
        node tried before that failed again: at most one try per node), or
        is no longer ``starting`` there (released meanwhile)."""
        tried = self._tried.setdefault(lease_id, [])
        again = job.node in tried  # the queue may place it on a node that came back: once more is the last
        if not again:
            tried.append(job.node)
        outcome = await self.state.work.write(self._place_again_now, lease_id, job.node, tuple(tried), words, again)
        if outcome is None:
            return None
        if outcome.failed is not None:
            await self.release(lease_id, LeaseState.failed, outcome.failed)
        return outcome.job

    def _place_again_now(self, lease_id: str, node: str, tried: tuple[str, ...], words: str,
                         again: bool) -> PlacedAgain | None:
        now = self.state.now()
        with self.state.writing() as tx:
            self.state.store.lock_capacity(tx.session)
            lease = tx.session.get(Lease, lease_id)
            if lease is None or lease.state != LeaseState.starting.value or lease.node_name != node:
                return None
            if again:
                return PlacedAgain(failed=f"the worker could not start on {node}: {words}; {node} was tried "
                                          f"before (nodes tried: {', '.join(tried)})")
            return place_again(tx, lease, self.queue.placer, self.pool_nodes.host_share, tried, words, now)

    def _queued_after_stop_now(self, lease_id: str, node_name: str, url: str) -> bool:
        """The agent of ``node_name`` (at ``url``) answered the lease's start that it is stopping:
        the node is ``lost`` now (as its last heartbeat would make it: nothing new goes there
        until an agent registers again) and the lease, if still ``starting`` there, ``queued``
        again in its place (:func:`.replacing.queue_after_stop`). False when it was not."""
        now = self.state.now()
        with self.state.writing() as tx:
            self.state.store.lock_capacity(tx.session)
            node = tx.session.get(Node, node_name)
            if node is not None and node.url == url and node.state != "lost":
                node.state, node.state_reason = "lost", LEAVING_REASON
                tx.changes.node(node_name)
            lease = tx.session.get(Lease, lease_id)
            if lease is None or not _starting_on(lease, node_name):
                return False
            nodes = self.pool_nodes
            queue_after_stop(tx, lease, node_name, nodes.node_ttl + nodes.parked_node_grace, now)
            return True

    def _agent_gone_now(self, node_name: str, url: str) -> None:
        """The node's agent refused a connection at ``url``: the node is ``lost``
        now, rather than after ``node_ttl`` (its next heartbeat makes it ``up``
        again: an agent restarted at the same URL)."""
        with self.state.writing() as tx:
            node = tx.session.get(Node, node_name)
            if node is None or node.url != url or node.state == "lost":
                return
            node.state, node.state_reason = "lost", f"its agent at {url} refused a connection (it is not running)"
            tx.changes.node(node_name)
        log.warning("node %s lost: its agent at %s refused a connection; nothing new is placed there", node_name, url)

    def _started_now(self, lease_id: str, started: WorkerStarted, node_name: str,
                     who: Identity | None) -> dict[str, Any] | None:
        """``starting`` -> ``active`` with the worker's connection; returns the lease JSON as ``who``
        sees it (``{}`` without ``who``), None when the lease left ``starting`` on ``node_name``
        (released, or queued again and perhaps placed elsewhere: :meth:`.nodes.NodeBook._cut_short`)."""
        now = self.state.now()
        with self.state.writing() as tx:
            lease = tx.session.get(Lease, lease_id)
            if lease is None or not _starting_on(lease, node_name):
                return None
            lease.connection = started.connection
            lease.worker_pid = started.pid
            lease.worker_state = WorkerState.idle.value  # the kernel answered, no cell has run yet
            lease.started_at = lease.last_heartbeat_at = lease.idle_since = lease.held_since = now
            transition(tx, lease, LeaseState.active, f"the worker started on {node_name} (pid {started.pid})",
                       now)
            return self.views.json(lease, who, tx.session) if who is not None else {}

    # -- heartbeats --------------------------------------------------------------

    async def heartbeat(self, who: Identity, lease_id: str) -> dict[str, Any]:
        """The client's liveness: renew ``last_heartbeat_at`` while the lease
        holds capacity. Returns the lease (ended ones too, so the client learns why)."""
        return await self.state.work.write(self._heartbeat_now, who, lease_id)

    def _heartbeat_now(self, who: Identity, lease_id: str) -> dict[str, Any]:
        with self.state.writing() as tx:
            lease = self.views.visible(tx.session, who, lease_id, owner_only=True)
            if LeaseState(lease.state).holds_capacity or lease.state in PARKED_STATES:  # its kernel is alive
                lease.last_heartbeat_at = self.state.now()
            return self.views.json(lease, who, tx.session, self.views.queue_view(tx.session, [lease]))

    # -- ending ----------------------------------------------------------------------

    async def release_by(self, who: Identity, lease_id: str, words: str | None) -> dict[str, Any]:
        """``DELETE /leases/{id}`` by its owner or an admin. Idempotent: an
        ended lease is returned as it is."""
        if words is not None and (not words.strip() or len(words) > 200):
            raise bad_request("'reason' must be 1 to 200 characters")
        owner = await self.views.owner(who, lease_id)
        by = "its owner" if owner == who.name else f"admin {who.name}"
        reason = f"released by {by}" + (f": {words.strip()}" if words else "")
        await self.release(lease_id, LeaseState.released, reason)
        return await self.views.get(who, lease_id)

    async def release(self, lease_id: str, final: LeaseState, reason: str, *, code: str | None = None,
                      only_if: Callable[[Lease, datetime], bool] | None = None) -> None:
        """The one release path. Ends ``lease_id`` in ``final`` (released,
        reclaimed or failed) for ``reason`` (words); ``code``: a reclaim's
        :class:`.rules.reclaim.Reclaim`, kept for the metrics. Returns once it has ended.

        ``only_if(lease, now)`` is re-checked under the write lock (reclaim
        uses it so a lease that became busy meanwhile is kept). A lease that
        is already releasing is waited for; an ended one is left alone. An
        unreachable agent does not stop the release.
        """
        self._tried.pop(lease_id, None)  # it ends (or is kept by only_if: then it is not starting)
        begun = await self.state.work.write(self._begin_release, lease_id, final, reason, code, only_if)
        if begun is None:
            return
        mine, url, ended = begun
        if not mine:  # someone else is releasing it: wait for them
            await self.views.wait_out(lease_id, LeaseState.releasing.value, self.pool_nodes.worker_stop_timeout + 5)
            return
        log.info("lease %s releasing (%s): %s", lease_id, final.value, reason)
        note = await self.workers.stop(url, lease_id) if url else None
        if not ended:
            await self._finish(lease_id, note)
            return
        if note and final is not LeaseState.failed:  # parked, so ended already: its words follow
            await self.state.work.write(self._note_now, lease_id, note)
        await self.drain_queue()  # the host memory it held

    def _begin_release(self, lease_id: str, final: LeaseState, reason: str, code: str | None,
                       only_if: Callable[[Lease, datetime], bool] | None) -> tuple[bool, str | None, bool] | None:
        """Make the lease ``releasing``: ``(True, agent url or None, False)``; a parked one (it holds
        no share, nothing to give back) ends at once: ``(True, url, True)``; ``(False, None, False)``
        when someone else is releasing it; None when there is nothing to do."""
        now = self.state.now()
        with self.state.writing() as tx:
            lease = tx.session.get(Lease, lease_id)
            if lease is None or LeaseState(lease.state).ended:
                return None
            if lease.state == LeaseState.releasing.value:
                return False, None, False
            if only_if is not None and not only_if(lease, now):
                return None
            lease.end_state, lease.reason = final.value, reason
            lease.reclaim_code = None if code is None else str(code)  # the plain value, for every driver
            was_parked = lease.state == LeaseState.parked.value
            parked.leave(lease, now)
            tx.changes.gpu_capacity(parked.moving_gpus(lease))  # a move's old node counts it no more
            parked.clear(lease)  # whatever its park held goes with it
            transition(tx, lease, LeaseState.releasing, reason, now)
            if lease.node_name is None or was_parked:
                # Never placed (queued), or parked: no capacity to free, so it ends here,
                # and a long poll wakes to its final state, not to releasing.
                end(tx, lease, now)
                if lease.node_name is None:
                    return None
            return True, tx.session.get(Node, lease.node_name).url, was_parked

    def _note_now(self, lease_id: str, note: str) -> None:
        """Add ``note`` (the worker's stop was not confirmed) to an ended lease's reason."""
        with self.state.writing() as tx:
            lease = tx.session.get(Lease, lease_id)
            if lease is not None and LeaseState(lease.state).ended:
                lease.reason = f"{lease.reason}; {note}"
                tx.changes.lease(lease_id)

    async def _finish(self, lease_id: str, note: str | None = None) -> None:
        self.after_drain(await self.state.work.write(self._finish_now, lease_id, note))

    def _finish_now(self, lease_id: str, note: str | None = None) -> Drained:
        """``releasing`` -> its final state; records ``ended_at`` and usage
        (the ledger record) once, and places queued requests on what it freed,
        all in one transaction. ``note``: words added to the reason of a
        released or reclaimed lease (the worker's stop was not confirmed; a
        failed lease's worker is dead or never started, so no news there)."""
        now = self.state.now()
        with self.state.writing() as tx:
            self.state.store.lock_capacity(tx.session)  # the queue is drained below
            lease = tx.session.get(Lease, lease_id)
            if lease is None or lease.state != LeaseState.releasing.value:
                return Drained()
            end(tx, lease, now, note)
            return self.queue.drain_in(tx, now)

    # -- the queue -------------------------------------------------------------------------

    async def drain_queue(self, *, sweep: bool = False) -> list[str]:
        """Place queued requests that fit now and start them (the reclaim sweep,
        node registrations and nodes coming back call this; releases drain in
        their own transaction). ``sweep``: the periodic call
        (:meth:`.lease_queue.LeaseQueue.drain`). Returns the ids placed."""
        drained = await self.queue.drain(sweep=sweep)
        self.after_drain(drained)
        return drained.placed

    async def expire_queue(self) -> list[str]:
        """End ``failed`` every queued request whose ``wait`` has passed; returns their ids."""
        reasons = await self.queue.expired()
        for lease_id, reason in reasons.items():
            self.tasks.spawn(self.release(lease_id, LeaseState.failed, reason, only_if=still_queued))
        return list(reasons)

    def after_drain(self, drained: Drained) -> None:
        """On the loop, after a drain committed: start what it placed, fail what it must."""
        for lease_id in drained.placed:
            self.tasks.spawn(self.start(lease_id))
        for lease_id, why in drained.over.items():
            self.tasks.spawn(self.release(lease_id, LeaseState.failed, why, only_if=is_queued))

    # -- after a restart ----------------------------------------------------------------------

    async def resume(self) -> None:
        """Pick up what a previous run left half-done: start the workers of
        ``starting`` leases (agents start idempotently per lease; a lease
        resuming from a park is resumed) and finish ``releasing`` ones (a
        ``parking`` one is the park's peer's, :meth:`.parking.Parking.restart`).
        Clients and agents could not reach a stopped service, so their
        heartbeat clocks restart now: an outage longer than the heartbeat TTL
        must not reclaim every healthy lease, parked ones neither."""
        for lease_id, state in await self.state.work.write(self._resume_now):
            log.info("lease %s was %s when the service stopped; resuming", lease_id, state)
            if state == LeaseState.starting.value:
                self.tasks.spawn(self.start(lease_id))
            else:
                self.tasks.spawn(self._resume_release(lease_id))

    def _resume_now(self) -> list[tuple[str, str]]:
        now = self.state.now()
        with self.state.writing() as tx:
            tx.session.execute(update(Lease).where(Lease.state.in_((LeaseState.active.value, *PARKED_STATES)))
                               .values(last_heartbeat_at=now))
            tx.session.execute(update(Node).where(Node.state.in_(("up", "degraded"))).values(last_heartbeat_at=now))
        unfinished = [LeaseState.starting.value, LeaseState.releasing.value]
        with self.state.reading() as session:
            return [tuple(row) for row in session.execute(
                select(Lease.id, Lease.state).where(Lease.state.in_(unfinished))).all()]

    async def _resume_release(self, lease_id: str) -> None:
        url = await self.workers.node_url(lease_id)
        await self._finish(lease_id, await self.workers.stop(url, lease_id) if url else None)


def _starting_on(lease: Lease, node: str) -> bool:
    """Whether ``lease`` is still ``starting`` on ``node`` (not ended, nor queued again and placed anew)."""
    return lease.state == LeaseState.starting.value and lease.node_name == node
