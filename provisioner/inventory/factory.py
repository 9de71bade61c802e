"""Picking a node's inventory: declared GPUs (``--simulate``) or NVML."""

from __future__ import annotations

import socket
from typing import Sequence

from .base import Inventory, InventoryError


def select_inventory(simulate: str | None, node_name: str | None = None, host_proc: str | None = None, *,
                     retry: tuple[float, float] = (5.0, 300.0), timeout: float = 5.0,
                     helper: Sequence[str] | None = None) -> Inventory:
    """The inventory the agent should use.

    ``simulate`` is a ``--simulate`` spec such as ``"2xA100-80GB"``: when given,
    a :class:`~.simulated.SimulatedInventory` whose UUIDs are derived from
    ``node_name`` (default: this host's name). Without it, NVML, read by a
    helper process through a :class:`~.nvml.watch.WatchedInventory`: when
    NVML fails to start (driver not loaded, driver/library version mismatch)
    or stops working, its :attr:`~Inventory.error` says why and it is opened
    again after ``retry`` = (first, longest) seconds, doubling in between;
    when a round of NVML readings takes longer than ``timeout`` seconds the
    helper is killed and replaced on the same schedule. ``helper``: the
    helper's program (default :func:`~.nvml.watch.helper_command`).

    ``host_proc``: where the host's /proc is mounted when the agent runs in a
    container (see :class:`~gpupool.provisioner.attribution.PidMapper`); NVML only.

    Raises :class:`InventoryError` when the spec is bad, or when NVML cannot
    be there at all (no driver library, no ``nvidia-ml-py``) or finds no GPU;
    the message says to pass ``--simulate``.
    """
    node_name = node_name or socket.gethostname()
    if simulate:
        from .simulated import SimulatedInventory

        try:
            return SimulatedInventory(simulate, node_name)
        except ValueError as exc:
            raise InventoryError(f"bad --simulate value: {exc}") from None
    from .nvml.watch import WatchedInventory

    return WatchedInventory(host_proc=host_proc, timeout=timeout, first=retry[0], longest=retry[1], command=helper)
