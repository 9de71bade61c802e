"""A node's GPU inventory: one contract, several implementations.

- :mod:`.base`: :class:`Inventory`, what every inventory answers (GPUs,
  readings, processes, health) and how one is made from the agent's
  :class:`InventoryOptions`, and :class:`InventoryError`;
- :mod:`.simulated`: :class:`SimulatedInventory`, declared GPUs for hosts
  without one (``--simulate``);
- :mod:`.nvml`: real GPUs through NVML, read by the agent in a helper process
  that is replaced when a driver call hangs;
- :mod:`.retrying`: :class:`RetryingInventory`, an inventory opened again
  with a growing delay while NVML fails;
- :mod:`.factory`: inventories by name (built-in, or a plugin's in the
  ``gpupool.inventory`` entry point group) and :func:`select_inventory`, the
  one the agent uses.

Importing this package loads neither ``pynvml`` nor the NVML modules.
"""

from .base import Inventory, InventoryError, InventoryOptions
from .factory import available, inventory_class, select_inventory
from .retrying import RetryingInventory, backoff_delay
from .simulated import SimulatedInventory

__all__ = ["Inventory", "InventoryError", "InventoryOptions", "RetryingInventory", "SimulatedInventory", "available",
           "backoff_delay", "inventory_class", "select_inventory"]
