"""Agents registering and heartbeating (``/api/v1/nodes``, agent token only).

A registration upserts the node and its GPUs; a heartbeat renews the node
and carries worker reports and GPU readings. An agent that cannot read its
GPUs (NVML failed) says why in ``inventory_error``: its node is then
``degraded``, with the words in ``state_reason``; its GPU rows stay as last
known (with unknown readings), its leases go on, and nothing new is placed
there until a registration or heartbeat without the error. Worker reports
update the lease's worker state and idle time; a worker reported ``dead`` ends its
lease ``failed`` through the one release path (a parked one's too, saying
that its parked state is gone); a parked worker reported spilled to disk
moves its lease's park to disk (:func:`.parked.report`); and every reported
worker whose lease neither holds capacity nor is parked on this node comes
back in ``stop``, so no worker outlives its lease (nor a spill a lease that
moved to another node left here: a moving lease's report from the node its
state is on is left alone until the move ends, :func:`.parked.moving_from`). The last heartbeat of an
agent that stops cleanly says it is ``leaving``: its node is ``lost`` at once
(:data:`.replacing.LEAVING_REASON`), so nothing new is placed there, without waiting for
``node_ttl``; its active leases it reports spilled to disk (``c.AgentParking.park_on_stop``)
are parked there (:func:`.parked.saved_at_stop`), for the next agent on the node. A lease
whose start there the stop cut short had nothing of its user's on the node yet, so it does not
fail (:meth:`NodeBook._cut_short`): a new one goes back to the queue, in its place, and a resume
back to ``parked``; the queue places them again (on another node, or on this one once its agent is
back).
"""

from __future__ import annotations

import logging
import signal
from dataclasses import astuple
from datetime import datetime
from typing import Any, Callable

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpupool.errors import GPUPoolError, Reason, not_found
from gpupool.schema import LeaseState, WorkerState, parse_time
from gpupool.wire.nodes import (GPUInfo, Heartbeat, HeartbeatReply, NodeRegistration, RegistrationReply,
                                WorkerReport, is_node_name)

from . import cell_log, parked
from .background import Background
from .leases import LeaseBook
from .models import GPU, Lease, Node
from .replacing import LEAVING_REASON, queue_after_stop
from .rules.reclaim import PARKED_STATES, ParkCode
from .state import PoolState, Transaction

log = logging.getLogger("gpupool.service.nodes")


