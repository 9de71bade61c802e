"""The ``cuda-checkpoint`` checkpointer: NVIDIA's utility moves a live
process's whole CUDA state into host memory and back, for any framework,
even mid-cell. The command lines it runs, in which order, and on which
driver: docs/code.md, "cuda-checkpoint".
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess

from gpupool.units import format_bytes

from .base import Checkpointer, CheckpointError, Moved, NodeFacts, ParkTarget

BINARY = "cuda-checkpoint"
#: How long a lock waits for the work already submitted to the GPU (milliseconds).
LOCK_TIMEOUT_MS = 30_000
#: Seconds one invocation may take (a checkpoint of tens of GiB copies them to host memory).
CALL_TIMEOUT_S = 600.0
#: The first driver branch that has the utility.
MIN_DRIVER = 550


def _help(binary: str) -> str:
    """``cuda-checkpoint --help``'s text; CheckpointError when it does not run."""
    try:
        done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CheckpointError(f"{binary} --help did not run: {exc}") from None
    if done.returncode != 0:
        raise CheckpointError(f"{binary} --help failed (exit {done.returncode}): "
                              f"{(done.stdout + done.stderr).strip()[-300:]}")
    return done.stdout + done.stderr


class CudaCheckpointer(Checkpointer):
    """``cuda-checkpoint``: the driver's own checkpoint of the worker's processes."""

    name = "cuda-checkpoint"
    mid_cell = True
    remap = False  # per instance: True where --help offers --device-map
    frozen = False

    def __init__(self, log=None, binary: str | None = None) -> None:
        super().__init__(log)
        found = binary or shutil.which(BINARY)
        if found is None:
            raise CheckpointError(f"{BINARY} is not on PATH")
        self.binary = found
        text = _help(found)
        self.actions = "--action" in text
        self.remap = self.actions and "--device-map" in text

    @classmethod
    def unusable(cls, node: NodeFacts) -> str | None:
        if node.inventory != "nvml":
            return "it checkpoints processes on real GPUs (NVML), and this node's GPUs are simulated"
        binary = shutil.which(BINARY)
        if binary is None:
            return f"{BINARY} is not on PATH (NVIDIA's utility, https://github.com/NVIDIA/cuda-checkpoint)"
        major = (node.driver or "").split(".")[0]
        if major.isdigit() and int(major) < MIN_DRIVER:
            return f"the GPU driver {node.driver} is older than r{MIN_DRIVER}, the first with {BINARY}"
        try:
            _help(binary)
        except CheckpointError as exc:
            return str(exc)
        return None

    async def _run(self, *args: str) -> str:
        """One invocation; its output. CheckpointError with its words when it fails."""
        command = [self.binary, *args]
        try:
            proc = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT)
            out, _ = await asyncio.wait_for(proc.communicate(), CALL_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            raise CheckpointError(f"{' '.join(command)} did not finish: {exc or 'timed out'}") from None
        text = out.decode(errors="replace").strip()
        if proc.returncode != 0:
            raise CheckpointError(f"{' '.join(command)} failed (exit {proc.returncode}): {text[-300:] or 'no output'}")
        return text

    async def state(self, pid: int) -> str:
        """The CUDA state of process ``pid`` (``running``, ``locked``, ``checkpointed``, ``failed``)."""
        return (await self._run("--get-state", "--pid", str(pid))).strip().lower()

    async def _suspend(self, pid: int) -> None:
        if not self.actions:
            await self._run("--toggle", "--pid", str(pid))
            return
        await self._run("--action", "lock", "--pid", str(pid), "--timeout", str(LOCK_TIMEOUT_MS))
        try:
            await self._run("--action", "checkpoint", "--pid", str(pid))
        except CheckpointError:
            await self._run("--action", "unlock", "--pid", str(pid))
            raise

    async def _restore(self, pid: int, device_map: str) -> None:
        if not self.actions:
            await self._run("--toggle", "--pid", str(pid))
            return
        await self._run("--action", "restore", "--pid", str(pid), *(("--device-map", device_map) if device_map else ()))
        await self._run("--action", "unlock", "--pid", str(pid))

    async def park(self, target: ParkTarget) -> Moved:
        """Checkpoint each process of the worker that has CUDA state (its
        ``--get-state`` answers); one the inventory saw on a GPU that cannot
        say is an error. The bytes moved are the inventory's last readings."""
        done: list[int] = []
        try:
            for pid in target.pids:
                try:
                    state = await self.state(pid)
                except CheckpointError:
                    if target.gpu_memory.get(pid):
                        raise
                    continue  # no CUDA in this process
                if state != "running":
                    raise CheckpointError(f"process {pid} of lease {target.lease_id} is {state!r} for {BINARY}, "
                                          "not 'running'")
                await self._suspend(pid)
                done.append(pid)
        except CheckpointError:
            for pid in reversed(done):
                await self._restore(pid, "")
            raise
        moved = sum(target.gpu_memory.get(pid, 0) for pid in done)
        self.log.info("lease %s: %s checkpointed pid(s) %s (%s of GPU memory at the last reading)", target.lease_id,
                      BINARY, ", ".join(map(str, done)) or "none", format_bytes(moved))
        return Moved(gpu_bytes_moved=moved, state={"pids": done})

    async def resume(self, target: ParkTarget, moved: Moved, gpus: tuple[str, ...], memory: int) -> None:
        device_map = ""
        if tuple(gpus) != target.gpus:
            if not self.remap:
                raise CheckpointError(f"this node's {BINARY} cannot restore onto other GPUs (its --help offers no "
                                      f"--device-map: driver r580 or later has it)")
            device_map = ",".join(f"{old}={new}" for old, new in zip(target.gpus, gpus))
        for pid in moved.state.get("pids", []):
            await self._restore(int(pid), device_map)
