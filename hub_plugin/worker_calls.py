"""The service's calls to an agent about one lease's worker: start it (with
the ``POST /workers`` body read from the lease), park and resume it (the same
body: the GPUs and limits it is granted now; for a cold move, with the old
node's agent to fetch the spill from), and stop it. The lease's state
changes that follow are the life cycle's (:mod:`.leases`, :mod:`.parking`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from sqlalchemy.orm import Session, selectinload

from gpupool.errors import GPUPoolError
from gpupool.schema import LeaseState
from gpupool.wire.parking import ParkRequest, WorkerParked, WorkerResumed
from gpupool.wire.workers import WorkerRequest, WorkerStarted

from .agent_client import AgentClient
from .config import PoolNodes
from .models import Lease, Node
from .rules.hosts import host_limits
from .state import PoolState

log = logging.getLogger("gpupool.service.leases")


@dataclass(frozen=True)
class StartJob:
    """A worker to start: the agent's ``url``, its ``node`` name, the ``POST /workers``
    ``request``; ``resume``: the lease resumes from a park (``POST /workers/{id}/resume``);
    ``moved_from`` and ``spill_from``: for a cold move, the node its state is on and that
    node's agent URL (None when that node is gone), which :meth:`WorkerCalls.resume`
    passes on in the request's ``spill_from``."""

    url: str
    node: str
    request: WorkerRequest
    resume: bool = False
    moved_from: str | None = None
    spill_from: str | None = None


def start_job(session: Session, lease: Lease) -> StartJob:
    """What starting the worker of ``lease`` (``starting``: placed, its GPUs assigned) takes, read in ``session``."""
    node = session.get(Node, lease.node_name)
    # env: placed where the agent reported it usable; one restarted since without it refuses, in words.
    request = WorkerRequest(lease.id, lease.owner, tuple(g.gpu_uuid for g in lease.gpus), lease.fraction,
                            lease.memory, env=lease.env, **host_limits(lease, node))
    moved_from = (lease.moved_from or {}).get("node") if lease.park_tier is not None else None
    if moved_from is None:
        return StartJob(node.url, node.name, request, resume=lease.park_tier is not None)
    old = session.get(Node, moved_from)
    return StartJob(node.url, node.name, request, resume=True, moved_from=moved_from,
                    spill_from=old.url if old is not None else None)


class WorkerCalls:
    """Starts and stops workers through ``agents``, waiting at most
    ``c.PoolNodes.worker_start_timeout`` / ``worker_stop_timeout`` (and
    ``worker_park_timeout`` to park or resume one) of ``pool_nodes``."""

    def __init__(self, pool_nodes: PoolNodes, state: PoolState, agents: AgentClient) -> None:
        self.pool_nodes = pool_nodes
        self.state = state
        self.agents = agents

    async def job(self, lease_id: str) -> StartJob | None:
        """What starting the worker of ``lease_id`` takes; None unless it is ``starting``."""
        return await self.state.work.read(self._job_now, lease_id)

    def _job_now(self, lease_id: str) -> StartJob | None:
        with self.state.reading() as session:
            lease = session.get(Lease, lease_id, options=[selectinload(Lease.gpus)])
            if lease is None or lease.state != LeaseState.starting.value:
                return None
            return start_job(session, lease)

    async def start(self, job: StartJob) -> WorkerStarted:
        """The agent's answer (``connection``, ``pid``); raises :class:`GPUPoolError` when it did not start."""
        return await self.agents.start_worker(job.url, job.request, self.pool_nodes.worker_start_timeout)

    async def resume(self, job: StartJob, from_memory: bool = False) -> WorkerResumed:
        """The agent's answer to a resume (``connection``, ``pid``, what was lost), waiting at
        most ``worker_park_timeout``; raises :class:`GPUPoolError` when it did not resume. For a
        move the request says where the state is: ``from_memory``, in the old node's worker,
        parked in memory (``move_from``: the new worker takes it from the old one, worker to
        worker), else in its spill (``spill_from``: the new node's agent fetches it from the old
        one's, node to node, and loads it into a new worker)."""
        request = job.request
        if job.spill_from is not None:
            where = {"move_from" if from_memory else "spill_from": job.spill_from}
            request = replace(request, **where)
        return await self.agents.resume_worker(job.url, request, self.pool_nodes.worker_park_timeout)

    async def park(self, url: str, lease_id: str, request: ParkRequest) -> WorkerParked:
        """The agent's answer to a park, waiting at most ``worker_park_timeout``; raises
        :class:`GPUPoolError` (``worker_busy``, ``cannot_park``, ``agent_unreachable``)."""
        return await self.agents.park_worker(url, lease_id, request, self.pool_nodes.worker_park_timeout)

    async def stop(self, url: str, lease_id: str) -> str | None:
        """Ask the agent to stop the lease's worker, waiting at most
        ``worker_stop_timeout``; None once stopped, else words for the
        lease's reason (the release goes on regardless)."""
        try:
            code = await self.agents.stop_worker(url, lease_id, self.pool_nodes.worker_stop_timeout)
        except GPUPoolError as exc:
            log.warning("lease %s: could not stop its worker (%s); the agent will be told to stop it "
                        "with its next heartbeat", lease_id, exc.message)
            return (f"its worker was not confirmed stopped ({exc.message}); the agent is told to stop it with "
                    "its next heartbeat")
        log.debug("lease %s: worker stopped (exit code %s)", lease_id, code)
        return None

    async def node_url(self, lease_id: str) -> str | None:
        """The agent URL of the node ``lease_id`` is placed on; None when it is not placed."""
        return await self.state.work.read(self._node_url_now, lease_id)

    def _node_url_now(self, lease_id: str) -> str | None:
        with self.state.reading() as session:
            lease = session.get(Lease, lease_id)
            return session.get(Node, lease.node_name).url if lease and lease.node_name else None
