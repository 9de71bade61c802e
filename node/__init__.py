"""The GPU-node side of gpupool: inventory, enforcement, the node agent and
its workers, and the extension inside each worker kernel. Re-exports only,
lazily, so a worker environment imports no agent dependency (docs/code.md).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Inventory": "inventory",
    "InventoryError": "inventory",
    "select_inventory": "inventory",
    "SimulatedInventory": "inventory",
    "NVMLInventory": "inventory.nvml.inventory",
    "slice_environment": "enforcement",
    "EnforcementMode": "enforcement",
    "WorkerActivity": "activity",
    "WorkerManager": "workers",
    "WorkerSpec": "workers",
    "WorkerStartError": "workers",
    "NodeAgent": "agent",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
