"""How a node moves a parked worker's GPU state to host memory and back: one
contract, several checkpointers, picked by name (docs/code.md,
"Checkpointers"; docs/parking.md).
"""

from .base import Checkpointer, CheckpointError, Moved, NodeFacts, ParkTarget
from .factory import AUTO, ENTRY_POINT_GROUP, available, checkpointer_class, resolve

__all__ = ["AUTO", "ENTRY_POINT_GROUP", "CheckpointError", "Checkpointer", "Moved", "NodeFacts", "ParkTarget",
           "available", "checkpointer_class", "resolve"]
