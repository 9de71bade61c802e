"""A lease's park as the store records it: the transitions of park in place
(docs/parking.md) with what they keep on the lease. The life cycle that
decides them is :mod:`.parking`; each function here runs inside a write
transaction, on a lease row, and names what it changed (:mod:`.transitions`).

    active --begin--> parking --done--> parked --placed--> starting --resumed--> active
                         |                ^                    |
                         +--kept--> active +---unresumed/unmoved+  (the agent could not)

- :func:`begin`: the share stays held while the agent moves the GPU state.
- :func:`done`: the share is given back in the same transaction (the state
  stops holding capacity); the span of usage ends (:func:`.usage.close_span`);
  the worker's connection stays while it lives in memory.
- :func:`placed`: a resume found room on the lease's own node (the queue,
  :mod:`.lease_queue`); the time parked is counted (``parked_seconds``). Room
  on another node (``c.PoolLeases.resume_moves``) is a move
  (:func:`moving`): the lease takes the new node's GPUs, gives back the claim
  on its old ones, and keeps where its state is (``moved_from``) until
  :func:`resumed` (the new node's worker took it) or :func:`unmoved` (back
  to ``parked`` on the old node, whose memory or disk still has it).
- :func:`spilled`: the old node's agent spilled it for the move (its tier and
  what was lost, as a park's).
- :func:`resumed`: active again, with the connection the agent answered (a
  new worker's after a spill) and a new span of usage; the park is cleared.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select

from gpupool.schema import LeaseState, WorkerState, isoformat
from gpupool.units import format_bytes, format_duration
from gpupool.wire.nodes import WorkerReport
from gpupool.wire.parking import WorkerParked, WorkerResumed

from . import usage
from .models import GPU, Lease, LeaseGPU, Node
from .rules.reclaim import FREEZE, REFUSE, ParkCode, is_busy
from .rules.resume import Resume
from .rules.scheduler import Placement
from .state import Transaction
from .transitions import transition

#: Where the state of a lease parked in each tier is, in words.
TIER_WORDS = {"memory": "in memory", "disk": "on disk (spilled)"}


def running_cell(code: str | None) -> str:
    """What a park for ``code`` does with a running cell: preemption freezes it, anything else refuses."""
    return FREEZE if code == ParkCode.preemption else REFUSE


def begin(tx: Transaction, lease: Lease, code: str, reason: str, tier: str, now: datetime) -> None:
    """``active`` -> ``parking`` for ``code`` (:class:`.rules.reclaim.ParkCode`), ``reason``
    (words), to ``tier`` (``memory`` or ``disk``). The share stays held until :func:`done`."""
    clear(lease)
    lease.park_code, lease.park_reason, lease.park_tier, lease.parked_at = str(code), reason, tier, now
    transition(tx, lease, LeaseState.parking, f"parking ({TIER_WORDS[tier]}): {reason}", now)


def done(tx: Transaction, lease: Lease, answer: WorkerParked, now: datetime) -> None:
    """``parking`` -> ``parked`` with the agent's figures: the share is given back (its GPUs are
    named in the change set), the span of usage is closed, the connection kept unless spilled."""
    usage.close_span(tx.session, lease, now)
    lost = list(answer.lost)
    if answer.interrupted and not any("interrupt" in words for words in lost):
        lost.append("the running cell was interrupted (its checkpointer cannot freeze a running cell)")
    lease.park_tier, lease.park_checkpointer = answer.tier, answer.checkpointer or None
    lease.parked_host_bytes = answer.host_bytes if answer.tier == "memory" else 0
    lease.parked_disk_bytes, lease.gpu_bytes_moved = answer.disk_bytes, answer.gpu_bytes_moved
    lease.gpu_bytes_kept, lease.parked_lost, lease.parked_at = answer.gpu_bytes_kept, lost, now
    if answer.reason:  # the agent spilled what was asked in memory: say why
        lease.park_reason = f"{lease.park_reason}; to disk: {answer.reason}"
    if answer.tier == "disk":
        lease.connection = None  # the worker's process ended; resume starts a new one
    transition(tx, lease, LeaseState.parked, parked_words(lease), now)


def parked_words(lease: Lease) -> str:
    """``'parked in memory on node-1 (12.0 GiB moved off GPU 0): idle for 30m (...)'``, and what was lost."""
    moved = f" ({format_bytes(lease.gpu_bytes_moved)} moved off the GPU)" if lease.gpu_bytes_moved else ""
    lost = f"; not kept: {'; '.join(lease.parked_lost)}" if lease.parked_lost else ""
    return f"parked {TIER_WORDS.get(lease.park_tier, 'in memory')} on {lease.node_name}{moved}: {lease.park_reason}{lost}"


def kept(tx: Transaction, lease: Lease, why: str, now: datetime) -> None:
    """``parking`` -> ``active`` again: the agent did not park it (``why``, words); it holds its share as before."""
    clear(lease)
    transition(tx, lease, LeaseState.active, f"not parked: {why}", now)


def placed(tx: Transaction, lease: Lease, decision: Placement, now: datetime) -> str:
    """``parked`` -> ``starting`` on ``decision`` (its own node; its GPUs, or others of the same
    model where the checkpointer can remap): it holds a share again. Returns where, in words.
    ``decision`` on another node is a move (:func:`moving`)."""
    if decision.node != lease.node_name:
        return moving(tx, lease, decision, now)
    leave(lease, now)
    if tuple(g.gpu_uuid for g in lease.gpus) != decision.gpus:
        gpus = {g.uuid: g for g in tx.session.scalars(select(GPU).where(GPU.uuid.in_(decision.gpus)))}
        tx.changes.gpu_capacity([g.gpu_uuid for g in lease.gpus])  # the kept bytes leave them
        lease.gpus = [LeaseGPU(gpu_uuid=u, name=gpus[u].name, index=gpus[u].index) for u in decision.gpus]
    if decision.cpus is not None and decision.host_memory is not None:  # a default host share, placed anew
        lease.cpus, lease.host_memory = decision.cpus, decision.host_memory
    lease.resume_requested_at, lease.resume_in_place = None, False
    where = ", ".join(f"GPU {g.index} ({g.name})" for g in lease.gpus)
    transition(tx, lease, LeaseState.starting, f"resuming on {decision.node}: {where}", now)
    return f"{decision.node} {where}"


def moving(tx: Transaction, lease: Lease, decision: Placement, now: datetime) -> str:
    """``parked`` -> ``starting`` on ``decision``, another node's GPUs (a move,
    ``c.PoolLeases.resume_moves``): the lease takes them (its node, GPUs and host reservation are
    the new ones), the claim its park held on its old GPUs is given back (named in the change
    set), and where its state still is goes to ``moved_from`` for the move
    (:meth:`.parking.Parking.resume_worker`) and for :func:`unmoved`. Returns where, in words."""
    leave(lease, now)
    old = lease.node_name
    tx.changes.gpu_capacity([g.gpu_uuid for g in lease.gpus])  # the claim and the kept bytes leave them
    lease.moved_from = {"node": old, "gpus": [{"uuid": g.gpu_uuid, "name": g.name, "index": g.index}
                                              for g in lease.gpus],
                        "cpus": lease.cpus, "host_memory": lease.host_memory}
    gpus = {g.uuid: g for g in tx.session.scalars(select(GPU).where(GPU.uuid.in_(decision.gpus)))}
    lease.gpus = []  # the old rows go before the new ones are written
    tx.session.flush()
    lease.node_name, lease.cpus, lease.host_memory = decision.node, decision.cpus, decision.host_memory
    lease.gpus = [LeaseGPU(gpu_uuid=u, name=gpus[u].name, index=gpus[u].index) for u in decision.gpus]
    lease.resume_requested_at, lease.resume_in_place = None, False
    where = ", ".join(f"GPU {g.index} ({g.name})" for g in lease.gpus)
    transition(tx, lease, LeaseState.starting, moving_words(old, decision.node, where, lease.park_tier), now)
    return f"{decision.node} {where} (moved from {old})"


def moving_words(old: str, new: str, where: str, tier: str | None) -> str:
    """The event of a move of a lease parked in ``tier``: ``'moving to node-2 (GPU 0 (A100)):
    node-1 has no room; ...'``."""
    if tier == "memory":
        how = f"from its worker on {old} to a new worker on {new}, worker to worker (what cannot be moved is named)"
    else:
        how = f"from {old}'s disk to a new worker on {new} (what cannot be saved to disk is named)"
    return f"moving to {new} ({where}): {old} has no room; its state goes {how}"


