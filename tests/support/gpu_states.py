"""GPU states for the pure scheduling rules' table tests."""

from __future__ import annotations

from gpupool.hub_plugin.rules.scheduler import GPUState

GiB = 1024**3


A100 = "NVIDIA A100-SXM4-80GB"


H100 = "NVIDIA H100 80GB HBM3"


def gpu(node: str, index: int, *, name: str = A100, usable: int = 80 * GiB, fraction: float = 0.0,
        memory: int | None = None, healthy: bool = True, up: bool = True, unattributed: int = 0,
        whole_only: bool = False, degraded: bool = False, envs: tuple[str, ...] = ()) -> GPUState:
    """A GPU with ``fraction`` allocated (and that share of memory unless ``memory`` is given);
    its node offers the worker environments ``envs``, the first one its default."""
    taken = int(fraction * usable) if memory is None else memory
    return GPUState(uuid=f"GPU-{node}-{index}", node=node, name=name, index=index, memory_total=usable + GiB,
                    memory_usable=usable, allocated_fraction=fraction, allocated_memory=taken,
                    healthy=healthy, node_up=up, memory_unattributed=unattributed, whole_only=whole_only,
                    node_degraded=degraded, environments=frozenset(envs), default_env=envs[0] if envs else None)
