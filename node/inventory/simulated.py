"""A declared GPU inventory for nodes without a GPU (``--simulate``).

Everything but CUDA itself runs for real on such a node: the agent registers
these GPUs, the service places slices on them, workers start with the slice's
environment. The table below gives each model the name, memory and compute
capability NVML reports for it, so what users see looks like a real pool.

Its memory readings are those of the simulated device memory workers hold
(:mod:`..simgpu`): each allocation file's resident pages, per process and per
GPU, as NVML's process list and ``memory.used`` would give them (so a park,
which moves those pages out, shows the GPU memory freed). Utilization stays
unknown: nothing computes on a simulated GPU. Each reading first sweeps the
files of processes that are gone.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from gpupool.wire.nodes import GPUInfo

from .. import simgpu_store
from ..attribution import GPUProcess, memory_by_pid
from .base import Inventory, InventoryError, InventoryOptions

MiB = 1024**2

# Names the stable simulated UUIDs (uuid5 of this namespace and "node/index").
_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://github.com/gpupool/gpupool/simulated-gpu")


@dataclass(frozen=True)
class GPUModel:
    """One simulated GPU model: NVML ``name``, ``memory_mib`` total as
    ``nvmlDeviceGetMemoryInfo`` reports it, ``reserved_mib`` the driver's
    reservation (``nvmlMemory_v2_t.reserved``), ``compute_capability``."""

    name: str
    memory_mib: int
    reserved_mib: int
    compute_capability: str


# Names and totals as NVML/nvidia-smi print them; the reservations are typical
# values of recent (>= 535) drivers.
MODELS: dict[str, GPUModel] = {
    "A100-80GB": GPUModel("NVIDIA A100-SXM4-80GB", 81920, 609, "8.0"),
    "A100-40GB": GPUModel("NVIDIA A100-SXM4-40GB", 40960, 433, "8.0"),
    "H100-80GB": GPUModel("NVIDIA H100 80GB HBM3", 81559, 533, "9.0"),
    "H200-141GB": GPUModel("NVIDIA H200", 143771, 561, "9.0"),
    "L4-24GB": GPUModel("NVIDIA L4", 23034, 276, "8.9"),
    "T4-16GB": GPUModel("Tesla T4", 15360, 255, "7.5"),
    "V100-32GB": GPUModel("Tesla V100-SXM2-32GB", 32768, 306, "7.0"),
}

# Short names accepted where they are not ambiguous ("H200" but not "A100").
_ALIASES = {"H100": "H100-80GB", "H200": "H200-141GB", "L4": "L4-24GB", "T4": "T4-16GB", "V100": "V100-32GB"}

_ITEM = re.compile(r"^\s*(?:([-+]?\d+)\s*[xX]\s*)?([A-Za-z0-9-]+)\s*$")  # a sign, to say why -1 is no count
MAX_GPUS = 64


def parse_spec(spec: str) -> list[tuple[str, GPUModel]]:
    """Parse ``"2xA100-80GB"``, ``"A100-40GB"``, ``"1xH100-80GB,2xL4-24GB"``.

    Returns one ``(model key, GPUModel)`` per GPU, in order. Model names are
    case-insensitive. Raises ValueError naming the known models for an unknown
    one, and for empty specs, zero counts or more than 64 GPUs.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty GPU spec; write it like '2xA100-80GB' (known models: {known_models()})")
    gpus: list[tuple[str, GPUModel]] = []
    for item in spec.split(","):
        match = _ITEM.match(item)
        if not match:
            raise ValueError(f"cannot read {item.strip()!r} in {spec!r}; write COUNTxMODEL like '2xA100-80GB'")
        count = int(match.group(1) or 1)
        if count < 1:
            raise ValueError(f"GPU count must be at least 1 in {item.strip()!r}")
        key = _model_key(match.group(2))
        gpus.extend([(key, MODELS[key])] * count)
        if len(gpus) > MAX_GPUS:
            raise ValueError(f"{spec!r} declares more than {MAX_GPUS} GPUs")
    return gpus


def known_models() -> str:
    """The accepted model names, for error messages."""
    return ", ".join([*MODELS, *_ALIASES])


def _model_key(text: str) -> str:
    upper = text.upper()
    for key in MODELS:
        if key.upper() == upper:
            return key
    if upper in _ALIASES:
        return _ALIASES[upper]
    raise ValueError(f"unknown GPU model {text!r}; known models: {known_models()}")


def simulated_uuid(node_name: str, index: int) -> str:
    """NVML-style ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, the same for the
    same node name and index across restarts (so leases survive them)."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node_name}/{index}')}"


class SimulatedInventory(Inventory):
    """The GPUs declared by ``spec`` on node ``node_name``.

    Raises ValueError for a bad spec (see :func:`parse_spec`).
    """

    kind = "simulated"

    def __init__(self, spec: str, node_name: str) -> None:
        self.spec = spec
        self.node_name = node_name
        self._gpus = [
            GPUInfo(uuid=simulated_uuid(node_name, index), name=model.name, index=index,
                    memory_total=model.memory_mib * MiB, memory_reserved=model.reserved_mib * MiB,
                    compute_capability=model.compute_capability)
            for index, (_key, model) in enumerate(parse_spec(spec))
        ]

    @classmethod
    def create(cls, options: InventoryOptions) -> "SimulatedInventory":
        """The GPUs of ``options.simulate`` (``--simulate``), their simulated
        memory's folders made (:func:`..simgpu_store.prepare`): InventoryError
        without one, for a bad one, or when the folders cannot be made."""
        if not options.simulate:
            raise InventoryError("the simulated inventory declares the GPUs of --simulate, e.g. "
                                 "--simulate=2xA100-80GB (c.AgentInventory.simulate); none is set")
        try:
            made = cls(options.simulate, options.node_name)
        except ValueError as exc:
            raise InventoryError(f"bad --simulate value: {exc}") from None
        try:
            simgpu_store.prepare([gpu.uuid for gpu in made._gpus])  # the agent's: before any worker makes it
        except OSError as exc:
            raise InventoryError(f"cannot make the simulated GPU memory's folder {simgpu_store.root()}: "
                                 f"{exc.strerror or exc} (GPUPOOL_SIMGPU_ROOT)") from None
        return made

    def discover(self) -> list[GPUInfo]:
        return list(self._gpus)

    def metrics(self) -> list[dict[str, Any]]:
        """Per GPU the bytes its simulated memory holds; utilization unknown (None, never 0)."""
        used = dict.fromkeys((gpu.uuid for gpu in self._gpus), 0)
        for allocation in self._allocations():
            used[allocation.gpu] += allocation.resident
        return [{"uuid": gpu.uuid, "memory_used": used[gpu.uuid], "utilization": None} for gpu in self._gpus]

    def process_usage(self) -> list[GPUProcess]:
        """One record per process and GPU holding simulated memory (its resident bytes; no SM reading)."""
        per: dict[tuple[str, int], int] = {}
        for allocation in self._allocations():
            key = (allocation.gpu, allocation.pid)
            per[key] = per.get(key, 0) + allocation.resident
        return [GPUProcess(gpu, pid, pid, memory) for (gpu, pid), memory in sorted(per.items())]

    def process_memory(self) -> dict[int, int]:
        return memory_by_pid(self.process_usage())

    def process_known(self) -> set[str]:
        return {gpu.uuid for gpu in self._gpus}

    def _allocations(self) -> list[simgpu_store.AllocationFile]:
        """This node's GPUs' allocation files, after sweeping those of processes that are gone."""
        simgpu_store.sweep()
        return simgpu_store.allocations(gpus={gpu.uuid for gpu in self._gpus})
