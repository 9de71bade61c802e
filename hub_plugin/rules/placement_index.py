"""An index over GPU states that gives :func:`.scheduler.place`'s answer
without scanning every GPU. Pure, in memory; the service keeps one
(:class:`gpupool.hub_plugin.capacity.CapacityIndex`), as do the simulator and
bench/scheduler_bench.py. Why it is the same answer: docs/placement.md, "The
placement index"; ``tests/rules/test_scheduler.py::test_placement_index_gives_the_same_answer_under_churn``
checks it against ``place()`` on random pools under churn.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import Counter
from typing import Collection, Iterable

from .hosts import HostState, host_misfit, proportional
from .scheduler import (Demand, GPUState, Placement, Refusal, _whole_free, claimed, has_claims, none_but_on, place,
                        place_now, slice_misfit)
from .workload import DEFAULT_WORKLOAD, EPSILON, Workload

#: How far below the asked fraction the search for partly taken GPUs starts (>> float noise).
WINDOW = 1e-8


class PlacementIndex:
    """GPU states by UUID; partly taken GPUs sorted by free fraction; nodes
    sorted by wholly free GPUs. ``workload`` is the scheduler's expected
    mix (assign :attr:`workload` to change it). ``hosts``: node -> its host
    (:class:`.hosts.HostState`), for nodes that report one. Call
    :meth:`update` / :meth:`update_host` (or :meth:`take` / :meth:`give`)
    whenever a GPU's or a host's state changes. While parked leases claim
    room (:func:`.scheduler.claimed`), a second index of the claimed view
    answers first, as ``place()`` looks there first."""

    def __init__(self, gpus: Iterable[GPUState], workload: Workload = DEFAULT_WORKLOAD,
                 hosts: dict[str, HostState] | None = None) -> None:
        self.workload = workload
        self.hosts: dict[str, HostState] = dict(hosts or {})
        self.states: dict[str, GPUState] = {}
        self._claims = 0  # GPUs parked leases claim room on
        self._soft: PlacementIndex | None = None  # the claimed view, built once a claim is made
        self._node_gpus: dict[str, list[str]] = {}
        self._idle: dict[str, int] = {}
        self._free: dict[str, float] = {}  # node -> the sum of its usable GPUs' free fractions
        self._unusable = 0  # GPUs on lost nodes or unhealthy
        for gpu in gpus:
            self._unusable += _unusable(gpu)
            self._claims += has_claims(gpu)
            self.states[gpu.uuid] = gpu
            self._node_gpus.setdefault(gpu.node, []).append(gpu.uuid)
            self._idle[gpu.node] = self._idle.get(gpu.node, 0) + _whole_free(gpu)
            self._free[gpu.node] = self._free.get(gpu.node, 0.0) + max(0.0, _usable_free(gpu))
        for uuids in self._node_gpus.values():
            uuids.sort(key=lambda u: self.states[u].index)
        self._partial = sorted(_key(g) for g in self.states.values() if not _whole_free(g))
        self._nodes = sorted((idle, node) for node, idle in self._idle.items())
        self._index_environments()
        self._tight: set[str] = set()
        for node in self.hosts:
            self._retight(node)

    def _index_environments(self) -> None:
        """Count the GPUs offering each environment; for those only some nodes
        offer, the lists of :meth:`_slice` and :meth:`_whole` over just their GPUs."""
        self._env_gpus = Counter(env for g in self.states.values() for env in g.environments)
        some = {env for env, count in self._env_gpus.items() if count < len(self.states)}
        self._env_partial = {env: sorted(_key(g) for g in self.states.values()
                                         if env in g.environments and not _whole_free(g)) for env in some}
        self._env_nodes = {env: sorted((self._idle[node], node) for node, uuids in self._node_gpus.items()
                                       if env in self.states[uuids[0]].environments) for env in some}

    def all(self) -> list[GPUState]:
        """Every GPU state, in no set order."""
        return list(self.states.values())

    def offers(self, env: str) -> bool:
        """Whether some GPU's node reports worker environment ``env`` usable (whatever its load or state)."""
        return self._env_gpus[env] > 0

    def environments(self) -> list[str]:
        """The worker environments some GPU's node reports usable, by name."""
        return sorted(name for name, count in self._env_gpus.items() if count > 0)

    def node_gpus(self, node: str) -> list[str]:
        """UUIDs of ``node``'s GPUs by index (empty for a node not indexed)."""
        return list(self._node_gpus.get(node, ()))

    def node_idle(self, node: str) -> bool:
        """Every GPU of ``node`` is wholly free (nothing allocated on it)."""
        gpus = self._node_gpus.get(node, ())
        return bool(gpus) and self._idle.get(node, 0) == len(gpus)

    def idle_nodes(self) -> int:
        """How many nodes new leases may go to (up, not degraded) have every GPU wholly free."""
        return sum(1 for node, uuids in self._node_gpus.items() if self._idle.get(node, 0) == len(uuids)
                   and not _unusable(self.states[uuids[0]]))

    def update(self, gpu: GPUState) -> None:
        """Replace the state of ``gpu.uuid`` (a GPU already indexed, on the same node)."""
        old = self.states[gpu.uuid]
        self._claims += has_claims(gpu) - has_claims(old)
        if self._soft is not None:
            self._soft.update(claimed(gpu))
        same_envs = gpu.environments is old.environments or gpu.environments == old.environments
        envs = [env for env in gpu.environments if env in self._env_partial] if same_envs else []
        partial = [self._partial, *(self._env_partial[env] for env in envs)]
        if not _whole_free(old):
            key = _key(old)
            for keys in partial:
                del keys[bisect.bisect_left(keys, key)]
        if not _whole_free(gpu):
            key = _key(gpu)
            for keys in partial:
                bisect.insort(keys, key)
        self.states[gpu.uuid] = gpu
        self._free[gpu.node] += max(0.0, _usable_free(gpu)) - max(0.0, _usable_free(old))
        self._retight(gpu.node)
        self._unusable += _unusable(gpu) - _unusable(old)
        if _whole_free(old) != _whole_free(gpu):
            before = self._idle[gpu.node]
            after = before + (1 if _whole_free(gpu) else -1)
            for nodes in (self._nodes, *(self._env_nodes[env] for env in envs)):
                del nodes[bisect.bisect_left(nodes, (before, gpu.node))]
                bisect.insort(nodes, (after, gpu.node))
            self._idle[gpu.node] = after
        if not same_envs:  # its agent registered again, offering others: rare, so count and sort again
            self._index_environments()

    def update_host(self, host: HostState) -> None:
        """Replace (or add) the host of ``host.node``."""
        self.hosts[host.node] = host
        self._retight(host.node)
        if self._soft is not None:
            self._soft.update_host(host)

    def take(self, placement: Placement) -> None:
        """Add what ``placement`` grants to its GPUs' allocation."""
        self._add(placement, 1)

    def give(self, placement: Placement) -> None:
        """Remove what ``placement`` granted from its GPUs' allocation."""
        self._add(placement, -1)

    def _add(self, placement: Placement, sign: int) -> None:
        host = self.hosts.get(placement.node)
        if host is not None:
            self.update_host(host.taken(placement.cpus or 0.0, placement.host_memory or 0, sign))
        for uuid in placement.gpus:
            g = self.states[uuid]
            fraction = g.allocated_fraction + sign * placement.fraction
            self.update(dataclasses.replace(g, allocated_fraction=0.0 if abs(fraction) <= EPSILON else fraction,
                                            allocated_memory=g.allocated_memory + sign * placement.memory))

    def place(self, demand: Demand, *, explain: bool = True) -> Placement | Refusal:
        """``place(demand, self.all(), self.workload)``, found faster (module
        docstring). ``explain=False`` returns a refusal without its reasons
        and message when the index alone knows nothing fits (no scan of every
        GPU; for callers that only need the decision, like the queue)."""
        if self._claims:
            found = self._claimed_view().place(demand, explain=False)
            if isinstance(found, Placement):
                return found
        return self._place_now(demand, explain)

    def place_off(self, demand: Demand, nodes: Collection[str]) -> Placement | Refusal:
        """:meth:`place` on every node but ``nodes`` (held for someone else): a
        scan of the other GPUs, for the rare request whose first choice is held."""
        others = [gpu for gpu in self.all() if gpu.node not in nodes]
        if not others and self.states:
            return none_but_on(demand, {gpu.node for gpu in self.all()})
        return place(demand, others, self.workload, hosts=self.hosts)

    def _claimed_view(self) -> PlacementIndex:
        if self._soft is None:
            self._soft = PlacementIndex(map(claimed, self.states.values()), self.workload, self.hosts)
        self._soft.workload = self.workload
        return self._soft

    def _place_now(self, demand: Demand, explain: bool) -> Placement | Refusal:
        """:func:`.scheduler.place_now` on every GPU, found faster."""
        if self.hosts and (demand.cpus is not None or demand.host_memory is not None):
            candidates = None  # a named host ask may bind on any node: scan everything
        elif demand.gpu_count > 1:
            candidates = self._whole(demand)
            if candidates:
                return place_now(demand, candidates, self.workload, hosts=self.hosts, node_gpus=_NodeGPUs(self))
        else:
            candidates = self._slice(demand)
            if candidates:
                return place_now(demand, candidates, self.workload, idle=self._idle, hosts=self.hosts,
                                 node_gpus=_NodeGPUs(self))
        if candidates is not None and not explain:
            return Refusal()
        return place_now(demand, self.all(), self.workload, hosts=self.hosts)

    def _fits(self, demand: Demand, gpu: GPUState) -> bool:
        return gpu.node not in self._tight and slice_misfit(demand, gpu, self.hosts.get(gpu.node)) is None

    def _retight(self, node: str) -> None:
        """Keep :attr:`_tight`: nodes whose host has less than its default share of their free GPUs."""
        host = self.hosts.get(node)
        if host is not None and node in self._free and not proportional(_DEFAULT, host, self._free[node]):
            self._tight.add(node)
        else:
            self._tight.discard(node)

    def _tight_gpus(self, demand: Demand) -> list[GPUState]:
        """Every GPU of a tight node that can take ``demand`` (a growth of its own: ``place()`` weighs each)."""
        gpus = (self.states[u] for node in sorted(self._tight) for u in self._node_gpus[node])
        if demand.gpu_count > 1:
            return [g for g in gpus if host_misfit(demand, self.hosts.get(g.node)) is None
                    and (demand.env is None or demand.env in g.environments)]
        return [g for g in gpus if slice_misfit(demand, g, self.hosts.get(g.node)) is None]

    def _slice(self, demand: Demand) -> list[GPUState]:
        found = []
        keys, nodes = self._lists(demand.env)
        i = bisect.bisect_left(keys, (demand.fraction - WINDOW,))
        while i < len(keys):
            free = keys[i][0]
            gpu = self.states[keys[i][3]]
            if self._fits(demand, gpu):
                found.append(gpu)
                # The rest of this class differs only by (node, index), and comes later.
                i = bisect.bisect_left(keys, (math.nextafter(free, math.inf),))
            else:
                i += 1
        j = bisect.bisect_left(nodes, (1, ""))
        while j < len(nodes):
            idle, node = nodes[j]
            gpu = next((g for g in map(self.states.get, self._node_gpus[node])
                        if _whole_free(g) and self._fits(demand, g)), None)
            if gpu is None:
                j += 1
            else:
                found.append(gpu)
                j = bisect.bisect_left(nodes, (idle + 1, ""))
        return found + self._tight_gpus(demand) if self._tight else found

    def _whole(self, demand: Demand) -> list[GPUState] | None:
        """The candidates (none: nothing fits), or None when only a scan of every GPU can tell."""
        if self._unusable or demand.model or demand.memory is not None:
            return None  # idle is not the same as eligible here: scan everything
        found, nodes = [], self._lists(demand.env)[1]
        j = bisect.bisect_left(nodes, (demand.gpu_count, ""))
        while j < len(nodes):
            idle, node = nodes[j]
            if node in self._tight or host_misfit(demand, self.hosts.get(node)) is not None:
                j += 1  # the next node of this class may be the first that fits
                continue
            found.extend(self.states[u] for u in self._node_gpus[node])
            j = bisect.bisect_left(nodes, (idle + 1, ""))
        return found + self._tight_gpus(demand) if self._tight else found

    def _lists(self, env: str | None) -> tuple[list, list]:
        """``(partly taken GPU keys, (idle, node) pairs)`` of the nodes offering ``env``
        (None, or one every node offers: all of them; one none offers: empty)."""
        if env is None or env not in self._env_partial:
            return (self._partial, self._nodes) if env is None or self._env_gpus[env] else ([], [])
        return self._env_partial[env], self._env_nodes[env]


class _NodeGPUs:
    """Tight node -> its GPU states by index, read from the index (for
    ``place(node_gpus=...)``); other nodes are missing: a request of the
    default share cannot bind there (:meth:`PlacementIndex._retight`)."""

    def __init__(self, index: PlacementIndex) -> None:
        self.index = index

    def get(self, node: str, default=()):
        if node not in self.index._tight:
            return default
        return [self.index.states[u] for u in self.index._node_gpus[node]]


_DEFAULT = Demand()  # a request that takes the default host share (at host_share 1: the strictest)


def _usable_free(gpu: GPUState) -> float:
    return gpu.free_fraction if not _unusable(gpu) else -1.0


def _key(gpu: GPUState) -> tuple[float, str, int, str]:
    return (gpu.free_fraction, gpu.node, gpu.index, gpu.uuid)


def _unusable(gpu: GPUState) -> bool:
    return not (gpu.node_up and gpu.healthy) or gpu.node_degraded
