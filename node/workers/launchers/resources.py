"""What a cluster launcher reads of a lease to ask its cluster for the
worker's resources (a :class:`~..spec.WorkerSpec` is one); a protocol, so the
pure request builders (Slurm's :mod:`.slurm.request`, Kubernetes'
:mod:`.kubernetes.pods`) import nothing of the agent."""

from __future__ import annotations

from typing import Protocol, Sequence


class LeaseResources(Protocol):
    """One lease's ask of its node: its id and ``owner`` (user name), its
    GPUs (how many), the compute ``fraction`` of one GPU (1.0 for whole GPUs),
    host ``cpus`` (cores; None: the cluster's default, one for Slurm) and
    ``host_memory`` (bytes; None: the cluster's default)."""

    lease_id: str
    owner: str
    gpus: Sequence[object]
    fraction: float
    cpus: float | None
    host_memory: int | None
