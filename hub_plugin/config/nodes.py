"""Settings of nodes and workers as the service sees them (``c.PoolNodes.*``)."""

from __future__ import annotations

from traitlets import Float, TraitError, validate
from traitlets.config import Configurable

from gpupool.traits import ByteSize, Duration


class PoolNodes(Configurable):
    """How the service deals with node agents: their heartbeats, its calls to
    start and stop workers, and what of each GPU and host it shares out."""

    node_heartbeat_interval = Duration(
        5.0,
        help="""Seconds between two heartbeats of each agent; returned to agents at
        registration. Default: 5 seconds. ``c.PoolNodes.node_heartbeat_interval = 10``.""",
    ).tag(config=True)

    node_ttl = Duration(
        30.0,
        help="""Seconds without a heartbeat after which a node is ``lost``: nothing
        new is placed there until it is heard from again. Default: 30 seconds;
        keep it several times ``node_heartbeat_interval``. ``c.PoolNodes.node_ttl = "1m"``.""",
    ).tag(config=True)

    worker_start_timeout = Duration(
        90.0,
        help="""Seconds the service waits for an agent to start a worker before
        the lease fails. Keep it above the agents' own limits (their
        ``c.AgentWorkers.worker_start_timeout`` and, on Slurm, ``c.SlurmLauncher.start_timeout``:
        60 seconds each by default), so that an agent's words on why a start failed (a Slurm job
        left pending, and Slurm's reason) reach the user. Default: 90 seconds.
        ``c.PoolNodes.worker_start_timeout = "6m"``.""",
    ).tag(config=True)

    worker_stop_timeout = Duration(
        20.0,
        help="""Seconds the service waits for an agent to stop a worker on
        release; after that the lease still ends (its reason says the stop was
        not confirmed), and the agent is told to stop the worker with its next
        heartbeat. Keep it above the agents' ``c.AgentWorkers.worker_stop_timeout``
        (10 s) and below the clients' 30 s timeout, so that a release answers
        before ``%gpu release`` gives up. Default: 20 seconds.
        ``c.PoolNodes.worker_stop_timeout = 25``.""",
    ).tag(config=True)

    worker_park_timeout = Duration(
        300.0,
        help="""Seconds the service waits for an agent to park a worker in place (freeze
        it and move its GPU state to host memory, or spill it to disk) or to resume one;
        after that an idle park gives up and releases the lease (a resume ends it
        ``failed``). Moving tens of GiB takes seconds in memory, longer to disk.
        Default: 5 minutes. ``c.PoolNodes.worker_park_timeout = "10m"``.""",
    ).tag(config=True)

    parked_node_grace = Duration(
        600.0,
        help="""Seconds a node may stay ``lost`` beyond ``node_ttl`` while leases are
        parked on it before they end ``failed`` (their frozen workers, or what its
        stopped agent saved to its disk, are as good as gone, and the words say so); a
        node back sooner keeps them, and a resume asked meanwhile waits for it. Give
        it the time an agent restart or upgrade takes. Default: 10 minutes.
        ``c.PoolNodes.parked_node_grace = "1h"``.""",
    ).tag(config=True)

    context_overhead = ByteSize(
        512 * 1024**2,
        help="""Bytes of GPU memory a CUDA context costs, subtracted from each
        GPU's memory before it is shared out. Default: 512 MiB.
        ``c.PoolNodes.context_overhead = "1GiB"``.""",
    ).tag(config=True)

    host_share = Float(
        1.0,
        help="""Host CPUs and RAM a lease gets when its request names none
        (``%gpu acquire 0.5`` without ``--cpus`` / ``--host-memory``), as a
        multiple of its GPU share of the node: half a GPU on a node of 8 GPUs,
        64 cores and 512 GiB is 1/16 of it, 4 cores and 32 GiB at 1.0. In
        (0, 1]; below 1 leaves host room for leases that ask for more.
        Default: 1.0 (proportional). ``c.PoolNodes.host_share = 0.5``.""",
    ).tag(config=True)

    @validate("host_share")
    def _check_host_share(self, proposal):
        if not 0 < proposal.value <= 1:
            raise TraitError(f"c.PoolNodes.host_share must be in (0, 1], got {proposal.value!r}")
        return proposal.value
