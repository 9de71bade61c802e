"""The ``mps`` mode: CUDA MPS confines each worker's compute share and memory.

Sources: NVIDIA, *Multi-Process Service* guide, "Appendix: Environment
Variables" (https://docs.nvidia.com/deploy/mps/latest/appendix-environment-variables.html):

- ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``: the share of a GPU's threads (SMs)
  an MPS client may use, a percentage in (0, 100].
- ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``: the device memory an MPS client may
  allocate, ``"ordinal=limit"`` pairs separated by commas, e.g.
  ``"0=1G,1=512MB"``; ordinals are those the client sees, i.e. positions in
  its ``CUDA_VISIBLE_DEVICES``.
- ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``: where the control
  daemon (:class:`MPSControl`) listens and logs; its clients need the same.

They bind only while the control daemon runs, which :meth:`MPS.setup` makes sure of.
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import ClassVar, Sequence

from gpupool.wire.nodes import GPUInfo

from .base import MiB, EnforcementMode


class MPS(EnforcementMode):
    """Compute share and memory limit per worker through the node's MPS server."""

    name = "mps"
    watches_memory = True
    #: The control program (on PATH with the driver's utilities).
    executable: ClassVar[str] = "nvidia-cuda-mps-control"

    def __init__(self) -> None:
        super().__init__()
        self.control: MPSControl | None = None

    @staticmethod
    def running() -> bool:
        """True when an MPS control daemon runs on this host (``auto`` then picks this mode)."""
        return mps_daemon_running()

    def setup(self, state_dir: str, log: logging.Logger) -> None:
        """Join the control daemon on ``$CUDA_MPS_PIPE_DIRECTORY`` (default
        ``/tmp/nvidia-mps``) or start one, logging to ``$CUDA_MPS_LOG_DIRECTORY``
        (default ``STATE_DIR/mps-log``). Raises RuntimeError when it cannot."""
        self.control = MPSControl(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"),
                                  os.environ.get("CUDA_MPS_LOG_DIRECTORY", os.path.join(state_dir, "mps-log")),
                                  self.executable)
        try:
            log.info("MPS control daemon %s (pipe directory %s)", self.control.start(), self.control.pipe_dir)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc} (--enforcement=timeslice runs without MPS)") from None

    def close(self, log: logging.Logger) -> None:
        if self.control is not None:
            try:
                self.control.stop()  # only a daemon this agent started
            except RuntimeError as exc:
                log.warning("%s", exc)

    def environment(self, gpus: Sequence[GPUInfo | str], fraction: float, memory: int, lease_id: str,
                    owner: str, node: str) -> dict[str, str]:
        """The slice's variables plus the MPS client limits: the fraction as a
        thread percentage (at least 1), the memory rounded down to whole MiB
        per GPU the worker sees, and the daemon's directories once set up."""
        env = super().environment(gpus, fraction, memory, lease_id, owner, node)
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, round(fraction * 100)))
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{ordinal}={int(memory) // MiB}M"
                                                           for ordinal in range(len(gpus)))
        if self.control is not None:
            env.update(self.control.environment())
        return env


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
        return os.path.exists(os.path.join(self.pipe_dir, "control"))

    def start(self) -> str:
        """Join or start the daemon; returns ``"joined"`` or ``"started"``."""
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