class NodeBook:
    """Node registration and heartbeats, written through ``state``; dead
    workers' leases end through ``leases`` (in ``tasks``, the background).
    ``heartbeat_interval``: seconds an agent is told to heartbeat;
    ``node_ttl``: seconds after which a silent node's name may be taken; ``away_for``: seconds a
    stopped agent may take to come back (``node_ttl + parked_node_grace``), the least a new lease
    whose start its stop cut short waits in the queue again."""

    def __init__(self, state: PoolState, leases: LeaseBook, tasks: Background, *, heartbeat_interval: float,
                 node_ttl: float, away_for: float = 600.0,
                 on_parked: Callable[[str, str], None] = lambda code, tier: None) -> None:
        self.state = state
        self.on_parked = on_parked  # (code, tier) of each lease its stopping agent parked
        self.leases = leases
        self.tasks = tasks
        self.heartbeat_interval = heartbeat_interval
        self.node_ttl = node_ttl
        self.away_for = away_for

    async def register(self, body: Any) -> dict[str, Any]:
        """``POST /nodes``: returns ``{"name", "heartbeat_interval", "stop"}``.
        Raises 400 for a bad body (and changes nothing)."""
        reg = NodeRegistration.from_json(body)
        stop, dead, saved = await self.state.work.write(self._register_now, reg)
        for _ in range(saved):
            self.on_parked(ParkCode.agent_stopped, "disk")
        if reg.inventory_error is None:
            log.info("node %s registered: %s, %d GPU(s), %s inventory", reg.name, reg.url, len(reg.gpus), reg.inventory)
        else:
            log.warning("node %s registered degraded: %s; its leases go on, nothing new is placed there", reg.name,
                        reg.inventory_error)
        self._end_dead(dead)
        await self.leases.drain_queue()  # its GPUs may fit requests that are waiting
        return RegistrationReply(reg.name, self.heartbeat_interval, tuple(stop)).to_json()

    def _register_now(self, reg: NodeRegistration) -> tuple[list[str], list[tuple[str, str]], int]:
        now = self.state.now()
        with self.state.writing() as tx:
            session = tx.session
            node = session.get(Node, reg.name)
            if node is None:
                node = Node(name=reg.name)
                session.add(node)
            else:
                _refuse_second_agent(node, reg.url, now, self.node_ttl)
            node.url, node.inventory, node.enforcement, node.whole_gpus = (reg.url, reg.inventory, reg.enforcement,
                                                                           reg.whole_gpus)
            node.environments = None if reg.environments is None else [env.to_json() for env in reg.environments]
            node.host_cpus, node.host_memory = reg.host_cpus, reg.host_memory
            node.checkpointer = None if reg.checkpointer is None else reg.checkpointer.to_json()
            node.parked_memory = reg.parked_memory
            node.registered_at, node.last_heartbeat_at = now, now
            _set_state(node, reg.inventory_error)
            if reg.inventory_error is None:  # a degraded node's GPUs stay as last known: it cannot list them
                self._upsert_gpus(session, node, list(reg.gpus), reg.healthy)
            tx.changes.every_gpu()  # GPUs may have come, gone or changed: the scheduler reads them all again
            reports = list(reg.workers)
            # A new agent's spills of leases still active here: its predecessor saved them at its stop,
            # and that goodbye was lost (the service was down).
            saved: list[str] = []
            stop, dead = self._apply_reports(tx, node, reports, now, saved)
            dead += self._lost_workers(session, node, reports)
        return stop, dead, len(saved)

    async def heartbeat(self, name: str, body: Any) -> dict[str, Any]:
        """``POST /nodes/{name}/heartbeat``: returns ``{"stop": [lease ids]}``.
        404 for an unknown node (the agent registers again)."""
        beat = Heartbeat.from_json(body)
        if not is_node_name(name):
            raise not_found(f"node {name[:40]!r}")  # no store can hold that name, so none is registered
        readings = [astuple(reading) for reading in beat.gpus]
        stop, dead, came_back, saved, cut = await self.state.work.write(
            self._heartbeat_now, name, list(beat.workers), readings, beat.inventory_error, beat.leaving)
        self._end_dead(dead)
        for _ in range(saved):
            self.on_parked(ParkCode.agent_stopped, "disk")
        if came_back or cut:
            await self.leases.drain_queue()  # its GPUs may fit requests that are waiting; or another node
        return HeartbeatReply(tuple(stop)).to_json()

    def _heartbeat_now(self, name, reports, readings, error, leaving=False):
        now = self.state.now()
        with self.state.writing() as tx:
            session = tx.session
            node = session.get(Node, name)
            if node is None:
                raise not_found(f"node {name}")
            was, previous = _set_state(node, error), node.last_heartbeat_at
            if leaving:
                node.state, node.state_reason = "lost", LEAVING_REASON
            came_back = was != "up" and node.state == "up"
            if node.state != was or leaving:
                if leaving:
                    log.info("node %s is lost: %s; nothing new is placed there", name, LEAVING_REASON)
                elif error is not None:
                    log.warning("node %s is degraded: %s; its leases go on, nothing new is placed there", name, error)
                else:
                    log.info("node %s is back", name)
                tx.changes.node(name)
            node.last_heartbeat_at = now
            gpus = {g.uuid: g for g in node.gpus}
            # In UUID order, the order lease creation locks GPU rows in (no deadlock).
            for uuid, used, utilization, healthy, unattributed in sorted(readings, key=lambda r: r[0]):
                if uuid in gpus:
                    gpu = gpus[uuid]
                    gpu.memory_used, gpu.utilization = used, utilization
                    if (gpu.memory_unattributed or 0) != (unattributed or 0) or healthy not in (None, gpu.healthy):
                        tx.changes.gpu_capacity([uuid])  # placement depends on these two
                    gpu.memory_unattributed = unattributed
                    if healthy is not None:
                        gpu.healthy = healthy
            saved: list[str] = []
            cut = self._cut_short(tx, node, reports, previous, now) if leaving else 0
            stop, dead = self._apply_reports(tx, node, reports, now, saved if leaving else None)
        return stop, dead, came_back, len(saved), cut

    def _cut_short(self, tx: Transaction, node: Node, reports: list[WorkerReport], previous: datetime | None,
                   now: datetime) -> int:
        """At the last heartbeat of ``node``'s stopping agent (``reports``; ``previous``: when it
        heartbeat before): the leases whose start there its stop cut short, which had nothing of
        their user's on the node yet. Each ``starting`` one (its worker, or its resume, asked of
        that agent) and each ``active`` one whose worker started after ``previous`` and that the
        agent does not report (it started during the stop, after the saves, and the agent stopped
        it unused: :meth:`.node.agent.NodeAgent.run`): a new lease is ``queued`` again, in its place
        (:func:`.replacing.queue_again`), waiting at least :attr:`away_for`; a resume is ``parked``
        again (:func:`.parked.unresumed`; a move to this node: :func:`.parked.unmoved`, on its old
        node). The start or resume still under way then finds the lease no longer ``starting``
        there and changes nothing. Returns how many; the caller drains the queue."""
        session, name = tx.session, node.name
        reported = {r.lease_id for r in reports}
        leases = session.scalars(select(Lease).where(Lease.node_name == name, Lease.state.in_(
            (LeaseState.starting.value, LeaseState.active.value)))).all()
        cut = 0
        for lease in leases:
            if lease.state == LeaseState.active.value and not (
                    lease.id not in reported and previous is not None and lease.started_at is not None
                    and lease.held_since == lease.started_at >= previous):  # a resume's span starts later
                continue
            if lease.state == LeaseState.starting.value and parked.is_resume(lease):
                words = f"its node {name}'s agent stopped while it resumed there"
                if parked.is_move(lease):
                    parked.unmoved(tx, lease, f"{words}; it stays parked on {lease.moved_from.get('node')}: "
                                   "resume again to retry", now)
                else:
                    parked.unresumed(tx, lease, f"{words}; it stays parked: resume again to retry", now)
            else:
                queue_after_stop(tx, lease, name, self.away_for, now)
            log.info("lease %s: %s", lease.id, lease.events[-1].reason)
            cut += 1
        return cut

    @staticmethod
    def _upsert_gpus(session: Session, node: Node, infos: list[GPUInfo], healthy: dict[str, bool]) -> None:
        for info in sorted(infos, key=lambda i: i.uuid):  # lock order, as in lease creation
            gpu = session.get(GPU, info.uuid)
            if gpu is None:
                gpu = GPU(uuid=info.uuid)
                session.add(gpu)
            elif gpu.node_name != node.name:
                log.warning("GPU %s moves from node %s to node %s", info.uuid, gpu.node_name, node.name)
            gpu.node_name, gpu.name, gpu.index = node.name, info.name, info.index
            gpu.memory_total, gpu.memory_reserved = info.memory_total, info.memory_reserved
            gpu.compute_capability, gpu.healthy = info.compute_capability, healthy[info.uuid]
        session.flush()
        known = {info.uuid for info in infos}
        for gpu in session.scalars(select(GPU).where(GPU.node_name == node.name)):
            if gpu.uuid not in known:
                # Leases keep a copy of the GPU's name and index, so it can go.
                log.warning("GPU %s (%s) is no longer reported by node %s", gpu.uuid, gpu.name, node.name)
                session.delete(gpu)

    @staticmethod
    def _apply_reports(tx: Transaction, node: Node, reports: list[WorkerReport], now: datetime,
                       saved: list[str] | None = None) -> tuple[list[str], list[tuple[str, str]]]:
        """Update leases from worker reports. Returns (lease ids whose workers
        must stop, (lease id, reason) of workers that died). ``saved``: given
        for the last heartbeat of a stopping agent and for a registration,
        whose reports of active leases spilled to disk park them there
        (:func:`.parked.saved_at_stop`), their ids appended: only those say so
        for sure (a heartbeat's may be older than a resume)."""
        session = tx.session
        stop: list[str] = []
        dead: list[tuple[str, str]] = []
        for report in reports:
            lease = session.get(Lease, report.lease_id)
            if lease is not None and parked.moving_from(lease) == node.name:
                continue  # its state waits here while the lease moves to another node (cleared once done)
            if lease is None or lease.node_name != node.name or not _lives(lease):
                stop.append(report.lease_id)
            elif report.execution_state == WorkerState.dead and report.parked != "disk":  # a spilled one has no process
                if lease.state != LeaseState.releasing.value:
                    dead.append((lease.id, _died(lease, report)))
            elif saved is not None and report.parked == "disk" and lease.state == LeaseState.active.value:
                parked.saved_at_stop(tx, lease, report, now)
                saved.append(lease.id)
                log.info("lease %s: %s", lease.id, parked.parked_words(lease))
            elif lease.state == LeaseState.active.value:
                _update_worker(lease, report, now)
                cell_log.record(session, lease, report, now)
            elif parked.report(tx, lease, report):
                log.info("lease %s: its parked worker is now %s on %s (%s)", lease.id, lease.park_tier, node.name,
                         "; ".join(lease.parked_lost or []) or "nothing lost")
        return stop, dead

    @staticmethod
    def _lost_workers(session: Session, node: Node, reports: list[WorkerReport]) -> list[tuple[str, str]]:
        """At registration: leases on this node whose worker lives (active, parking, parked, or
        resuming) that the (re)started agent does not report are gone with the old agent."""
        reported = {r.lease_id for r in reports}
        living = session.scalars(select(Lease).where(Lease.node_name == node.name, Lease.state.in_(
            (LeaseState.active.value, *PARKED_STATES, LeaseState.starting.value))))
        return [(lease.id, f"the {'parked ' if lease.park_tier else ''}worker was lost: the agent on {node.name} "
                           f"restarted without it{LOST_STATE if lease.park_tier else ''}")
                for lease in living if lease.id not in reported
                and (lease.state != LeaseState.starting.value or parked.is_resume(lease) and not parked.is_move(lease))]

    def _end_dead(self, dead: list[tuple[str, str]]) -> None:
        # In the background: the release path calls back into the very agent
        # that is waiting for this response.
        for lease_id, reason in dead:
            log.info("lease %s: %s", lease_id, reason)
            self.tasks.spawn(self.leases.release(lease_id, LeaseState.failed, reason))