def is_move(lease: Lease) -> bool:
    """Whether ``lease`` (``starting``) resumes on another node than the one its state is on."""
    return bool(lease.moved_from)


def moving_from(lease: Lease) -> str | None:
    """The node a moving ``lease`` (``starting``) has its state on; None when it is not moving
    (its agent's reports of it are kept until the move ends: :mod:`.nodes`)."""
    if lease.state != LeaseState.starting.value or not lease.moved_from:
        return None
    return lease.moved_from.get("node")


def spilled(tx: Transaction, lease: Lease, answer: WorkerParked) -> None:
    """The old node's agent answered the move's spill (``tier: disk``): the park's tier and
    figures are the answer's (no host memory held, the bytes on disk), what it lost is added."""
    lost = [*(lease.parked_lost or []), *(w for w in answer.lost if w not in (lease.parked_lost or []))]
    lease.park_tier, lease.parked_host_bytes, lease.parked_lost = answer.tier, 0, lost
    lease.parked_disk_bytes = answer.disk_bytes or lease.parked_disk_bytes
    lease.connection = None  # the frozen process ended; the move starts a new one
    tx.changes.gpu_capacity(moving_gpus(lease))  # its old node's host RAM is free (.capacity.moving_host_bytes)
    tx.changes.lease(lease.id)


