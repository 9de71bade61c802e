"""A node's GPU inventory: one contract, several implementations (simulated,
NVML), picked by name (docs/code.md, "Inventory"). Importing this package
loads neither ``pynvml`` nor the NVML modules.
"""

from .base import Inventory, InventoryError, InventoryOptions
from .factory import available, inventory_class, select_inventory
from .retrying import RetryingInventory, backoff_delay
from .simulated import SimulatedInventory

__all__ = ["Inventory", "InventoryError", "InventoryOptions", "RetryingInventory", "SimulatedInventory", "available",
           "backoff_delay", "inventory_class", "select_inventory"]
