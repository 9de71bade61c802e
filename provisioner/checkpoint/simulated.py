"""The ``simulated`` checkpointer: the simulated GPUs' device memory
(:mod:`..simgpu`) moved to host memory and back, for nodes without a GPU.

A park copies each allocation file of the frozen worker's processes into a
host copy the agent holds (``.parked/<lease>/<GPU>/<pid>-<n>`` under the
simulated memory's root, a tmpfs file: it survives an agent killed with -9,
as the driver's copy of a real checkpoint lives on in the process) and
punches the file's pages out as it goes, so the inventory's readings show the
GPU memory freed, as NVML would. The worker's arrays keep their mapping; the
process is frozen, so nothing touches them meanwhile. A resume writes the
pages back (the mapping sees them again) and punches the host copy; onto
another GPU it first moves the file into that GPU's folder (the same inode:
the mapping stays) and tells the process its new GPUs and limit (the binding
file, :func:`..simgpu_store.write_binding`). Both move :data:`CHUNK` bytes
at a time, so the host never holds a worker's state twice.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import os
import shutil
from pathlib import Path

from gpupool.units import format_bytes

from .. import simgpu_store as store
from .base import Checkpointer, CheckpointError, Moved, NodeFacts, ParkTarget

#: Bytes moved, then punched, at a time.
CHUNK = 64 << 20
_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (linux/falloc.h)
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)


def punch(fd: int, offset: int, length: int) -> None:
    """Free the pages of ``length`` bytes at ``offset`` of the file ``fd``, keeping its size."""
    if _libc.fallocate(fd, _PUNCH, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def move(source: Path, target: Path, size: int) -> None:
    """Copy ``size`` bytes of ``source`` into ``target`` (made when missing,
    its size kept when it exists) chunk by chunk, punching each chunk out of
    ``source`` once copied. OSError (ENOSPC: the host's tmpfs is full) once
    the chunks already moved are back in ``source``."""
    src = os.open(source, os.O_RDWR)
    try:
        dst = os.open(target, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(dst).st_size < size:
                os.ftruncate(dst, size)
            done = 0
            try:
                while done < size:
                    length = min(CHUNK, size - done)
                    _copy(src, dst, done, length)
                    punch(src, done, length)
                    done += length
            except OSError:
                _copy(dst, src, 0, done)  # into pages just freed: room the failed copy needs no more of
                raise
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _copy(src: int, dst: int, offset: int, length: int) -> None:
    """``length`` bytes at ``offset`` of ``src`` to the same place in ``dst``: in
    the kernel (``copy_file_range``) within one file system, else through a buffer."""
    copied = 0
    while copied < length:
        at = offset + copied
        try:
            step = os.copy_file_range(src, dst, length - copied, at, at)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            data = os.pread(src, min(length - copied, 8 << 20), at)
            step = os.pwrite(dst, data, at) if data else 0
        if step == 0:
            raise OSError(errno.EIO, f"the file ended at {at} bytes")
        copied += step


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
                    move(allocation.path, copy, allocation.size)
                    moved.append((allocation.path, copy, allocation.size))
        except OSError as exc:
            for source, copy, size in moved:  # everything back, then say why
                move(copy, source, size)
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
        """Write the host copies back: into their GPU's files (on ``gpus``),
        or, with ``into``, into files moved there out of every GPU folder."""
        host = self._host(target.lease_id)
        renamed = dict(zip(target.gpus, gpus))
        try:
            for relative, size in moved.state.get("files", []):
                copy = host / relative
                gpu, name = Path(relative).parts
                place = (into / name) if into is not None else store.gpu_dir(renamed.get(gpu, gpu)) / name
                if place != store.gpu_dir(gpu) / name:
                    store.make_shared(place.parent)
                    os.rename(store.gpu_dir(gpu) / name, place)  # the same inode: the worker's mapping follows
                move(copy, place, int(size))
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
