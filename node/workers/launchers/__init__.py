"""How a node starts its workers: the :class:`WorkerLauncher` contract, the
launchers (``local``, ``slurm``, ``kubernetes``) and the factory that picks
one by name (docs/code.md, "Launchers").
"""

from .base import WorkerLauncher
from .factory import ENTRY_POINT_GROUP, available, launcher_class

__all__ = ["ENTRY_POINT_GROUP", "WorkerLauncher", "available", "launcher_class"]