def moving_gpus(lease: Lease) -> list[str]:
    """The UUIDs of the GPUs a moving ``lease`` left (``moved_from``), whose node's host counts its
    frozen worker's RAM until the spill (:func:`.capacity.moving_host_bytes`): a writer that changes
    that names them. Empty when it is not moving."""
    return [g["uuid"] for g in (lease.moved_from or {}).get("gpus", ())]


def unmoved(tx: Transaction, lease: Lease, why: str, now: datetime) -> None:
    """A move that failed (``why``, words): ``starting`` on the new node -> ``parked`` on the old
    one with its old GPUs and host reservation (its state is still there); the new node's share
    is given back (named in the change set) and no resume waits until one is asked for again."""
    back = lease.moved_from or {}
    tx.changes.gpu_capacity([g.gpu_uuid for g in lease.gpus])
    lease.gpus = []
    tx.session.flush()
    lease.node_name, lease.cpus, lease.host_memory = back.get("node"), back.get("cpus"), back.get("host_memory")
    lease.gpus = [LeaseGPU(gpu_uuid=g["uuid"], name=g["name"], index=g["index"]) for g in back.get("gpus", ())]
    lease.moved_from = None
    unresumed(tx, lease, why, now)


def resumed(tx: Transaction, lease: Lease, answer: WorkerResumed, now: datetime) -> str:
    """Resumed: ``starting`` -> ``active`` with the agent's connection and a new span of usage;
    the park (and a move's ``moved_from``) is cleared. Returns the event's words."""
    tier = lease.park_tier or answer.tier
    lease.connection, lease.worker_pid = answer.connection, answer.pid if answer.pid is not None else lease.worker_pid
    lease.last_heartbeat_at = lease.held_since = now
    if not is_busy(lease) or tier == "disk":  # a cell frozen mid-way goes on; else idle from now
        lease.worker_state, lease.idle_since = WorkerState.idle.value, now
    moved = (lease.moved_from or {}).get("node")
    # A move's spill said what it could not save; the new worker says what did not load.
    said = [*(lease.parked_lost or []), *answer.lost] if moved else list(answer.lost)
    said = list(dict.fromkeys(said))
    lost = f"; not kept: {'; '.join(said)}" if said else ""
    where = f"{lease.node_name} (moved from {moved})" if moved else lease.node_name
    words = f"resumed on {where} from {'disk' if tier == 'disk' else 'memory'} in " \
            f"{format_duration(answer.seconds) if answer.seconds >= 1 else f'{answer.seconds:.2f}s'}{lost}"
    clear(lease)
    transition(tx, lease, LeaseState.active, words, now)
    return words


