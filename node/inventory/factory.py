"""Finding inventories by name, and the node's inventory from its settings.

Inventories come from two places, looked up in this order: the built-in ones
(:data:`BUILTIN`: ``nvml``, ``simulated``) and those a package declares in
the ``gpupool.inventory`` entry point group (name = what
``c.AgentInventory.inventory_source`` takes, value = its
:class:`~.base.Inventory` subclass)::

    [project.entry-points."gpupool.inventory"]
    dcgm = "mypackage.dcgm:DCGMInventory"

``auto`` is not a name of either: it is ``simulated`` when ``--simulate`` is
given, else ``nvml``. Nothing here loads a plugin, or the NVML modules, until
one is asked for by name.
"""

from __future__ import annotations

import socket
from importlib.metadata import EntryPoint, entry_points
from typing import Sequence

from gpupool.wire.nodes import INVENTORIES

from .base import Inventory, InventoryError, InventoryOptions

ENTRY_POINT_GROUP = "gpupool.inventory"
AUTO = "auto"
#: The built-in inventories, as entry points of this package (loaded when asked for).
BUILTIN: dict[str, EntryPoint] = {
    name: EntryPoint(name, f"{__package__}.{target}", ENTRY_POINT_GROUP)
    for name, target in (("nvml", "nvml.watch:WatchedInventory"), ("simulated", "simulated:SimulatedInventory"))
}


def _entry_points() -> dict[str, EntryPoint]:
    return {point.name: point for point in entry_points(group=ENTRY_POINT_GROUP) if point.name != AUTO}


def available() -> tuple[str, ...]:
    """The names ``c.AgentInventory.inventory_source`` takes besides ``auto``:
    the built-in ones, then the others by name. Loads no plugin."""
    return (*BUILTIN, *sorted(set(_entry_points()) - set(BUILTIN)))


def inventory_class(name: str) -> type[Inventory]:
    """The inventory called ``name``. Raises ValueError for an unknown one
    (naming the choices) and TypeError for an entry point that names no
    :class:`Inventory` subclass whose ``kind`` the service knows."""
    point = BUILTIN.get(name) or _entry_points().get(name)
    if point is None:
        raise ValueError(f"unknown inventory {name!r}; choose one of {AUTO}, {', '.join(available())}")
    found = point.load()
    if not (isinstance(found, type) and issubclass(found, Inventory)) or found.kind not in INVENTORIES:
        raise TypeError(f"entry point {name} = {point.value} ({ENTRY_POINT_GROUP}) names no Inventory subclass "
                        f"whose kind is one of {', '.join(INVENTORIES)}")
    return found


def select_inventory(simulate: str | None, node_name: str | None = None, host_proc: str | None = None, *,
                     retry: tuple[float, float] = (5.0, 300.0), timeout: float = 5.0,
                     helper: Sequence[str] | None = None, source: str = AUTO) -> Inventory:
    """The inventory the agent should use: the one named ``source`` (a name of
    :func:`available`, or ``auto``), made by its :meth:`~.base.Inventory.create`.

    ``simulate`` is a ``--simulate`` spec such as ``"2xA100-80GB"``: with
    ``auto``, when given, a :class:`~.simulated.SimulatedInventory` whose
    UUIDs are derived from ``node_name`` (default: this host's name). Without
    it, NVML, read by a helper process through a
    :class:`~.nvml.watch.WatchedInventory`: when NVML fails to start (driver
    not loaded, driver/library version mismatch) or stops working, its
    :attr:`~Inventory.error` says why and it is opened again after ``retry``
    = (first, longest) seconds, doubling in between; when a round of NVML
    readings takes longer than ``timeout`` seconds the helper is killed and
    replaced on the same schedule. ``helper``: the helper's program (default
    :func:`~.nvml.watch.helper_command`).

    ``host_proc``: where the host's /proc is mounted when the agent runs in a
    container (see :class:`~gpupool.node.attribution.PidMapper`); NVML only.

    Raises :class:`InventoryError` when the spec is bad, when ``nvml`` is
    named beside a spec, when NVML cannot be there at all (no driver library,
    no ``nvidia-ml-py``) or finds no GPU (the message says to pass
    ``--simulate``), or when ``source`` is unknown or a broken plugin.
    """
    options = InventoryOptions(node_name or socket.gethostname(), simulate or "", host_proc, retry, timeout, helper)
    if source == AUTO:
        source = "simulated" if simulate else "nvml"
    elif source == "nvml" and simulate:
        raise InventoryError(f"--simulate={simulate} declares simulated GPUs, but the inventory asked for is "
                             "nvml (c.AgentInventory.inventory_source); drop one of them")
    try:
        chosen = inventory_class(source)
    except (ValueError, TypeError) as exc:
        raise InventoryError(str(exc)) from None
    return chosen.create(options)
