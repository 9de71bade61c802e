"""``c.AgentParking``: how the node parks workers: the checkpointer that moves
their GPU state, the host memory parked workers may hold, and where spilled
ones go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from traitlets import Bool, Unicode, validate
from traitlets.config import Configurable

from gpupool.traits import ByteSize, Duration

from .. import checkpoint
from .choices import auto_or_one_of


class AgentParking(Configurable):
    """Parking on this node (docs/parking.md). The defaults that depend on the
    host or the agent's state directory are resolved by :meth:`budget`,
    :meth:`headroom` and :meth:`spill_folder`, given those."""

    checkpointer = Unicode(
        "auto",
        help=f"""How this node moves a parked worker's GPU state to host memory and back
        (docs/parking.md), one of auto, {", ".join(checkpoint.available())}: ``cuda-checkpoint``
        (NVIDIA's utility on PATH, driver r550+: the whole CUDA state of any framework, even
        while a cell runs; onto another GPU of the same model where its ``--help`` offers
        ``--device-map``), ``framework`` (the worker moves its PyTorch tensors to pinned host
        memory in place between cells: a running cell is interrupted to park; CuPy and JAX
        arrays and the CUDA context stay on the GPU, said in words), ``simulated`` (the
        simulated GPUs' memory of a ``--simulate`` node), or a checkpointer of the
        ``gpupool.checkpointers`` entry point group. ``auto`` (default): ``cuda-checkpoint``
        where it works, ``simulated`` on simulated GPUs, else ``framework``. Reported at
        registration. ``c.AgentParking.checkpointer = "framework"``.""",
    ).tag(config=True)

    @validate("checkpointer")
    def _checkpointer_valid(self, proposal: Any) -> str:
        return auto_or_one_of(proposal, checkpoint.available())

    parked_memory = ByteSize(
        None, allow_none=True,
        help="""Host RAM this node's parked workers may hold together (their processes and the
        GPU state moved out of the GPU), bytes or units (``"256GiB"``); reported at
        registration. When a park would take them past it, the longest-parked workers are
        spilled to ``spill_dir`` (their namespace saved, their process ended; what cannot be
        saved is listed in words), and a worker that alone would not fit spills at once.
        Default: None, a quarter of the host's RAM (``c.AgentInventory.host_memory`` when set,
        else psutil's total): parked workers share the host with the active leases, whose own host
        memory the service places by, so most of it stays theirs.
        ``c.AgentParking.parked_memory = "512GiB"``.""",
    ).tag(config=True)

    spill_dir = Unicode(
        "", help="""Folder for the namespaces of spilled workers (one folder per lease, the
        agent's only, removed when the lease resumes or ends); fast local disk, with room for
        ``parked_memory`` at least. Default: empty, ``STATE_DIR/spill``.
        ``c.AgentParking.spill_dir = "/scratch/gpupool-spill"``.""",
    ).tag(config=True)

    park_headroom = ByteSize(
        None, allow_none=True,
        help="""Host memory a park must leave available (``MemAvailable`` of /proc/meminfo) after
        it moves a worker's GPU state to host RAM, bytes or units; a park that would leave less
        spills the worker to disk instead, so a host short of memory never has the kernel's
        OOM killer end a parked worker. Default: None, 5 % of the host's RAM, at least 1 GiB.
        ``c.AgentParking.park_headroom = "8GiB"``.""",
    ).tag(config=True)

    spill_fetch_timeout = Duration(
        240.0, help="""Seconds this node may take to fetch the spill of a lease moved here from
        another node (a resume with ``spill_from``: its namespace streamed from that node's agent
        into ``spill_dir``), or to take the namespace of a lease moved here from another node's
        memory (``move_from``: worker to worker); past it the resume fails with ``park_failed``,
        nothing is left here and the state stays where it was. It is also how long a worker this
        node offered for such a move waits to be taken before this node spills it to disk. Give it the largest state at the network's rate (a 100 GiB
        state at 1 GB/s takes about 110 s), and keep it, with a new worker's start and the load,
        within the service's ``c.PoolNodes.worker_park_timeout`` (default 5 minutes), which is how
        long the service waits for the whole resume. Default: 240 (4 minutes).
        ``c.AgentParking.spill_fetch_timeout = "10m"``.""",
    ).tag(config=True)

    park_on_stop = Bool(
        True, help="""Whether a stopping agent (SIGTERM or SIGINT: ``systemctl restart``, a pod's
        deletion, an upgrade) first saves each lease's worker to ``spill_dir``, as a spill does
        (its namespace; a running cell is interrupted; what cannot be saved is named), so the
        leases stay parked on this node's disk and the next cell resumes them once an agent runs
        here again on the same state directory (docs/parking.md, "Agent restarts"). The service
        ends them after ``c.PoolNodes.parked_node_grace`` if none does. False: a stop ends every
        lease of the node, its workers and variables lost. Default: True.
        ``c.AgentParking.park_on_stop = False``.""",
    ).tag(config=True)

    park_on_stop_timeout = Duration(
        240.0, help="""Seconds a stopping agent may take to save its workers to ``spill_dir``
        (``park_on_stop``; all at once, each in its own process); a worker not saved by then is
        stopped and its lease ends. Keep it below the stop timeout of what runs the agent, less
        a minute for the stop itself: systemd's ``TimeoutStopSec``, Kubernetes'
        ``terminationGracePeriodSeconds`` (300 in deploy/). Default: 240 (4 minutes).
        ``c.AgentParking.park_on_stop_timeout = "10m"``.""",
    ).tag(config=True)

    def budget(self, host_memory: int) -> int:
        """Bytes parked workers may hold: ``parked_memory``, or a quarter of
        ``host_memory`` (the bytes the node offers, :meth:`NodeAgent.host_totals`)."""
        return self.parked_memory if self.parked_memory is not None else host_memory // 4

    def headroom(self, host_memory: int) -> int:
        """Bytes a park must leave available: ``park_headroom``, or 5 % of
        ``host_memory`` (bytes), at least 1 GiB."""
        return self.park_headroom if self.park_headroom is not None else max(1 << 30, host_memory // 20)

    def spill_folder(self, state_dir: Path) -> Path:
        """``spill_dir``, or ``state_dir/spill`` (the agent's state directory's)."""
        return Path(self.spill_dir or state_dir / "spill")