def unresumed(tx: Transaction, lease: Lease, why: str, now: datetime) -> None:
    """A resume the agent could not do (``why``, words): ``starting`` -> ``parked`` again, its
    share given back; no resume waits until one is asked for again. The park goes on: its
    ``parked_at`` is kept ("parked for" counts from the park, not from this failure), and the time
    :func:`leave` counted at the resume's placement is taken back, so that the park's end counts
    it all once, the failed try included (no usage span was open during it)."""
    placed_at = next((e.at for e in reversed(lease.events) if e.state == LeaseState.starting.value), None)
    if lease.parked_at is not None and placed_at is not None:
        counted = max(0.0, (placed_at - lease.parked_at).total_seconds())
        lease.parked_seconds = max(0.0, (lease.parked_seconds or 0.0) - counted)
    lease.resume_requested_at, lease.resume_in_place = None, False
    transition(tx, lease, LeaseState.parked, why, now)


def leave(lease: Lease, now: datetime) -> None:
    """Count the time parked (``parked_seconds``) as ``lease`` leaves ``parked`` (a resume, its end)."""
    if lease.state == LeaseState.parked.value and lease.parked_at is not None:
        lease.parked_seconds = (lease.parked_seconds or 0.0) + max(0.0, (now - lease.parked_at).total_seconds())


def clear(lease: Lease) -> None:
    """Forget the park (its figures and a resume asked for)."""
    lease.park_tier = lease.park_code = lease.park_reason = lease.parked_at = lease.park_checkpointer = None
    lease.parked_host_bytes = lease.parked_disk_bytes = lease.gpu_bytes_moved = lease.gpu_bytes_kept = None
    lease.parked_lost = lease.resume_requested_at = lease.moved_from = None


def is_resume(lease: Lease) -> bool:
    """Whether ``lease`` (``starting``) is resuming from a park rather than starting its first worker."""
    return lease.park_tier is not None


def report(tx: Transaction, lease: Lease, got: WorkerReport) -> bool:
    """A parked lease's worker report: a spill the agent made on its own (``parked``
    ``disk``) moves the park to disk, its host RAM back (0) and what it lost added.
    Returns True when the park changed."""
    if lease.state != LeaseState.parked.value or got.parked is None:
        return False
    host = 0 if got.parked == "disk" else got.parked_host_bytes
    lost = [*(lease.parked_lost or []), *(w for w in got.parked_lost if w not in (lease.parked_lost or []))]
    changed = (got.parked, host, lost) != (lease.park_tier, lease.parked_host_bytes, lease.parked_lost or [])
    if host is None or not changed:
        return False
    if got.parked == "disk" and lease.park_tier != "disk":
        lease.connection = None  # the agent ended the frozen process
    lease.park_tier, lease.parked_host_bytes, lease.parked_lost = got.parked, host, lost
    if got.parked == "disk" and got.parked_disk_bytes is not None:
        lease.parked_disk_bytes = got.parked_disk_bytes
    tx.changes.gpu_capacity([g.gpu_uuid for g in lease.gpus])  # its node's host room changed
    tx.changes.lease(lease.id)
    return True


