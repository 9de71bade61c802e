"""Workers: one ipykernel per lease, confined to the lease's slice, started,
watched, parked, re-adopted and stopped by :class:`WorkerManager`
(docs/code.md, "Workers").
"""

from .handle import Worker
from .manager import WorkerManager
from .spec import (WORKER_EXTENSION, WarmSettings, WorkerBindError, WorkerLaunch, WorkerSpec, WorkerStartError,
                   WorkerStopError, worker_environment)

__all__ = ["WORKER_EXTENSION", "WarmSettings", "Worker", "WorkerBindError", "WorkerLaunch", "WorkerManager",
           "WorkerSpec", "WorkerStartError", "WorkerStopError", "worker_environment"]
