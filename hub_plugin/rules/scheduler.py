"""Placement: which GPU(s) a lease request goes to. Pure: state in, decision out.

Nothing here does I/O or imports SQL, so tests compare literal inputs with
literal outputs. The caller (:mod:`gpupool.hub_plugin.leases`) builds the
:class:`GPUState` list inside the transaction that then writes the lease, so
the decision and the reservation cannot drift apart. The rules
(fragmentation-aware best fit; whole GPUs on one node; memory, model,
environment and host room; the refusal's tally of reasons): docs/placement.md.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Collection

from gpupool.units import format_bytes, format_share

from .hosts import (NO_CPUS, NO_HOST_MEMORY, HostState, binds, host_ask, host_aware_delta, host_misfit,
                    proportional, roomiest)
from .misfits import Misfit
from .workload import DEFAULT_WORKLOAD, EPSILON, Workload, slice_delta, whole_delta

# Rejection reasons (:class:`.misfits.Misfit`), in the order they are checked; a GPU counts under the
# first that applies.
NODE_LOST = Misfit.node_lost
NODE_DEGRADED = Misfit.node_degraded
UNHEALTHY = Misfit.gpu_unhealthy
NO_ENVIRONMENT = Misfit.no_environment
MODEL_MISMATCH = Misfit.model_mismatch
NO_FRACTION = Misfit.no_fraction
NO_MEMORY = Misfit.no_memory
FEW_ON_NODE = Misfit.few_on_node
WHOLE_ONLY = Misfit.whole_gpus_only
REASONS = (NODE_LOST, NODE_DEGRADED, UNHEALTHY, NO_ENVIRONMENT, MODEL_MISMATCH, WHOLE_ONLY, NO_FRACTION, NO_MEMORY,
           NO_CPUS, NO_HOST_MEMORY, FEW_ON_NODE)


@dataclass(frozen=True)
class GPUState:
    """One GPU as the scheduler sees it.

    Memory in bytes. ``memory_usable`` is what leases may share (total minus
    driver-reserved minus context overhead); ``allocated_fraction`` and
    ``allocated_memory`` are the sums over the leases that hold capacity on
    it. ``observed_memory_used`` is NVML's latest reading, shown in messages
    only: it includes driver and context memory that the reservations already
    account for, so placing by it would refuse requests that fit.
    ``memory_unattributed`` is memory NVML sees used by processes of no
    worker: it is taken, whoever holds it. ``whole_only`` marks GPUs of a
    node whose enforcement mode gives out whole GPUs only (its capacity rule,
    ``whole_gpus`` at registration: ``mig``, ``exclusive`` or a plugin's).
    ``node_degraded`` marks GPUs of a node whose agent is alive but cannot
    read its GPUs (NVML failed): its leases go on, nothing new goes there.
    ``environments`` names the worker environments its node reports usable
    (one frozenset shared by the node's GPUs) and ``default_env`` the one a
    lease naming none runs in (None: the node reported none).
    ``parked_fraction`` and ``parked_memory`` are what the leases parked off
    this GPU would take back at their resume (their share, less the memory
    already in ``allocated_memory`` as ``gpu_bytes_kept``): not held, but
    claimed (:func:`claimed`): :func:`place` keeps it free while other room fits.
    """

    uuid: str
    node: str
    name: str
    index: int
    memory_total: int
    memory_usable: int
    allocated_fraction: float = 0.0
    allocated_memory: int = 0
    observed_memory_used: int | None = None
    healthy: bool = True
    node_up: bool = True
    memory_unattributed: int = 0
    whole_only: bool = False
    node_degraded: bool = False
    environments: frozenset[str] = frozenset()
    default_env: str | None = None
    parked_fraction: float = 0.0
    parked_memory: int = 0

    @property
    def free_fraction(self) -> float:
        """Share of the GPU no lease holds, in [0, 1]."""
        return max(0.0, 1.0 - self.allocated_fraction)

    @property
    def free_memory(self) -> int:
        """Usable bytes no lease holds (>= 0)."""
        return max(0, self.memory_usable - self.allocated_memory - self.memory_unattributed)

    @property
    def is_idle(self) -> bool:
        """True when no lease holds any of it."""
        return self.allocated_fraction <= EPSILON and self.allocated_memory <= 0

    def share(self, fraction: float) -> int:
        """Bytes of ``fraction`` of this GPU's usable memory."""
        return int(fraction * self.memory_usable)


@dataclass(frozen=True)
class Demand:
    """What a lease asks for: ``fraction`` of one GPU, or ``gpu_count`` whole
    GPUs (then ``fraction`` is 1); ``memory`` bytes per GPU or None for the
    fraction's share; ``model`` a GPU-name substring or None; ``env`` the
    worker environment the node must offer, or None for any node. ``cpus``
    (cores) and ``host_memory`` (bytes) of the node's host, or None for
    ``host_share`` x the GPU share's part of the node's (:mod:`.hosts`)."""

    fraction: float = 1.0
    gpu_count: int = 1
    memory: int | None = None
    model: str | None = None
    env: str | None = None
    cpus: float | None = None
    host_memory: int | None = None
    host_share: float = 1.0

    def describe(self, *, noun: bool = False) -> str:
        """``'0.50'`` (``noun``: ``'0.50 of a GPU'``), ``'0.50 with 20.0 GiB'``, ``'2 whole GPUs'``,
        ``... of model A100``."""
        text = format_share(self.fraction, self.gpu_count, noun=noun, whole=True)
        if self.memory is not None:
            text += f" with {format_bytes(self.memory)}"
        if self.model:
            text += f" of model {self.model}"
        if self.env:
            text += f" in environment {self.env}"
        host = [f"{self.cpus:g} CPUs"] if self.cpus is not None else []
        host += [f"{format_bytes(self.host_memory)} host memory"] if self.host_memory is not None else []
        return text + (f" and {' and '.join(host)}" if host else "")


@dataclass(frozen=True)
class Placement:
    """Where a demand goes: ``gpus`` are UUIDs on ``node``; ``fraction`` per
    GPU; ``memory`` bytes per GPU (the slice's limit); ``env`` the worker
    environment it runs in (the demand's, else the node's default; None when
    the node reported none); ``cpus`` cores and ``host_memory`` bytes of the
    node's host (None: the node reports no host, nothing reserved or limited)."""

    node: str
    gpus: tuple[str, ...]
    fraction: float
    memory: int
    env: str | None = None
    cpus: float | None = None
    host_memory: int | None = None


@dataclass(frozen=True)
class Refusal:
    """Why nothing fits: ``reasons`` maps a :class:`.misfits.Misfit` to how
    many GPUs it ruled out; ``message`` says it to a person, with what is free."""

    reasons: dict[Misfit, int] = field(default_factory=dict)
    message: str = ""

    def tally(self) -> dict[str, int]:
        """``reasons`` in words (the 409's ``reasons``, docs/api.md): ``{"not enough free fraction": 2}``."""
        return {reason.words: count for reason, count in self.reasons.items()}


def idle_counts(gpus) -> dict[str, int]:
    """Node -> how many of its GPUs are wholly free and healthy."""
    idle: Counter[str] = Counter()
    for gpu in gpus:
        idle[gpu.node] += _whole_free(gpu)
    return dict(idle)


def claimed(gpu: GPUState) -> GPUState:
    """``gpu`` as though its parked leases held their share again: the view in
    which :func:`place` looks first, so that a new lease goes elsewhere while
    it can and a parked lease finds its room when it resumes (its worker lives
    on its node: docs/placement.md, "Parked leases")."""
    if not has_claims(gpu):
        return gpu
    return replace(gpu, allocated_fraction=gpu.allocated_fraction + gpu.parked_fraction,
                   allocated_memory=gpu.allocated_memory + gpu.parked_memory, parked_fraction=0.0, parked_memory=0)


def has_claims(gpu: GPUState) -> bool:
    """Parked leases would take some of ``gpu`` back (:func:`claimed` changes it)."""
    return gpu.parked_fraction > EPSILON or gpu.parked_memory > 0


def place(demand: Demand, gpus: list[GPUState] | tuple[GPUState, ...], workload: Workload = DEFAULT_WORKLOAD,
          *, hosts: dict[str, HostState] | None = None) -> Placement | Refusal:
    """Choose GPU(s) for ``demand`` among ``gpus``: first as though parked
    leases held what they claim (:func:`claimed`), else as they are (a
    refusal says why in the GPUs' own terms); see the module docstring and
    :func:`place_now`."""
    if any(has_claims(g) for g in gpus):
        found = place_now(demand, [claimed(g) for g in gpus], workload, hosts=hosts)
        if isinstance(found, Placement):
            return found
    return place_now(demand, gpus, workload, hosts=hosts)


def place_now(demand: Demand, gpus: list[GPUState] | tuple[GPUState, ...], workload: Workload = DEFAULT_WORKLOAD,
              *, idle: dict[str, int] | None = None, hosts: dict[str, HostState] | None = None,
              node_gpus=None) -> Placement | Refusal:
    """Choose GPU(s) for ``demand`` among ``gpus`` as their states are, parked
    leases' claims ignored (:func:`place` weighs them).

    ``workload`` is the expected mix of requests the fragmentation measure
    weighs (an empty one leaves plain best fit). ``idle`` maps each node to
    its wholly free healthy GPUs (:func:`idle_counts`); it defaults to the
    count over ``gpus`` and is passed by callers that give a subset
    (:mod:`.placement_index`). ``node_gpus``: node -> all its GPUs, for the
    nodes where the host may bind (default: every node's, from ``gpus``; a
    node missing: the GPU-only growth). ``hosts``: node -> its host (None, or a node
    missing: no host dimension there)."""
    hosts = hosts or {}
    nodes = (node_gpus if node_gpus is not None else _may_bind(demand, _by_node(gpus), hosts)) if hosts else {}
    if demand.gpu_count > 1:
        return _place_whole(demand, gpus, workload, hosts, nodes)
    return _place_slice(demand, gpus, workload, idle_counts(gpus) if idle is None else idle, hosts, nodes)


def _whole_free(gpu: GPUState) -> bool:
    return gpu.is_idle and gpu.healthy


def _ineligible(demand: Demand, gpu: GPUState) -> Misfit | None:
    """The reason ``gpu`` cannot serve ``demand`` whatever its load, or None."""
    if not gpu.node_up:
        return NODE_LOST
    if gpu.node_degraded:
        return NODE_DEGRADED
    if not gpu.healthy:
        return UNHEALTHY
    if demand.env is not None and demand.env not in gpu.environments:
        return NO_ENVIRONMENT
    if demand.model and demand.model.lower() not in gpu.name.lower():
        return MODEL_MISMATCH
    if gpu.whole_only and demand.fraction < 1.0 - EPSILON:
        return WHOLE_ONLY
    return None


def _slice_memory(demand: Demand, gpu: GPUState) -> int:
    return demand.memory if demand.memory is not None else gpu.share(demand.fraction)


def slice_misfit(demand: Demand, gpu: GPUState, host: HostState | None = None) -> Misfit | None:
    """Why ``gpu`` (on ``host``, if it has one) cannot take the slice ``demand`` now (a reason), or None."""
    reason = _ineligible(demand, gpu)
    if reason is None and gpu.allocated_fraction + demand.fraction > 1.0 + EPSILON:
        reason = NO_FRACTION
    if reason is None and _slice_memory(demand, gpu) > gpu.free_memory:
        reason = NO_MEMORY
    return reason or host_misfit(demand, host)


def slice_key(demand: Demand, gpu: GPUState, idle: int, workload: Workload, host: HostState | None = None,
              node_gpus: list[GPUState] | None = None) -> tuple[float, float, str, int]:
    """What a slice placement minimises over the GPUs that fit: (fragmentation
    growth, free fraction left, node, index); rounded so float noise
    (0.30000000000000004) does not break ties. ``node_gpus``: all of the
    node's GPUs, where it has a ``host`` (:func:`.hosts.binds`)."""
    free = [_free_or_unusable(g) for g in node_gpus] if host is not None and node_gpus else None
    taken = {node_gpus.index(gpu): demand.fraction} if free is not None else {}
    if free is not None and binds(demand, host, workload, free, taken):
        delta = host_aware_delta(demand, host, free, taken, workload)
    else:
        delta = slice_delta(gpu.free_fraction, _whole_free(gpu), idle, demand.fraction, workload)
    return (round(delta, 9), round(gpu.free_fraction - demand.fraction, 9), gpu.node, gpu.index)


def _free_or_unusable(gpu: GPUState) -> float:
    return gpu.free_fraction if gpu.healthy and gpu.node_up and not gpu.node_degraded else -1.0


def _by_node(gpus) -> dict[str, list[GPUState]]:
    nodes: dict[str, list[GPUState]] = {}
    for gpu in gpus:
        nodes.setdefault(gpu.node, []).append(gpu)
    return nodes


def _may_bind(demand: Demand, nodes: dict[str, list[GPUState]], hosts: dict[str, HostState]):
    """``nodes`` less those whose host cannot bind for ``demand`` (:func:`.hosts.proportional`)."""
    return {node: gpus for node, gpus in nodes.items()
            if not proportional(demand, hosts.get(node), sum(max(0.0, _free_or_unusable(g)) for g in gpus))}


def _placement(demand: Demand, node: str, uuids: tuple[str, ...], fraction: float, memory: int, env: str | None,
               host: HostState | None) -> Placement:
    cpus, host_memory = host_ask(demand, host) if host is not None else (demand.cpus, demand.host_memory)
    return Placement(node, uuids, fraction, memory, env, cpus, host_memory)


def _place_slice(demand: Demand, gpus, workload: Workload, idle: dict[str, int], hosts: dict[str, HostState],
                 nodes) -> Placement | Refusal:
    reasons: Counter[Misfit] = Counter()
    best, best_key = None, None
    host_reasons: dict[str, Misfit | None] = {}  # one host check per node
    for gpu in gpus:
        host = hosts.get(gpu.node)
        reason = slice_misfit(demand, gpu)
        if reason is None and host is not None:
            if gpu.node not in host_reasons:
                host_reasons[gpu.node] = host_misfit(demand, host)
            reason = host_reasons[gpu.node]
        if reason is not None:
            reasons[reason] += 1
            continue
        key = slice_key(demand, gpu, idle.get(gpu.node, 0), workload, host, nodes.get(gpu.node))
        if best_key is None or key < best_key:
            best, best_key = gpu, key
    if best is None:
        return _refusal(demand, gpus, reasons, hosts)
    return _placement(demand, best.node, (best.uuid,), demand.fraction, _slice_memory(demand, best),
                      demand.env or best.default_env, hosts.get(best.node))


def _place_whole(demand: Demand, gpus, workload: Workload, hosts: dict[str, HostState], nodes) -> Placement | Refusal:
    reasons: Counter[Misfit] = Counter()
    free_by_node: dict[str, list[GPUState]] = {}
    idle = idle_counts(gpus)
    for gpu in gpus:
        reason = _ineligible(demand, gpu)
        if reason is None and not gpu.is_idle:
            reason = NO_FRACTION
        if reason is None and demand.memory is not None and demand.memory > gpu.memory_usable:
            reason = NO_MEMORY
        if reason is not None:
            reasons[reason] += 1
            continue
        free_by_node.setdefault(gpu.node, []).append(gpu)
    fitting = []
    for node, free in free_by_node.items():
        reason = host_misfit(demand, hosts.get(node)) if len(free) >= demand.gpu_count else None
        if reason is not None:
            reasons[reason] += len(free)
        elif len(free) >= demand.gpu_count:
            fitting.append((round(_whole_growth(demand, node, free, idle, workload, hosts, nodes), 9), len(free),
                            node))
    if not fitting:
        reasons[FEW_ON_NODE] += sum(len(free) for free in free_by_node.values()
                                    if len(free) < demand.gpu_count)
        return _refusal(demand, gpus, reasons, hosts)
    node = min(fitting)[2]
    chosen = _lowest(free_by_node[node], demand.gpu_count)
    memory = demand.memory if demand.memory is not None else min(g.memory_usable for g in chosen)
    return _placement(demand, node, tuple(g.uuid for g in chosen), 1.0, memory, demand.env or chosen[0].default_env,
                      hosts.get(node))


def _lowest(free: list[GPUState], count: int) -> list[GPUState]:
    return sorted(free, key=lambda g: g.index)[:count]


def _whole_growth(demand: Demand, node: str, free: list[GPUState], idle: dict[str, int], workload: Workload,
                  hosts: dict[str, HostState], nodes) -> float:
    """Fragmentation growth of taking ``demand``'s whole GPUs on ``node``: every dimension where its host binds."""
    host, everything = hosts.get(node), nodes.get(node, ())
    if host is None or not everything:  # no host, or one that cannot bind (node_gpus leaves it out)
        return whole_delta(idle[node], demand.gpu_count, workload)
    taken = {everything.index(g): 1.0 for g in _lowest(free, demand.gpu_count)}
    vector = [_free_or_unusable(g) for g in everything]
    if not binds(demand, host, workload, vector, taken):
        return whole_delta(idle[node], demand.gpu_count, workload)
    return host_aware_delta(demand, host, vector, taken, workload)


def _asked(demand: Demand) -> str:
    return f"no node has {demand.describe()} free now" if demand.gpu_count > 1 \
        else f"no GPU can take {demand.describe()} now"


def none_but_on(demand: Demand, nodes: Collection[str]) -> Refusal:
    """The refusal for ``demand`` when every GPU of the pool is on ``nodes``, which were left
    out (held for another request, or tried already): not "the pool has no GPUs"."""
    return Refusal({Misfit.no_gpus: 1}, f"{_asked(demand)}: no node but {', '.join(sorted(nodes))} has GPUs")


def _refusal(demand: Demand, gpus, reasons: Counter[Misfit], hosts: dict[str, HostState] | None = None) -> Refusal:
    """Tell a person what is free and why each GPU was ruled out."""
    counts = {reason: reasons[reason] for reason in REASONS if reasons[reason]}
    asked = _asked(demand)
    if not gpus:
        return Refusal({Misfit.no_gpus: 1}, f"{asked}: the pool has no GPUs (no agent has registered a node)")
    usable = [g for g in gpus if g.node_up and g.healthy and not g.node_degraded
              and (demand.env is None or demand.env in g.environments)]
    noun = "GPU" if len(gpus) == 1 else "GPUs"
    if usable:
        best = min(usable, key=lambda g: (-g.free_fraction, -g.free_memory, g.node, g.index))
        free = f"the most free is {best.free_fraction:.2f}"
        if demand.memory is not None or NO_MEMORY in counts:
            free += f" and {format_bytes(best.free_memory)}"
        free += f" ({best.node} GPU {best.index}, {best.name})"
    else:
        free = "none is usable now"
    if hosts and (NO_CPUS in counts or NO_HOST_MEMORY in counts):
        free += f"; {roomiest(hosts)}"
    tally = "; ".join(f"{count} {'GPU' if count == 1 else 'GPUs'} ruled out: {reason.words}"
                      for reason, count in counts.items())
    return Refusal(counts, f"{asked}: {len(gpus)} {noun} in the pool, {free}; {tally}")

