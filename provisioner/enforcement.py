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
(:mod:`gpupool.provisioner.worker_extension`) caps its allocator from
``GPUPOOL_MEMORY_LIMIT``.

The node's mode (:data:`MODES`: ``mps``, ``mig``, ``timeslice``,
``exclusive``; :func:`enforcement_mode`), the MPS control daemon
(:class:`MPSControl`) and the memory watchdog (:class:`MemoryWatchdog`) live
here too; docs/enforcement.md says what each mode guarantees and what not.
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


# The modes an agent can enforce slices with, chosen per node
# (``c.NodeAgent.enforcement_mode``); docs/enforcement.md says what each
# guarantees. "none" is reported by simulated nodes, where nothing runs on a GPU.
MODES = ("mps", "mig", "timeslice", "exclusive")


def enforcement_mode(inventory_kind: str, mps_daemon: bool, requested: str = "auto", mig: bool = False) -> str:
    """The mode the agent enforces slices with, reported as ``enforcement`` at
    registration and shown by ``gpupool status``.

    ``inventory_kind``: ``"simulated"`` gives ``"none"`` whatever was asked.
    ``requested``: one of :data:`MODES`, or ``"auto"``: ``"mig"`` when the
    node's GPUs are MIG instances (``mig``), ``"mps"`` when an MPS control
    daemon runs (``mps_daemon``), else ``"timeslice"``. Raises ValueError for
    an unknown mode.
    """
    if requested != "auto" and requested not in MODES:
        raise ValueError(f"unknown enforcement mode {requested!r}; choose one of auto, {', '.join(MODES)}")
    if inventory_kind == "simulated":
        return "none"
    if requested != "auto":
        return requested
    if mig:
        return "mig"
    return "mps" if mps_daemon else "timeslice"


def check_slice(mode: str, fraction: float) -> None:
    """Refuse what ``mode`` cannot enforce: ``mig`` hands out whole MIG
    instances and ``exclusive`` whole GPUs, so ``fraction`` must be 1 there.
    Raises ValueError naming the node's mode."""
    if mode in ("mig", "exclusive") and fraction < 1:
        unit = "MIG instances" if mode == "mig" else "GPUs"
        raise ValueError(f"this node enforces slices with {mode!r}: it hands out whole {unit} only, "
                         f"not a fraction of {fraction:g}")


def mps_daemon_running() -> bool:
    """True when an ``nvidia-cuda-mps-control`` process runs on this host."""
    import psutil

    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "nvidia-cuda-mps-control":
            return True
    return False




class MPSControl:
    """The CUDA MPS control daemon the agent starts or joins.

    ``pipe_dir``: ``CUDA_MPS_PIPE_DIRECTORY`` (where the daemon's ``control``
    socket lives; workers get the same value), ``log_dir``:
    ``CUDA_MPS_LOG_DIRECTORY``. ``executable``: the control program.

    :meth:`start` joins a daemon already listening on ``pipe_dir`` or starts
    one with ``-d``; :meth:`command` sends one control command and returns
    its answer. Both raise RuntimeError with the daemon's words on failure
    (e.g. no ``nvidia-cuda-mps-control`` on PATH: install the driver's
    utilities).
    """

    def __init__(self, pipe_dir: str, log_dir: str, executable: str = "nvidia-cuda-mps-control") -> None:
        self.pipe_dir, self.log_dir, self.executable = pipe_dir, log_dir, executable
        self.started = False

    def environment(self) -> dict[str, str]:
        """The variables that point a client (a worker) at this daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}

    def listening(self) -> bool:
        """True when a daemon's control socket exists in ``pipe_dir``."""
        import os

        return os.path.exists(os.path.join(self.pipe_dir, "control"))

    def start(self) -> str:
        """Join or start the daemon; returns ``"joined"`` or ``"started"``."""
        import os
        import subprocess

        if self.listening():
            return "joined"
        os.makedirs(self.pipe_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            done = subprocess.run([self.executable, "-d"], env={**os.environ, **self.environment()},
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"cannot start the MPS control daemon ({self.executable} -d): {exc}") from None
        if done.returncode != 0:
            raise RuntimeError(f"{self.executable} -d failed ({done.returncode}): {done.stderr.strip()}")
        self.started = True
        return "started"

    def command(self, text: str) -> str:
        """Send ``text`` (e.g. ``get_server_list``) to the daemon; its answer."""
        import os
        import subprocess

        try:
            done = subprocess.run([self.executable], input=text + "\n", env={**os.environ, **self.environment()},
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"the MPS control daemon did not answer {text!r}: {exc}") from None
        if done.returncode != 0:
            raise RuntimeError(f"the MPS control daemon refused {text!r}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout.strip()

    def stop(self) -> None:
        """Stop the daemon if this object started it (``quit``); a joined one stays."""
        if self.started:
            self.command("quit")
            self.started = False


class MemoryWatchdog:
    """The agent's memory watchdog: stops a worker whose process tree uses
    more GPU memory than its slice, as NVML measures it.

    NVML counts a process's CUDA context (a few hundred MiB) that framework
    caps do not, so a worker is over when it uses more than ``limit +
    allowance`` bytes on one GPU (``allowance`` in bytes), for ``strikes``
    readings in a row (a one-off peak while a framework frees memory is
    forgiven). Pure: readings in, verdicts out.
    """

    def __init__(self, allowance: int = 1024 * MiB, strikes: int = 2) -> None:
        self.allowance, self.strikes = allowance, strikes
        self._over: dict[str, int] = {}

    def check(self, usage: dict[str, dict[str, int]], limits: dict[str, int]) -> list[tuple[str, str]]:
        """``usage``: lease -> GPU UUID -> bytes; ``limits``: lease -> bytes per
        GPU. Returns ``(lease, reason)`` for each worker to stop now."""
        verdicts = []
        for lease in list(self._over):
            if lease not in limits:
                del self._over[lease]
        for lease, limit in limits.items():
            worst = max(usage.get(lease, {}).items(), key=lambda item: item[1], default=None)
            if worst is None or worst[1] <= limit + self.allowance:
                self._over.pop(lease, None)
                continue
            self._over[lease] = self._over.get(lease, 0) + 1
            if self._over[lease] >= self.strikes:
                del self._over[lease]
                verdicts.append((lease, f"it used {worst[1] // MiB} MiB on GPU {worst[0]}, more than its slice's "
                                        f"{limit // MiB} MiB (+{self.allowance // MiB} MiB for the CUDA context)"))
        return verdicts