def _refuse_second_agent(node: Node, url: str, now: datetime, node_ttl: float) -> None:
    """409 when another agent, at another URL, still heartbeats under this name:
    a second agent must not take over a live node's name (and its GPUs)."""
    last = node.last_heartbeat_at
    alive = node.state in ("up", "degraded")
    if alive and node.url != url and last is not None and (now - last).total_seconds() < node_ttl:
        raise GPUPoolError(Reason.node_name_taken, f"node name {node.name!r} belongs to the live agent at {node.url}; "
                           "give this agent another --name (or stop that agent and wait "
                           f"{node_ttl:.0f}s, c.PoolNodes.node_ttl)", 409)


def _set_state(node: Node, error: str | None) -> str:
    """Set ``node``'s state from its agent's ``inventory_error``: ``up``, or
    ``degraded`` with the words in ``state_reason`` and its GPUs' readings
    unknown. Returns the state it had."""
    was = node.state
    node.state, node.state_reason = ("up", None) if error is None else ("degraded", error)
    if error is not None:
        for gpu in node.gpus:
            gpu.memory_used = gpu.utilization = None
    return was


def death_reason(exit_code: int | None) -> str:
    """Words for a worker's end: exit code, or signal when negative."""
    if exit_code is None:
        return "the worker process died"
    if exit_code < 0:
        try:
            name = f" ({signal.Signals(-exit_code).name})"
        except ValueError:
            name = ""
        return f"the worker process was killed by signal {-exit_code}{name}"
    return f"the worker process exited with code {exit_code}"


