"""A GPU inventory that gpupool does not know: one declared GPU per node, named
after it, with readings of its own. tests/node/test_inventory_plugin.py makes it
known by one ``gpupool.inventory`` entry point, as a plugin package would."""

from __future__ import annotations

import uuid
from typing import Any

from gpupool.node.inventory import Inventory, InventoryOptions
from gpupool.wire.nodes import GPUInfo

GiB = 1024**3


class DemoInventory(Inventory):
    """One 16 GiB "Demo GPU" whose UUID derives from the node's name; always 25% busy."""

    kind = "simulated"  # declared GPUs: nothing enforces slices on them

    def __init__(self, node_name: str) -> None:
        self.gpu = GPUInfo(uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, node_name)}", name=f"Demo GPU ({node_name})",
                           index=0, memory_total=16 * GiB, memory_reserved=GiB // 4, compute_capability="9.0")

    @classmethod
    def create(cls, options: InventoryOptions) -> "DemoInventory":
        return cls(options.node_name)

    def discover(self) -> list[GPUInfo]:
        return [self.gpu]

    def metrics(self) -> list[dict[str, Any]]:
        return [{"uuid": self.gpu.uuid, "memory_used": GiB, "utilization": 25}]
