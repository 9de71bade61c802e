"""The ``framework`` checkpointer: the worker moves its own GPU memory to
host memory between cells (:mod:`..worker_extension.offload`), asked by the
agent on the worker's transfer comm; works with any driver, for what the
frameworks let it move (PyTorch tensors in place; CuPy and JAX pools
emptied), and reports the rest (the CUDA context) as kept on the GPU.

It needs the worker idle (the comm runs between cells), so a park with a
running cell interrupts it first (``mid_cell`` False), and the worker's CUDA
context is bound to its GPUs, so it cannot restore onto others (``remap``
False). The agent freezes the worker after it moved its memory, and thaws it
before asking for it back.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gpupool.errors import GPUPoolError
from gpupool.wire.transfer import TARGET as TRANSFER_TARGET, ParkGpu, Request, ResumeGpu
from gpupool.remote import RemoteKernel

from .base import Checkpointer, CheckpointError, Moved, ParkTarget

#: Seconds the worker gets to move its memory one way (a few GiB over PCIe take seconds).
TIMEOUT_S = 300.0


def ask(connection: dict[str, Any], request: Request, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """One request on the worker's transfer comm (its ops are
    :data:`~..worker_extension.comm.PARKING_OPS`), over a connection of its
    own; the answer's data. Blocking: call it in a thread. CheckpointError
    when the worker does not answer, or answers not ok."""
    remote = RemoteKernel(dict(connection))
    try:
        remote.wait_ready(min(timeout, 30.0))
        answer, _ = remote.comm_request(TRANSFER_TARGET, request.to_json(), timeout=timeout)
    except GPUPoolError as exc:
        raise CheckpointError(f"the worker did not answer the {request.OP} request: {exc.message}") from None
    finally:
        remote.close()
    if not answer.get("ok"):
        raise CheckpointError(f"the worker could not {request.OP}: {answer.get('message')}")
    return answer


class FrameworkCheckpointer(Checkpointer):
    """``framework``: in the worker, between cells."""

    name = "framework"
    mid_cell = False
    remap = False
    frozen = False

    async def park(self, target: ParkTarget) -> Moved:
        answer = await asyncio.to_thread(ask, target.connection, ParkGpu())
        return Moved(gpu_bytes_moved=int(answer.get("moved", 0)), gpu_bytes_kept=int(answer.get("kept", 0)),
                     lost=tuple(str(w) for w in answer.get("lost", ())))

    async def resume(self, target: ParkTarget, moved: Moved, gpus: tuple[str, ...], memory: int) -> None:
        if tuple(gpus) != target.gpus:
            raise CheckpointError("the framework checkpointer restores onto the worker's own GPUs only (its CUDA "
                                  f"context is bound to {', '.join(target.gpus)})")
        await asyncio.to_thread(ask, target.connection, ResumeGpu())

    async def to_host(self, target: ParkTarget, moved: Moved) -> None:
        """Nothing to do: the tensors are in the worker's host memory already, and know their device."""