#: Said of a parked lease whose worker is gone.
LOST_STATE = ": its variables and state there are gone"


def _lives(lease: Lease) -> bool:
    """Whether ``lease``'s worker should live on its node: it holds capacity or is parked."""
    return LeaseState(lease.state).holds_capacity or lease.state in PARKED_STATES


def _died(lease: Lease, report: WorkerReport) -> str:
    """Why ``lease``'s worker died, in words (a parked one's state is gone with it)."""
    words = report.reason or death_reason(report.exit_code)
    return f"its parked worker died ({words}){LOST_STATE}" if lease.state in PARKED_STATES else words


def _update_worker(lease: Lease, report: WorkerReport, now: datetime) -> None:
    """Copy a live worker's report onto its lease. ``idle_since`` comes from the
    agent when given (kept between the moment the lease last took its share,
    its start or its resume, and now: against clock skew, and so that a
    resumed worker's idleness from before its park does not park it again at
    once), else it starts now when the worker turns idle."""
    was = lease.worker_state
    if report.pid is not None:
        lease.worker_pid = report.pid
    lease.worker_state = report.execution_state.value
    lease.worker_memory_used = report.memory_used
    if report.execution_state == WorkerState.busy:
        lease.idle_since = None
    elif report.execution_state == WorkerState.idle:
        try:
            since = parse_time(report.idle_since)
        except (TypeError, ValueError, AttributeError):
            since = None
        if since is not None:
            lease.idle_since = min(max(since, lease.held_since or lease.started_at or since), now)
        elif was != WorkerState.idle or lease.idle_since is None:
            lease.idle_since = now
