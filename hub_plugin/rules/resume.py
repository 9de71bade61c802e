"""Resuming a parked lease: where it may go back, and roughly how long that
takes. Pure: a parked lease's ask, the GPU and host states of its node in,
a placement (or why not) and seconds out. The queue (:mod:`.queue`) calls
:func:`place` for each resume waiting, ahead of new requests of its class.

Its worker lives on its node (frozen there, or spilled to that node's disk),
so a parked lease resumes on its own node only:

- on the GPU(s) it had, first: they must have room for its slice again
  (fraction and memory; the GPU memory its checkpointer could not free,
  ``gpu_bytes_kept``, is its own and counts as room), and its host room for
  its cores and host memory (what its parked state holds there now,
  ``parked_host_bytes``, is given back as it resumes);
- else, where the node's checkpointer can restore onto another GPU
  (``remap``), another GPU of the same model on that node, chosen as the
  scheduler chooses (:func:`.scheduler.place`);
- else, where moves are allowed (``c.PoolLeases.resume_moves``), on
  another node with room on GPUs of the same model (:func:`place_elsewhere`:
  a move; its state goes to a new worker there, from the old worker's memory
  over the network, or from its node's disk when it was spilled);
- else it waits (a :class:`.scheduler.Refusal` saying why).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Collection, Mapping, Sequence

from .hosts import HostState
from .scheduler import Demand, GPUState, Placement, Refusal, place as place_demand
from .workload import DEFAULT_WORKLOAD, Workload

if TYPE_CHECKING:
    from .placement_index import PlacementIndex

#: Rough costs of a resume (:func:`resume_seconds`): a frozen worker thaws and its GPU state
#: goes back at about pinned host-to-device speed; a spilled one starts a new worker and loads
#: its namespace from the node's disk.
THAW_S = 0.3
HOST_TO_GPU_BYTES_S = 10e9
COLD_START_S = 3.0
DISK_BYTES_S = 1e9


@dataclass(frozen=True)
class Resume:
    """What a parked lease needs to resume: its ``node``, the ``gpus`` (UUIDs)
    it had and their ``model`` (GPU name), its slice (``fraction``,
    ``gpu_count``, ``memory`` bytes per GPU), its host reservation (``cpus``,
    ``host_memory``; None: its node reports no host), what its park holds now
    (``parked_host_bytes`` on the host, ``gpu_bytes_kept`` over its GPUs),
    whether the node's checkpointer can restore onto another GPU (``remap``),
    the worker environment it runs in (``env``; None: its node's default,
    which a move asks of the other node too) and whether it may move at all
    (``movable``: False for a cell frozen mid-way, which the spill of a move
    would interrupt, so it waits for its own node and goes on where it was)
    and whether its park was a preemption (``preempted``: its resume waits
    behind the requests already waiting, as a new request would, instead of
    going ahead of its class's new requests: else it would take back at once
    the room its preemption freed for them). ``host_share``: set where the lease
    asked no host (``c.PoolNodes.host_share``): its host is then the default
    share again, which gives way to parked leases as a new lease's does,
    instead of ``cpus`` and ``host_memory`` as granted before (a whole node's
    share would never fit again beside another lease parked there)."""

    node: str
    gpus: tuple[str, ...]
    model: str
    fraction: float
    gpu_count: int
    memory: int
    cpus: float | None = None
    host_memory: int | None = None
    parked_host_bytes: int = 0
    gpu_bytes_kept: int = 0
    remap: bool = False
    env: str | None = None
    movable: bool = True
    preempted: bool = False
    host_share: float | None = None

    def demand(self, *, model: str | None = None, env: str | None = None) -> Demand:
        """The slice as a scheduler :class:`.scheduler.Demand` (of ``model``: only that GPU name;
        ``env``: only on nodes offering that worker environment)."""
        if self.host_share is not None:
            return Demand(self.fraction, self.gpu_count, self.memory, model, env, None, None, self.host_share)
        return Demand(self.fraction, self.gpu_count, self.memory, model, env, self.cpus, self.host_memory)


def place(ask: Resume, states: Mapping[str, GPUState], node_gpus: Sequence[str], host: HostState | None,
          workload: Workload = DEFAULT_WORKLOAD) -> Placement | Refusal:
    """Where ``ask`` resumes now (module docstring), among ``states`` (UUID ->
    GPU state, what holds capacity counted, its own kept bytes too) of its node's
    GPUs ``node_gpus``, with ``host`` its node's host (None: no host dimension)."""
    kept = ask.gpu_bytes_kept // max(1, len(ask.gpus))
    hosts = {ask.node: host.unparked(ask.parked_host_bytes)} if host is not None else {}
    own = [_credited(states[uuid], ask, kept) for uuid in ask.gpus if uuid in states]
    decision: Placement | Refusal = Refusal({}, f"its GPUs on {ask.node} are no longer in the pool")
    if len(own) == len(ask.gpus):
        decision = place_demand(ask.demand(), own, workload, hosts=hosts)
        if isinstance(decision, Placement) or not ask.remap:
            return decision
    if ask.remap:
        others = [_credited(states[uuid], ask, kept) if uuid in ask.gpus else states[uuid]
                  for uuid in node_gpus if uuid in states and states[uuid].name == ask.model]
        remapped = place_demand(ask.demand(model=ask.model), others, workload, hosts=hosts)
        if isinstance(remapped, Placement) or not isinstance(decision, Refusal) or not decision.reasons:
            return remapped
    return decision


