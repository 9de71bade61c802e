"""How a node starts its workers: one contract, picked by name.

- :mod:`.base`: :class:`WorkerLauncher`, what every launcher does (start a
  lease's worker cold, or a warm one ahead of any lease; re-adopt its
  workers and sweep what else an earlier agent left, after a restart);
- :mod:`.local`: :class:`~.local.LocalLauncher` (``local``), an ipykernel
  process of the agent's host in a cgroup of its own (with its worker
  templates, and how it finds its processes again after a restart);
- :mod:`.slurm` (``slurm``: Slurm jobs) and :mod:`.kubernetes` (``kubernetes``:
  pods), loaded only when named;
- :mod:`.factory`: launchers by name (built-in, or a plugin's in the
  ``gpupool.worker_launchers`` entry point group), for
  ``c.NodeAgent.worker_launcher``.
"""

from .base import WorkerLauncher
from .factory import ENTRY_POINT_GROUP, available, launcher_class

__all__ = ["ENTRY_POINT_GROUP", "WorkerLauncher", "available", "launcher_class"]
