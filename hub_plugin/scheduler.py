"""Placement: which GPU(s) a lease request goes to. Pure: state in, decision out.

Nothing here does I/O or imports SQL, so tests compare literal inputs with
literal outputs (as HAMi's ``pkg/scheduler/policy`` and kubespawner's
``objects.py`` do). The caller (:mod:`.leases`) builds the :class:`GPUState`
list inside the transaction that then writes the lease, so the decision and
the reservation cannot drift apart.

Rules:

- A slice (``gpu_count == 1``) goes to the GPU that is left with the least
  free fraction after placing it (best fit), ties broken by node name, then
  GPU index. Packing slices tightly keeps whole GPUs free for whole-GPU asks.
- ``N`` whole GPUs (``gpu_count >= 2``) need ``N`` completely free GPUs on one
  node; the node with the fewest free GPUs that still fits is chosen (best fit
  again), ties by node name; on it, the lowest indices.
- Memory of a slice is ``fraction x usable memory`` unless the request names
  an amount; either must fit in the GPU's free memory (usable minus what
  leases hold). Usable memory is total minus driver-reserved minus the CUDA
  context overhead, computed by the caller.
- ``model`` is a case-insensitive substring of the GPU name (``"a100"``).
- Every GPU that is not chosen is counted under one reason, and the refusal
  message is built from these counts, so a user learns why (HAMi's
  ``FitError`` tally).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from gpupool.units import format_bytes

#: Tolerance for sums of fractions: 0.1 + 0.2 + 0.7 must fill a GPU exactly.
EPSILON = 1e-9

# Rejection reasons, in the order they are checked; a GPU counts under the first that applies.
NODE_LOST = "node lost"
UNHEALTHY = "unhealthy"
MODEL_MISMATCH = "model mismatch"
NO_FRACTION = "not enough free fraction"
NO_MEMORY = "not enough free memory"
FEW_ON_NODE = "too few free GPUs on its node"
WHOLE_ONLY = "whole GPUs only on its node (mig or exclusive enforcement)"
REASONS = (NODE_LOST, UNHEALTHY, MODEL_MISMATCH, WHOLE_ONLY, NO_FRACTION, NO_MEMORY, FEW_ON_NODE)


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
    node whose enforcement (``mig``, ``exclusive``) gives out whole GPUs only.
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
    fraction's share; ``model`` a GPU-name substring or None."""

    fraction: float = 1.0
    gpu_count: int = 1
    memory: int | None = None
    model: str | None = None

    def describe(self) -> str:
        """``'0.50'``, ``'0.50 with 20.0 GiB'``, ``'2 whole GPUs'``, ``... of model A100``."""
        text = f"{self.gpu_count} whole GPUs" if self.gpu_count > 1 else f"{self.fraction:.2f}"
        if self.memory is not None:
            text += f" with {format_bytes(self.memory)}"
        if self.model:
            text += f" of model {self.model}"
        return text


@dataclass(frozen=True)
class Placement:
    """Where a demand goes: ``gpus`` are UUIDs on ``node``; ``fraction`` per
    GPU; ``memory`` bytes per GPU (the slice's limit)."""

    node: str
    gpus: tuple[str, ...]
    fraction: float
    memory: int


@dataclass(frozen=True)
class Refusal:
    """Why nothing fits: ``reasons`` maps a reason to how many GPUs it ruled
    out; ``message`` says it to a person, with what is free."""

    reasons: dict[str, int] = field(default_factory=dict)
    message: str = ""


def place(demand: Demand, gpus: list[GPUState] | tuple[GPUState, ...]) -> Placement | Refusal:
    """Choose GPU(s) for ``demand`` among ``gpus``; see the module docstring."""
    if demand.gpu_count > 1:
        return _place_whole(demand, gpus)
    return _place_slice(demand, gpus)


def _ineligible(demand: Demand, gpu: GPUState) -> str | None:
    """The reason ``gpu`` cannot serve ``demand`` whatever its load, or None."""
    if not gpu.node_up:
        return NODE_LOST
    if not gpu.healthy:
        return UNHEALTHY
    if demand.model and demand.model.lower() not in gpu.name.lower():
        return MODEL_MISMATCH
    if gpu.whole_only and demand.fraction < 1.0 - EPSILON:
        return WHOLE_ONLY
    return None


def _slice_memory(demand: Demand, gpu: GPUState) -> int:
    return demand.memory if demand.memory is not None else gpu.share(demand.fraction)


def _place_slice(demand: Demand, gpus) -> Placement | Refusal:
    reasons: Counter[str] = Counter()
    fits: list[tuple[float, str, int, GPUState]] = []
    for gpu in gpus:
        reason = _ineligible(demand, gpu)
        if reason is None and gpu.allocated_fraction + demand.fraction > 1.0 + EPSILON:
            reason = NO_FRACTION
        if reason is None and _slice_memory(demand, gpu) > gpu.free_memory:
            reason = NO_MEMORY
        if reason is not None:
            reasons[reason] += 1
            continue
        # Round so float noise (0.30000000000000004) does not break ties.
        left = round(gpu.free_fraction - demand.fraction, 9)
        fits.append((left, gpu.node, gpu.index, gpu))
    if not fits:
        return _refusal(demand, gpus, reasons)
    gpu = min(fits, key=lambda item: item[:3])[3]
    return Placement(gpu.node, (gpu.uuid,), demand.fraction, _slice_memory(demand, gpu))


def _place_whole(demand: Demand, gpus) -> Placement | Refusal:
    reasons: Counter[str] = Counter()
    free_by_node: dict[str, list[GPUState]] = {}
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
    fitting = [(len(free), node) for node, free in free_by_node.items() if len(free) >= demand.gpu_count]
    if not fitting:
        reasons[FEW_ON_NODE] += sum(len(free) for free in free_by_node.values())
        return _refusal(demand, gpus, reasons)
    node = min(fitting)[1]
    chosen = sorted(free_by_node[node], key=lambda g: g.index)[: demand.gpu_count]
    memory = demand.memory if demand.memory is not None else min(g.memory_usable for g in chosen)
    return Placement(node, tuple(g.uuid for g in chosen), 1.0, memory)


def _refusal(demand: Demand, gpus, reasons: Counter[str]) -> Refusal:
    """Tell a person what is free and why each GPU was ruled out."""
    counts = {reason: reasons[reason] for reason in REASONS if reasons[reason]}
    asked = f"no node has {demand.describe()} free now" if demand.gpu_count > 1 \
        else f"no GPU can take {demand.describe()} now"
    if not gpus:
        return Refusal({"no GPUs": 1}, f"{asked}: the pool has no GPUs (no agent has registered a node)")
    usable = [g for g in gpus if g.node_up and g.healthy]
    noun = "GPU" if len(gpus) == 1 else "GPUs"
    if usable:
        best = min(usable, key=lambda g: (-g.free_fraction, -g.free_memory, g.node, g.index))
        free = f"the most free is {best.free_fraction:.2f}"
        if demand.memory is not None or NO_MEMORY in counts:
            free += f" and {format_bytes(best.free_memory)}"
        free += f" ({best.node} GPU {best.index}, {best.name})"
    else:
        free = "none is usable now"
    tally = ", ".join(f"{reason} on {count}" for reason, count in counts.items())
    return Refusal(counts, f"{asked}: {len(gpus)} {noun} in the pool, {free}; {tally}")

