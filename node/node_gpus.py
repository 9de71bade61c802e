"""What this node's GPUs are now and how they are sliced: the one record the
agent replaces both in when the GPUs are read again, and the parts that check
worker requests read at each request (:class:`~.agent_http.WorkerAdmission`)."""

from __future__ import annotations

from dataclasses import dataclass

from gpupool.wire.nodes import GPUInfo

from .enforcement import EnforcementMode


@dataclass
class NodeGPUs:
    """``gpus`` (UUID -> :class:`GPUInfo`, as the inventory last read them) and
    the ``enforcement`` mode that slices them. Changed only by the agent, on
    its event loop: at start, and when NVML comes back
    (:meth:`~.agent.NodeAgent.refresh_inventory`)."""

    gpus: dict[str, GPUInfo]
    enforcement: EnforcementMode