def place_elsewhere(ask: Resume, index: PlacementIndex, avoid: Collection[str] = ()) -> Placement | Refusal:
    """Where ``ask``, which found no room on its own node (:func:`place`), moves to now: a cold
    move (``c.PoolLeases.resume_moves``; docs/parking.md). Another node's GPUs of its ``model``
    (the same GPU name: a spill's arrays come back on their devices), with room for its slice and
    its host ask, in its worker environment (``env``), chosen as the scheduler chooses a new
    lease's: the ``index``'s :meth:`~.placement_index.PlacementIndex.place`, unless that picks its
    own node (room its checkpointer cannot remap onto) or one of ``avoid`` (nodes cleared for
    another request: :meth:`.priority.Plan.cleared_for_others`), then the same choice among the
    other nodes' GPUs of that model (as ``place_off`` those nodes does). A refusal when none has
    room, or when ``ask`` may not move (a cell frozen mid-way)."""
    if not ask.model or not ask.movable:
        return Refusal()
    demand = ask.demand(model=ask.model, env=ask.env)
    decision = index.place(demand, explain=False)
    if isinstance(decision, Placement) and decision.node != ask.node and decision.node not in avoid \
            and all(index.states[uuid].name == ask.model for uuid in decision.gpus):
        return decision
    others = [gpu for gpu in index.all()
              if gpu.node != ask.node and gpu.node not in avoid and gpu.name == ask.model]
    return place_demand(demand, others, index.workload, hosts=index.hosts) if others else Refusal()


def _credited(gpu: GPUState, ask: Resume, kept: int) -> GPUState:
    """``gpu`` with what the resuming lease holds or claims there while parked given back: its
    ``kept`` bytes free again, its claim (``parked_fraction``, ``parked_memory``) its own room."""
    return replace(gpu, allocated_memory=max(0, gpu.allocated_memory - kept),
                   parked_fraction=max(0.0, gpu.parked_fraction - ask.fraction),
                   parked_memory=max(0, gpu.parked_memory - max(0, ask.memory - kept)))


def resume_seconds(tier: str | None, gpu_bytes_moved: int | None, disk_bytes: int | None) -> float:
    """Rough seconds a resume takes once placed: from memory, a thaw plus the
    GPU state copied back; from disk, a new worker plus its namespace loaded
    (module constants). Rounded to a tenth."""
    if tier == "disk":
        return round(COLD_START_S + (disk_bytes or 0) / DISK_BYTES_S, 1)
    return round(THAW_S + (gpu_bytes_moved or 0) / HOST_TO_GPU_BYTES_S, 1)
