"""Workers: one ipykernel per lease, confined to the lease's slice.

The agent's HTTP handlers call :class:`WorkerManager`; it starts each worker
with jupyter_client's ``AsyncKernelManager`` (so ports, HMAC key, connection
file and signals are Jupyter's own), watches its IOPub for activity, notices
when it dies, and stops it so that no process outlives its lease. The agent
builds one :class:`WorkerLaunch` (how its workers start) from its traits.

With ``warm_workers`` > 0 it also keeps that many workers started ahead of
any lease (:mod:`.warmpool`): a lease then takes one and the agent *binds* it
to the slice (:mod:`.binding`) instead of booting a kernel.

Workers do not die with the agent: a restarted agent re-adopts the lease
workers that still run and stops every other process it started before
(:mod:`.recovery`, from the records of :mod:`.records`). With a worker user
(:mod:`..worker_user`) every worker runs as that account, not the agent's
(:mod:`.accounts`).

Every worker lives in a cgroup of its own (:mod:`..cgroups`; docs/security.md,
"Containment"), which its first process joins through the start gate
(:mod:`.kernel`) and which release, a worker's death and agent stop kill
whole (:mod:`.stopping`).

The modules, one concept each: :mod:`.spec` (settings, the lease's worker,
its environment, the errors), :mod:`.kernel` (command line, start gate,
connection file and ports), :mod:`.process` (the worker process contract:
a local child or an adopted process), :mod:`.handle` (:class:`Worker`, the
agent's handle on one), :mod:`.accounts`, :mod:`.launchers` (starting one:
the launcher contract, the ``local`` launcher, and the others by name,
``c.NodeAgent.worker_launcher``),
:mod:`.binding`, :mod:`.warmpool`, :mod:`.stopping`, :mod:`.records`,
:mod:`.recovery` and :mod:`.manager` (:class:`WorkerManager`).
"""

from .handle import Worker
from .manager import WorkerManager
from .spec import (WORKER_EXTENSION, WarmSettings, WorkerBindError, WorkerLaunch, WorkerSpec, WorkerStartError,
                   WorkerStopError, worker_environment)

__all__ = ["WORKER_EXTENSION", "WarmSettings", "Worker", "WorkerBindError", "WorkerLaunch", "WorkerManager",
           "WorkerSpec", "WorkerStartError", "WorkerStopError", "worker_environment"]
