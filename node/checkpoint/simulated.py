"""The ``simulated`` checkpointer: the simulated GPUs' device memory
(:mod:`..simgpu`) moved to host memory and back, for nodes without a GPU:
each allocation file renamed into the agent's ``.parked`` copy and back, no
byte copied (docs/parking.md, "The agent's part").
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

from gpupool.units import format_bytes

from .. import simgpu_store as store
from .base import Checkpointer, CheckpointError, Moved, NodeFacts, ParkTarget


class SimulatedCheckpointer(Checkpointer):
    """``simulated``: mid-cell and onto another GPU (nothing on a simulated GPU can say no)."""

    name = "simulated"
    mid_cell = True
    remap = True
    frozen = True

    @classmethod
    def unusable(cls, node: NodeFacts) -> str | None:
        if node.inventory != "simulated":
            return "it moves simulated GPU memory, and this node's GPUs are real (use cuda-checkpoint or framework)"
        return None

    @staticmethod
    def _host(lease_id: str) -> Path:
        return store.root() / store.PARKED / lease_id

    async def park(self, target: ParkTarget) -> Moved:
        return await asyncio.to_thread(self._park, target)

    def _park(self, target: ParkTarget) -> Moved:
        host = self._host(target.lease_id)
        moved: list[tuple[Path, Path, int]] = []
        try:
            for pid in target.pids:
                for allocation in store.process_files(pid):
                    copy = host / allocation.gpu / allocation.path.name
                    copy.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                    os.rename(allocation.path, copy)
                    moved.append((allocation.path, copy, allocation.size))
        except OSError as exc:
            for source, copy, _ in moved:  # everything back, then say why
                os.rename(copy, source)
            shutil.rmtree(host, ignore_errors=True)
            raise CheckpointError(f"could not move the simulated GPU memory of lease {target.lease_id} to host "
                                  f"memory: {exc.strerror or exc}") from None
        total = sum(size for _, _, size in moved)
        self.log.info("lease %s: %s of simulated GPU memory moved to host memory (%d allocation(s))",
                      target.lease_id, format_bytes(total), len(moved))
        return Moved(gpu_bytes_moved=total, host_bytes=total,
                     state={"files": [[str(copy.relative_to(host)), size] for _, copy, size in moved]})

    async def resume(self, target: ParkTarget, moved: Moved, gpus: tuple[str, ...], memory: int) -> None:
        await asyncio.to_thread(self._resume, target, moved, gpus, memory)

    def _resume(self, target: ParkTarget, moved: Moved, gpus: tuple[str, ...], memory: int,
                into: Path | None = None) -> None:
        """Put the host copies back: into the folders of ``gpus`` (in the order
        of the lease's GPUs), or, with ``into``, all into that folder."""
        host = self._host(target.lease_id)
        renamed = dict(zip(target.gpus, gpus))
        try:
            for relative, _ in moved.state.get("files", []):
                gpu, name = Path(relative).parts
                place = (into / name) if into is not None else store.gpu_dir(renamed.get(gpu, gpu)) / name
                if into is None and place.parent != store.gpu_dir(gpu):
                    store.make_shared(place.parent)  # another GPU's folder, made if this run had none yet
                os.rename(host / relative, place)  # the same inode: the worker's mapping follows
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"could not put the simulated GPU memory of lease {target.lease_id} back: "
                                  f"{getattr(exc, 'strerror', None) or exc}") from None
        if into is None and (tuple(gpus) != target.gpus or memory != target.memory):
            for pid in target.pids:
                store.write_binding(pid, list(gpus), memory)
        shutil.rmtree(host, ignore_errors=True)

    async def to_host(self, target: ParkTarget, moved: Moved) -> None:
        """For a spill: the pages go back into the worker's files moved out of
        the GPU folders (``.parked/<lease>.spill``), so the spill reads them
        without the readings counting them as GPU memory."""
        into = store.root() / store.PARKED / f"{target.lease_id}.spill"
        into.mkdir(parents=True, exist_ok=True, mode=0o700)
        await asyncio.to_thread(self._resume, target, moved, target.gpus, target.memory, into)

    async def discard(self, target: ParkTarget, moved: Moved) -> None:
        """Drop the host copies; the files of the worker's processes, killed by now, are swept at once."""
        for folder in (self._host(target.lease_id), store.root() / store.PARKED / f"{target.lease_id}.spill"):
            await asyncio.to_thread(shutil.rmtree, folder, True)
        await asyncio.to_thread(store.sweep)
