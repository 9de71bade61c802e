"""How a node moves a parked worker's GPU state to host memory and back: one
contract, several checkpointers, picked by name (docs/parking.md).

- :mod:`.base`: :class:`Checkpointer`, what each one does (park, resume, a
  spill's way to host memory, discard), :class:`ParkTarget` (the worker, as
  it sees it), :class:`Moved` (what a park moved), :class:`CheckpointError`;
- :mod:`.cuda` (``cuda-checkpoint``: NVIDIA's utility, the whole CUDA
  state), :mod:`.framework` (``framework``: the worker's own tensors, between
  cells), :mod:`.simulated` (``simulated``: the simulated GPUs' memory);
- :mod:`.factory`: checkpointers by name (built in, or the
  ``gpupool.checkpointers`` entry point group) and :func:`resolve`, the
  node's from ``c.NodeAgent.checkpointer`` (``auto`` included).
"""

from .base import Checkpointer, CheckpointError, Moved, NodeFacts, ParkTarget
from .factory import AUTO, ENTRY_POINT_GROUP, available, checkpointer_class, resolve

__all__ = ["AUTO", "ENTRY_POINT_GROUP", "CheckpointError", "Checkpointer", "Moved", "NodeFacts", "ParkTarget",
           "available", "checkpointer_class", "resolve"]
