"""The inventory contract: which GPUs a node has, and how busy they are.

:class:`Inventory` is what every implementation answers, and
:meth:`Inventory.create` how the agent makes one from its settings
(:class:`InventoryOptions`); :class:`InventoryError` is what they raise when
the GPUs cannot be read.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Sequence

from gpupool.errors import GPUPoolError, Reason
from gpupool.wire.nodes import GPUInfo


class InventoryError(GPUPoolError):
    """No usable inventory on this node (no NVML, no GPUs, bad ``--simulate``).

    A :class:`GPUPoolError` so that ``gpupool agent`` prints the message, not a
    traceback. ``reason``: the same without advice, for the service and the
    pool view (default: ``message``). ``retryable``: the driver may come back
    by itself (not loaded yet, a version mismatch after an upgrade), so an
    agent should keep running and try again rather than exit.
    """

    def __init__(self, message: str, *, reason: str | None = None, retryable: bool = False) -> None:
        super().__init__(Reason.no_inventory, message, 503)
        self.reason = reason or message
        self.retryable = retryable


@dataclass(frozen=True)
class InventoryOptions:
    """The agent's settings an inventory may read when it is made
    (:meth:`Inventory.create`): ``node_name``; ``simulate``, the
    ``--simulate`` spec (``""``: none); and NVML's: ``host_proc`` (where the
    host's /proc is mounted in a container; None: here), ``retry`` = (first,
    longest) seconds between attempts to open it again, ``timeout`` seconds
    per round of readings, ``helper`` the helper process's command (None:
    the default)."""

    node_name: str
    simulate: str = ""
    host_proc: str | None = None
    retry: tuple[float, float] = (5.0, 300.0)
    timeout: float = 5.0
    helper: Sequence[str] | None = None


class Inventory(abc.ABC):
    """The GPUs of one node.

    ``kind`` is what the agent reports at registration, one of
    :data:`gpupool.wire.nodes.INVENTORIES` (``"simulated"``: the GPUs are
    declared, nothing enforces slices on them; ``"nvml"``: real GPUs).
    Implementations are cheap to query repeatedly: the agent calls
    :meth:`metrics` once per heartbeat.

    A new inventory subclasses this, sets ``kind``, implements
    :meth:`discover` and :meth:`metrics` (and :meth:`create` when it needs
    the agent's settings), and is declared in the ``gpupool.inventory`` entry
    point group (:mod:`.factory`).
    """

    kind: str = ""

    @classmethod
    def create(cls, options: InventoryOptions) -> "Inventory":
        """The inventory an agent uses, made once at its start from its
        ``options``. Raises :class:`InventoryError` when the GPUs cannot be
        there at all (the agent prints the message and exits). The default
        calls ``cls()``, reading none of them."""
        return cls()
    #: Why the GPUs cannot be read now (e.g. ``"NVML could not start (...)"``);
    #: None while they can. Only an NVML inventory ever has this state.
    error: str | None = None

    @abc.abstractmethod
    def discover(self) -> list[GPUInfo]:
        """Every GPU of the node, ordered by index. Called once at start-up and
        at each (re-)registration. Raises :class:`InventoryError` when the GPUs
        cannot be listed at all."""

    @abc.abstractmethod
    def metrics(self) -> list[dict[str, Any]]:
        """One ``{"uuid", "memory_used", "utilization"}`` per GPU for a heartbeat.

        ``memory_used`` is bytes and ``utilization`` percent (0-100). ``None``
        means unknown (not supported, or no GPU at all) and never stands for 0.
        """

    def process_memory(self) -> dict[int, int]:
        """GPU memory used per process id, in bytes, summed over all GPUs.

        Processes that NVML cannot attribute are absent. The default knows of
        no process (the simulated inventory has none on any GPU).
        """
        return {}

    def process_usage(self) -> list:
        """Every process on every GPU as :class:`~gpupool.node.attribution.GPUProcess`
        records (NVML pid, the agent's pid, bytes, SM %). The default knows of
        none."""
        return []

    def process_known(self) -> set[str]:
        """UUIDs of the GPUs whose process list the last :meth:`process_usage`
        could read; on the others, per-process usage is unknown."""
        return set()

    def versions(self) -> dict[str, str | None]:
        """``{"driver", "cuda"}`` version strings; None where unknown (the
        default: a node without a driver)."""
        return {"driver": None, "cuda": None}

    def health(self) -> dict[str, dict[str, Any]]:
        """GPU UUID -> ``{"healthy": bool, "reason": str | None, "xids": [int]}``.
        The default: every GPU healthy (nothing can fail on a simulated one)."""
        return {gpu.uuid: {"healthy": True, "reason": None, "xids": []} for gpu in self.discover()}

    def check(self) -> None:
        """Raise :class:`InventoryError` when the GPUs cannot be read any more.
        The default never fails."""

    def refresh(self) -> bool:
        """Check, once per heartbeat, that the GPUs can still be read, and try
        again when they could not (see :attr:`error`). True when they just came
        back: the caller registers :meth:`discover`'s GPUs again. The default
        never fails."""
        return False

    async def update(self) -> bool:
        """:meth:`refresh`, for the agent's event loop: an inventory whose
        reads may block (NVML) does them elsewhere and waits without blocking
        the loop. Once per heartbeat, before the readings are taken. The
        default calls :meth:`refresh` (a simulated inventory never blocks)."""
        return self.refresh()

    def close(self) -> None:
        """Release the inventory's handles (NVML). Idempotent."""
