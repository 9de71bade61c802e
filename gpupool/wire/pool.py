"""Service -> client: the pool (``GET /api/v1/pool``; docs/api.md): every
node with its GPUs and what is allocated on them, and the totals. Built by
the service (``hub_plugin/views.py``); ``%gpu pool`` and ``gpupool pool``
print it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .fields import Body, Spec, ref, wired
from .nodes import WorkerEnvironment


@dataclass(frozen=True)
class PoolGPU(Body):
    """One GPU of a node: ``memory_*`` in bytes (``memory_usable``: what
    leases may share, its total less the driver's reserve and the CUDA
    context overhead), ``allocated_fraction`` summed over the leases on it,
    ``leases`` a count (whose leases they are is not shown), ``memory_used``
    and ``utilization`` (percent) the latest NVML readings; ``parked_fraction``
    the share its parked leases (``parked_leases`` of them) hold no more but
    claim for their resume: not allocated, only kept free while other room fits
    (docs/placement.md, "Parked leases"); ``parked_unbacked`` the part of that
    claim which is not free now, because leases placed when no other room fit
    took it (``allocated_fraction + parked_fraction - 1``, at least 0): those
    resumes wait for room."""

    uuid: str = wired(Spec("string"))
    name: str = wired(Spec("string"))
    index: int = wired(Spec("integer"))
    memory_total: int = wired(Spec("integer"))
    memory_usable: int = wired(Spec("integer"))
    allocated_fraction: float = wired(Spec("number"))
    allocated_memory: int = wired(Spec("integer"))
    leases: int = wired(Spec("integer"))
    healthy: bool = wired(Spec("boolean"))
    memory_used: int | None = wired(Spec("integer", nullable=True))
    utilization: float | None = wired(Spec("number", nullable=True))
    parked_fraction: float = wired(Spec("number", "the share leases parked on it claim for their resume (not "
                                        "allocated: new leases take it only when no other room fits)"), 0.0)
    parked_leases: int = wired(Spec("integer", "leases parked on it (not counted in leases)"), 0)
    parked_unbacked: float = wired(Spec("number", "the part of parked_fraction that is not free now: allocated "
                                        "to other leases, placed when no other room fit (0 while the whole claim "
                                        "is free)"), 0.0)


@dataclass(frozen=True)
class PoolNode(Body):
    """One node: ``state`` (``up``; ``degraded``: its agent cannot read its
    GPUs; ``lost``: no heartbeat for ``c.PoolNodes.node_ttl``) and
    ``state_reason`` (words, null while up), what its agent reported
    (inventory, enforcement mode, worker environments, host cores and bytes;
    null: not reported), its GPUs, and its parked leases: the checkpointer,
    the parked-memory budget, what parked leases hold there and how many."""

    name: str = wired(Spec("string"))
    state: str = wired(Spec("", enum=("up", "degraded", "lost")))
    state_reason: str | None = wired(Spec("string", nullable=True))
    inventory: str = wired(Spec("string"))
    enforcement: str | None = wired(Spec("string", nullable=True))
    last_heartbeat_at: str = wired(Spec("string", format="date-time"))
    environments: list[dict[str, Any]] = wired(Spec("array", items=WorkerEnvironment))
    host_cpus: float | None = wired(Spec("number", nullable=True))
    host_memory: int | None = wired(Spec("integer", nullable=True))
    gpus: list[PoolGPU] = wired(Spec("array", items=PoolGPU))
    checkpointer: str | None = wired(Spec("string", "the checkpointer its agent parks workers with (null: it cannot "
                                          "park in place)", nullable=True), None)
    freezes_running_cell: bool = wired(Spec("boolean", "whether its checkpointer freezes a running cell where it "
                                            "is, so a preemption parks the cell to go on at the resume; false: a "
                                            "preempted cell is interrupted"), False)
    parked_memory: int | None = wired(Spec("integer", "host bytes its parked workers may hold before its agent "
                                           "spills the longest-parked to disk (null: not reported)", nullable=True),
                                      None)
    parked_host_bytes: int = wired(Spec("integer", "host bytes its leases parked in memory hold now"), 0)
    parked_leases: int = wired(Spec("integer", "leases parked (or parking) on it now"), 0)


@dataclass(frozen=True)
class PoolTotals(Body):
    """``gpus`` counts every GPU, ``allocated`` sums the allocated fractions,
    ``free`` the free fractions of the GPUs that can take work (healthy, on
    an ``up`` node), ``parked`` the part of ``free`` that parked leases claim
    for their resume (each GPU's claim as far as it is free there, so never
    more than ``free``), ``parked_unbacked`` the parked leases' claims that are
    not free now (:attr:`PoolGPU.parked_unbacked`, summed): allocated to other
    leases. On a GPU that can take work, allocated + free = 1 and the claim is
    the part of free counted in ``parked`` plus the part of allocated counted
    in ``parked_unbacked``."""

    gpus: int = wired(Spec("integer"))
    allocated: float = wired(Spec("number"))
    free: float = wired(Spec("number"))
    parked: float = wired(Spec("number", "the part of free that parked leases claim for their resume (not "
                               "allocated; a claim other leases took counts in parked_unbacked instead)"), 0.0)
    parked_unbacked: float = wired(Spec("number", "the parked leases' claims that are not free now: allocated to "
                                        "other leases, summed"), 0.0)


@dataclass(frozen=True)
class Pool(Body):
    """``GET /api/v1/pool``: its ``nodes`` and their ``totals``."""

    nodes: list[PoolNode] = wired(Spec("array", items=PoolNode))
    totals: PoolTotals = wired(Spec("", extra=ref("PoolTotals")))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
