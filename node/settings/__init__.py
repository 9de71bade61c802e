"""The node agent's settings besides its own (``c.NodeAgent``), one class per
concern: ``c.AgentInventory``, ``c.AgentEnforcement``, ``c.AgentWorkers`` and
``c.AgentParking``. The agent builds each from its config (docs/code.md,
"The agent's settings"). Re-exports only.
"""

from .enforcement import AgentEnforcement
from .inventory import AgentInventory
from .parking import AgentParking
from .workers import AgentWorkers

__all__ = ["AgentEnforcement", "AgentInventory", "AgentParking", "AgentWorkers"]
