"""The service's parts, wired once: the state (:mod:`.state`) and the peers
that use it: new requests (:mod:`.intake`, with :mod:`.admission` and
:mod:`.placing`), the lease life cycle (:mod:`.leases`, with the queue and
the agents' worker calls), park in place and resume (:mod:`.parking`), the
lease views, the nodes (:mod:`.nodes`) and the reclaim sweep
(:mod:`.reclaim`). None of them reaches into another; each gets what it uses
here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Callable, Mapping

from gpupool.schema import utcnow

from .admission import Admission
from .agent_client import AgentClient
from .background import Background
from .config import ServiceSettings
from .db import Store
from .intake import LeaseIntake
from .lease_queue import LeaseQueue
from .lease_views import LeaseViews
from .leases import LeaseBook
from .nodes import NodeBook
from .parking import Parking
from .placing import Placer
from .pressure import Pressure
from .quota_book import QuotaBook
from .reclaim import Reclaimer
from .state import PoolState
from .storework import StoreWork
from .worker_calls import WorkerCalls


class Pool:
    """The parts for ``settings`` (each given the settings classes it reads) on ``store``, asking agents
    through ``agents``. ``now`` is the one clock (replaceable on ``state`` in
    tests); ``on_refusal(codes)`` is told every refusal (code -> count, see
    :class:`.admission.Admission`), ``on_dequeued(seconds)`` how long each
    queued request waited, ``on_parked(code, tier)`` each park and ``on_resumed(seconds)``
    how long each resume took (for metrics); ``work`` runs the store calls off the event
    loop (a new one by default)."""

    def __init__(self, settings: ServiceSettings, store: Store, agents: AgentClient, *,
                 now: Callable[[], datetime] = utcnow,
                 on_refusal: Callable[[Mapping[str, int]], None] | None = None,
                 on_dequeued: Callable[[float], None] = lambda seconds: None,
                 on_parked: Callable[[str, str], None] = lambda code, tier: None,
                 on_resumed: Callable[[float], None] = lambda seconds: None,
                 work: StoreWork | None = None) -> None:
        self.settings = settings
        self.agents = agents
        nodes, leases, pressure, quotas = settings.nodes, settings.leases, settings.pressure, settings.quotas
        self.state = PoolState(store, nodes.context_overhead, now=now, work=work)
        self.tasks = Background()
        # A lambda, so a clock replaced on the state is the quotas' clock too.
        self.quotas = QuotaBook(quotas, leases, lambda: self.state.now())
        # The reclaim sweep's pressure plan (early parks, preemptions), read by every lease JSON.
        self.pressure = Pressure(pressure, nodes, self.quotas.table)
        self.views = LeaseViews(leases, self.state, self.pressure)
        placer = Placer(self.state, lambda: self.pressure.plan)
        workers = WorkerCalls(nodes, self.state, agents)
        queue = LeaseQueue(nodes, pressure, quotas, leases, self.state, self.quotas, placer, on_dequeued)
        self.leases = LeaseBook(nodes, self.state, workers, self.tasks, self.views, queue,
                                lambda job: self.parking.resume_worker(job))
        self.parking = Parking(self.state, workers, self.tasks, self.views, self.leases, queue,
                               self.quotas, on_parked, on_resumed, away_for=nodes.node_ttl + nodes.parked_node_grace)
        admission = Admission(leases, quotas, self.quotas, placer, on_refusal)
        self.intake = LeaseIntake(nodes, leases, pressure, self.state, admission, placer,
                                  self.views, self.leases, self.tasks)
        self.nodes = NodeBook(self.state, self.leases, self.tasks, heartbeat_interval=nodes.node_heartbeat_interval,
                              node_ttl=nodes.node_ttl, away_for=nodes.node_ttl + nodes.parked_node_grace,
                              on_parked=on_parked)

    def reclaimer(self) -> Reclaimer:
        """The periodic sweep, every ``c.PoolLeases.reclaim_interval`` seconds (not started)."""
        leases, nodes = self.settings.leases, self.settings.nodes
        return Reclaimer(self.state, self.leases, self.parking, self.tasks, self.pressure,
                         interval=leases.reclaim_interval, node_ttl=nodes.node_ttl,
                         parked_node_grace=nodes.parked_node_grace)

    async def resume(self) -> None:
        """After a start: continue what a previous run left half-done (starts, resumes,
        releases: :meth:`.leases.LeaseBook.resume`; parks: :meth:`.parking.Parking.restart`)."""
        await self.leases.resume()
        await self.parking.restart()

    async def shutdown(self) -> None:
        """Answer long polls, cancel background work; leases stay as they are
        and :meth:`.leases.LeaseBook.resume` continues them at the next start.
        The store threads are left to whoever closes the store (``state.work.close()``)."""
        self.state.watch.close()
        await self.tasks.cancel()
