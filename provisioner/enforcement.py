"""How a slice's limits reach a worker: its environment.

:func:`slice_environment` is pure (literal inputs, literal outputs) so the
exact variables a worker gets are tested without a GPU. Sources for each
variable:

- ``CUDA_VISIBLE_DEVICES`` with GPU UUIDs: CUDA C Programming Guide, "CUDA
  Environment Variables", and the MPS guide, which recommends UUIDs over
  indices because an MPS server remaps indices
  (https://docs.nvidia.com/deploy/mps/latest/appendix-environment-variables.html).
- ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``: the share of a GPU's threads (SMs)
  an MPS client may use, a percentage in (0, 100] (same MPS page).
- ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``: the device memory an MPS client may
  allocate, ``"ordinal=limit"`` pairs separated by commas, e.g.
  ``"0=1G,1=512MB"``; ordinals are those the client sees, i.e. positions in
  its ``CUDA_VISIBLE_DEVICES`` (same MPS page).
- ``XLA_PYTHON_CLIENT_PREALLOCATE`` / ``XLA_PYTHON_CLIENT_MEM_FRACTION``: JAX
  "GPU memory allocation" (https://docs.jax.dev/en/latest/gpu_memory_allocation.html).
- ``TF_FORCE_GPU_ALLOW_GROWTH``: TensorFlow "Use a GPU", limiting GPU memory
  growth (https://www.tensorflow.org/guide/gpu).

The MPS variables bind only when an MPS control daemon runs on the node
(:func:`enforcement_mode` reports which case holds); the framework variables
bind in any case. PyTorch has no such variable; the worker extension
(:mod:`gpupool.provisioner.worker`) caps its allocator from
``GPUPOOL_MEMORY_LIMIT``.
"""

from __future__ import annotations

import math
from typing import Sequence

from gpupool.schema import GPUInfo

MiB = 1024**2


def slice_environment(gpus: Sequence[GPUInfo | str], fraction: float, memory: int, lease_id: str,
                      owner: str, node: str) -> dict[str, str]:
    """The environment variables of a worker confined to a slice.

    ``gpus``: the lease's GPUs (GPUInfo, or bare UUID strings), in the order
    the worker should see them; ``fraction``: compute share in (0, 1] of each
    GPU; ``memory``: the memory limit in bytes per GPU; ``lease_id``,
    ``owner``, ``node``: recorded for the user's code and for logs.

    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is ``memory / memory_total`` when the
    GPUs' memory is known (GPUInfo), else ``fraction``; it is rounded down to
    3 decimals, as the MPS limit is rounded down to whole MiB, so a framework
    never gets more than the lease holds.

    Raises ValueError for no GPUs, a fraction outside (0, 1] or a memory limit
    below 1 MiB.
    """
    if not gpus:
        raise ValueError("a slice needs at least one GPU")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if int(memory) != memory or memory < MiB:
        raise ValueError(f"memory must be a whole number of bytes of at least 1 MiB, got {memory!r}")
    memory = int(memory)
    uuids = [gpu.uuid if isinstance(gpu, GPUInfo) else str(gpu) for gpu in gpus]
    totals = [gpu.memory_total for gpu in gpus if isinstance(gpu, GPUInfo)]
    share = min(1.0, memory / min(totals)) if len(totals) == len(uuids) else fraction
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(uuids),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, round(fraction * 100))),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(f"{ordinal}={memory // MiB}M" for ordinal in range(len(uuids))),
        "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{max(0.001, math.floor(share * 1000) / 1000):.3f}",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "GPUPOOL_LEASE_ID": lease_id,
        "GPUPOOL_OWNER": owner,
        "GPUPOOL_NODE": node,
        "GPUPOOL_GPU_UUIDS": ",".join(uuids),
        "GPUPOOL_FRACTION": f"{fraction:g}",
        "GPUPOOL_MEMORY_LIMIT": str(memory),
    }


def enforcement_mode(inventory_kind: str, mps_daemon: bool) -> str:
    """What the agent reports as ``enforcement`` at registration.

    ``"none"``: simulated GPUs, nothing to enforce; ``"mps"``: an MPS control
    daemon runs, so the compute and memory limits are enforced by CUDA;
    ``"env"``: real GPUs without MPS, the limits are advisory (frameworks
    that read the variables honour them, raw CUDA does not).
    """
    if inventory_kind == "simulated":
        return "none"
    return "mps" if mps_daemon else "env"


def mps_daemon_running() -> bool:
    """True when an ``nvidia-cuda-mps-control`` process runs on this host."""
    import psutil

    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "nvidia-cuda-mps-control":
            return True
    return False