def saved_at_stop(tx: Transaction, lease: Lease, got: WorkerReport, now: datetime) -> None:
    """``active`` -> ``parked`` on disk: its node's agent, stopping (``c.AgentParking.park_on_stop``),
    saved the worker to its spill folder and ended it (``got``: the report of its last heartbeat).
    The share is given back, as :func:`done` does; the next cell resumes the lease once an agent
    runs on that node again (the reclaim sweep ends it after ``c.PoolNodes.parked_node_grace``
    if none does)."""
    words = (f"the node agent on {lease.node_name} was stopped (a restart or an upgrade, say) and saved the "
             "worker to that node's disk: the next cell resumes it once the agent is back")
    begin(tx, lease, ParkCode.agent_stopped, words, "disk", now)
    done(tx, lease, WorkerParked("disk", disk_bytes=got.parked_disk_bytes or 0, lost=tuple(got.parked_lost)), now)


def resume_ask(lease: Lease, node: Node | None, host_share: float | None = None) -> Resume:
    """What ``lease`` (parked, its GPUs loaded) needs to resume on its ``node`` (:mod:`.rules.resume`);
    a cell frozen mid-way in memory may not move (:func:`may_move`), nor a lease whose node is
    lost (no agent there hands its state over: it waits for it); ``host_share``
    (``c.PoolNodes.host_share``): where the lease asked no host, it asks the default share again."""
    remap = bool((node.checkpointer or {}).get("remap")) if node is not None else False
    reachable = node is not None and node.state != "lost"
    return Resume(lease.node_name, tuple(g.gpu_uuid for g in lease.gpus), lease.gpus[0].name if lease.gpus else "",
                  lease.fraction, lease.gpu_count, lease.memory, lease.cpus, lease.host_memory,
                  lease.parked_host_bytes or 0, lease.gpu_bytes_kept or 0, remap, lease.env,
                  reachable and may_move(lease, True),
                  lease.park_code == ParkCode.preemption,
                  host_share if lease.requested_cpus is None and lease.requested_host_memory is None else None)


def may_move(lease: Lease, moves: bool) -> bool:
    """Whether ``lease``'s resume may go to another node when its own has no room: ``moves``
    (``c.PoolLeases.resume_moves``) allows it, the resume was not asked only ahead of a cell
    (``resume_in_place``: a move loses what cannot be saved to disk, which only a cell that needs
    the worker may cost), and no cell is frozen mid-way in memory (only a preemption freezes a
    running cell; any other park is refused while one runs, so a ``busy`` reported before such a
    park is stale)."""
    frozen_cell = lease.park_tier == "memory" and lease.park_code == ParkCode.preemption and is_busy(lease)
    return moves and not lease.resume_in_place and not frozen_cell


def shown(lease: Lease, estimate: float | None, moves: bool = False) -> dict[str, Any] | None:
    """The lease JSON's ``parked`` object (``gpupool.wire.leases.PARKED_PROPERTIES``) while it
    is parking, parked or resuming; None otherwise. ``estimate``: seconds a resume takes;
    ``moves``: ``c.PoolLeases.resume_moves`` (for ``may_move``)."""
    if lease.park_tier is None or lease.state not in (LeaseState.parking.value, LeaseState.parked.value,
                                                      LeaseState.starting.value):
        return None
    parking = lease.state == LeaseState.parking.value
    return {"tier": None if parking else lease.park_tier, "since": isoformat(lease.parked_at),
            "reason": lease.park_reason or "", "checkpointer": lease.park_checkpointer,
            "host_bytes": lease.parked_host_bytes or 0, "disk_bytes": lease.parked_disk_bytes or 0,
            "gpu_bytes_moved": lease.gpu_bytes_moved or 0, "gpu_bytes_kept": lease.gpu_bytes_kept or 0,
            "lost": list(lease.parked_lost or []),
            "resume_requested": lease.resume_requested_at is not None or lease.state == LeaseState.starting.value,
            "resume_estimate_s": estimate, "may_move": may_move(lease, moves), "moving_from": moving_from(lease)}
