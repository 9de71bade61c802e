"""The contract every enforcement mode keeps (:class:`EnforcementMode`: name,
capacity rule, worker environment, refusals, node setup, memory watchdog),
and :func:`slice_environment`, the variables every mode gives a worker (pure).
The sources for those variables: docs/code.md, "Enforcement modes"; what
each mode guarantees and how to add one: docs/enforcement.md.
"""

from __future__ import annotations

import logging
import math
from typing import ClassVar, Sequence

from gpupool.wire.nodes import GPUInfo

from .watchdog import MemoryWatchdog

MiB = 1024**2


def slice_environment(gpus: Sequence[GPUInfo | str], fraction: float, memory: int, lease_id: str,
                      owner: str, node: str) -> dict[str, str]:
    """The environment variables of a worker confined to a slice, in any mode.

    ``gpus``: the lease's GPUs (GPUInfo, or bare UUID strings), in the order
    the worker should see them; ``fraction``: compute share in (0, 1] of each
    GPU; ``memory``: the memory limit in bytes per GPU; ``lease_id``,
    ``owner``, ``node``: recorded for the user's code and for logs.

    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is ``memory / memory_total`` when the
    GPUs' memory is known (GPUInfo), else ``fraction``; it is rounded down to
    3 decimals, so a framework never gets more than the lease holds.

    Raises ValueError for no GPUs, a fraction outside (0, 1] or a memory limit
    below 1 MiB.
    """
    if not gpus:
        raise ValueError("a slice needs at least one GPU")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if int(memory) != memory or memory < MiB:
        raise ValueError(f"memory must be a whole number of bytes of at least 1 MiB, got {memory!r}")
    memory = int(memory)
    uuids = [gpu.uuid if isinstance(gpu, GPUInfo) else str(gpu) for gpu in gpus]
    totals = [gpu.memory_total for gpu in gpus if isinstance(gpu, GPUInfo)]
    share = min(1.0, memory / min(totals)) if len(totals) == len(uuids) else fraction
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(uuids),
        "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{max(0.001, math.floor(share * 1000) / 1000):.3f}",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "GPUPOOL_LEASE_ID": lease_id,
        "GPUPOOL_OWNER": owner,
        "GPUPOOL_NODE": node,
        "GPUPOOL_GPU_UUIDS": ",".join(uuids),
        "GPUPOOL_FRACTION": f"{fraction:g}",
        "GPUPOOL_MEMORY_LIMIT": str(memory),
    }


class EnforcementMode:
    """One way of confining workers to their slices; subclass it to add a mode.

    A subclass sets :attr:`name` and the class attributes that differ, and
    overrides the methods whose default does not fit; it is found by name
    through the ``gpupool.enforcement`` entry point group or
    :func:`~.factory.register` (docs/enforcement.md, "Adding a mode").
    The agent makes one instance per node with no arguments, calls
    :meth:`setup` once before it serves, and :meth:`close` when it stops.
    """

    #: The name agents take (``c.AgentEnforcement.enforcement_mode``) and register.
    name: ClassVar[str] = ""
    #: The capacity rule the service places by: True when the mode hands out
    #: whole devices only (a lease's fraction must be 1); sent at registration.
    whole_gpus: ClassVar[bool] = False
    #: What one whole device is called in refusals.
    unit: ClassVar[str] = "GPUs"
    #: True when nothing but the agent's memory watchdog stops a worker that
    #: takes more GPU memory than its slice (the hardware or whole GPUs do not).
    watches_memory: ClassVar[bool] = False
    #: False for modes that confine real GPUs: a node with simulated GPUs
    #: reports ``none`` instead, since nothing runs on a GPU there.
    runs_simulated: ClassVar[bool] = False

    def __init__(self) -> None:
        self.watchdog = MemoryWatchdog()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if not isinstance(cls.name, str) or not 0 < len(cls.name) <= 50 or not cls.name.isprintable():
            raise TypeError(f"enforcement mode {cls.__qualname__} needs a name of 1 to 50 printable characters")

    def check(self, fraction: float) -> None:
        """Refuse a worker this mode cannot enforce. Raises ValueError, naming
        the mode, for a fraction below 1 where only whole devices are handed out."""
        if self.whole_gpus and fraction < 1:
            raise ValueError(f"this node enforces slices with {self.name!r}: it hands out whole {self.unit} only, "
                             f"not a fraction of {fraction:g}")

    def environment(self, gpus: Sequence[GPUInfo | str], fraction: float, memory: int, lease_id: str,
                    owner: str, node: str) -> dict[str, str]:
        """The variables of a worker of this slice (arguments and errors as
        :func:`slice_environment`, which is the default)."""
        return slice_environment(gpus, fraction, memory, lease_id, owner, node)

    def setup(self, state_dir: str, log: logging.Logger) -> None:
        """Prepare the node before the agent serves (``state_dir``: the
        agent's). Raises RuntimeError saying what is missing; the agent stops."""

    def close(self, log: logging.Logger) -> None:
        """Undo :meth:`setup` when the agent stops; problems are logged, not raised."""

    def over_limit(self, usage: dict[str, dict[str, int]], limits: dict[str, int]) -> list[tuple[str, str]]:
        """``(lease, reason)`` of each worker to stop for the GPU memory it
        uses, from one heartbeat's readings (shapes as
        :meth:`.MemoryWatchdog.check`); none unless :attr:`watches_memory`."""
        return self.watchdog.check(usage, limits) if self.watches_memory else []

    def registration(self) -> dict[str, object]:
        """What the node's registration says of its mode (``POST /nodes``)."""
        return {"enforcement": self.name, "whole_gpus": self.whole_gpus}
