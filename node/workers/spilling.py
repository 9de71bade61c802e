"""The spill tier of parking (docs/parking.md): a worker's namespace saved in
the node's spill folder as a pull of everything would send it
(:mod:`..worker_extension.spill`), its process ended, and, at the resume, a
new worker started on the lease's slice that loads it.

A worker parked in memory first gets its GPU state back in host memory where
its own process can read it (:meth:`~..checkpoint.Checkpointer.to_host`) and
is thawed; a cell frozen mid-way is interrupted (said in ``lost``). What
could not be saved is listed by name with the reason, in words, in the
park's answer, the spill's manifest and every heartbeat until the resume,
whose answer says it again with what did not load.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpupool.errors import GPUPoolError, Reason
from gpupool.schema import WorkerState
from gpupool.transfer import COPIED_AS_CONTENTS, shown_name
from gpupool.units import format_bytes
from gpupool.wire.nodes import WorkerReport
from gpupool.wire.parking import WorkerParked, WorkerResumed
from gpupool.wire.transfer import LoadSpill, Spill

from ..checkpoint import CheckpointError
from ..checkpoint.framework import ask
from .handle import Worker
from .parkstate import NAMESPACE, Spilled, read_spills
from .spec import WorkerSpec, WorkerStartError

if TYPE_CHECKING:
    import logging

    from .manager import WorkerManager
    from .parking import WorkerParking




def lost_words(errors: dict[str, str], doing: str, types: dict[str, str] | None = None) -> list[str]:
    """``{name: why}`` of a pull's header (``"TypeName cannot be sent: reason"``)
    as one line per name, for ``doing`` (``"saved to disk"``), and the saved
    names of ``types`` (name -> type) that come back as another kind of object."""
    words = [f"{shown_name(name)}: {why.replace('cannot be sent', f'cannot be {doing}')}"
             for name, why in sorted(errors.items())]
    return words + [f"{name}: an open file ({kind}) comes back as an in-memory copy of what it held, not open"
                    for name, kind in sorted((types or {}).items()) if kind in COPIED_AS_CONTENTS]


class SpillFailed(GPUPoolError):
    """502 ``park_failed``: the namespace of ``lease``'s worker could not be saved (``cause``, in
    words); the worker stays as it was, ``parked`` in memory or where it is."""

    def __init__(self, lease: str, cause: str, parked: bool) -> None:
        super().__init__(Reason.park_failed, f"could not spill the worker of lease {lease} to disk: {cause}; it stays "
                         f"{'parked in memory' if parked else 'where it is'}", 502)
        self.cause = cause


class Spilling:
    """The spilled leases of ``manager``'s node, under ``spill_dir``."""

    def __init__(self, spill_dir: Path, manager: WorkerManager, parking: WorkerParking, log: logging.Logger) -> None:
        self.spill_dir = spill_dir
        self.manager = manager
        self.parking = parking
        self.log = log
        self.spilled: dict[str, Spilled] = {}

    def recover(self) -> list[Spilled]:
        """Read the spills an earlier run of the agent left; remove the
        folders of spills it did not finish. Returns the spills found."""
        self.spill_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        spills, leftovers = read_spills(self.spill_dir)
        for folder in leftovers:
            self.log.warning("removing %s: a spill that did not finish", folder)
            shutil.rmtree(folder, ignore_errors=True)
        self.spilled.update({spill.lease_id: spill for spill in spills})
        return spills

    def reports(self) -> list[WorkerReport]:
        return [WorkerReport(s.lease_id, None, WorkerState.idle, idle_since=s.idle_since, parked="disk",
                             parked_host_bytes=0, parked_disk_bytes=s.disk_bytes, parked_lost=s.lost)
                for s in self.spilled.values()]

    def remove(self, lease_id: str) -> bool:
        """Forget the spill of ``lease_id`` and remove its files; False when it has none."""
        spill = self.spilled.pop(lease_id, None)
        if spill is None:
            return False
        spill.remove()
        self.log.info("removed the spill of lease %s (%s)", lease_id, format_bytes(spill.disk_bytes))
        return True

    # -- spill --------------------------------------------------------------------

    async def spill(self, worker: Worker, began: float, why: str, interrupted: bool = False) -> WorkerParked:
        """Save ``worker``'s namespace and end it (``why``: in words, logged);
        the park's answer. Call under the lease's lock. 502 ``park_failed``
        when the namespace could not be saved (the worker is then as it was:
        running, or parked in memory)."""
        lease = worker.name
        self.log.info("spilling the worker of lease %s to disk: %s", lease, why)
        folder = self.spill_dir / lease
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, mode=0o700)
        if worker.user is not None:  # the worker writes the file itself, as its own account
            os.chown(folder, worker.user.uid, worker.user.gid)
        lost: list[str] = ["the running cell was interrupted"] if interrupted else []
        parked = worker.parked
        gpu_bytes = parked.moved.gpu_bytes_moved if parked else sum(self.parking.target(worker).gpu_memory.values())
        try:
            if parked is not None and not parked.offered:  # an offered one is thawed, its state readable
                await self.parking.checkpointer.to_host(self.parking.target(worker), parked.moved)
                await self.parking.thaw(worker)
            if worker.activity.cell_running:  # a cell frozen mid-way, or one a park let run
                await self.parking.interrupt(worker)
                interrupted = True
                lost.append("the running cell was interrupted" if parked is None else
                            "the running cell, frozen mid-way, was interrupted")
            answer = await asyncio.to_thread(ask, worker.connection(), Spill(path=str(folder / NAMESPACE)))
        except (CheckpointError, GPUPoolError) as exc:
            shutil.rmtree(folder, ignore_errors=True)
            if parked is not None and not parked.offered:
                await self.parking.freeze(worker)
            raise SpillFailed(lease, getattr(exc, "message", str(exc)), parked is not None) from None
        lost += lost_words(answer.get("errors") or {}, "saved to disk", answer.get("types"))
        spec = worker.spec
        spill = Spilled(lease, spec.owner, folder, spec.gpus, spec.fraction, spec.memory, time.time(),
                        int(answer.get("nbytes", 0)), tuple(lost), worker.activity.idle_since_iso(),
                        tuple(answer.get("items", [])) + tuple(answer.get("modules", [])))
        spill.write()
        await self.manager.end_spilled(worker)
        self.spilled[lease] = spill
        seconds = time.monotonic() - began
        self.log.info("spilled the worker of lease %s: %s on disk, %d name(s) saved, %d not (%s) in %.1fs", lease,
                      format_bytes(spill.disk_bytes), len(spill.names), len(lost), "; ".join(lost) or "nothing lost",
                      seconds)
        return WorkerParked("disk", self.parking.checkpointer.name, host_bytes=0, disk_bytes=spill.disk_bytes,
                            gpu_bytes_moved=gpu_bytes, interrupted=interrupted,
                            lost=tuple(lost), seconds=round(seconds, 4))

    # -- resume from disk ---------------------------------------------------------

    async def resume(self, spill: Spilled, spec: WorkerSpec, kept: str | None = None) -> WorkerResumed:
        """Start a new worker on ``spec`` and load ``spill`` into it; its
        answer (its ``lost``: what the spill could not save, and what did not
        load). Call under the lease's lock. 502 ``worker_start_failed`` or
        ``park_failed`` (the spill is kept: a resume can try again). ``kept``:
        where the spill stays when this fails, in words, for a caller that
        does not keep it here (a spill fetched from another node)."""
        began = time.monotonic()  # any GPUs: a value whose device the new worker lacks comes back on the CPU, said so
        try:
            worker = await self.manager.start_locked(spec)
        except WorkerStartError as exc:
            raise GPUPoolError(Reason.worker_start_failed, str(exc) if kept is None else f"{exc}; {kept}",
                               502) from None
        try:
            if worker.user is not None:  # the new worker's account reads the file
                for path in (spill.folder, spill.namespace):
                    os.chown(path, worker.user.uid, worker.user.gid)
            answer = await asyncio.to_thread(ask, worker.connection(), LoadSpill(path=str(spill.namespace)))
        except (CheckpointError, OSError) as exc:
            await self.manager.stop_locked(spill.lease_id)
            raise GPUPoolError(Reason.park_failed, f"the new worker of lease {spill.lease_id} could not load what was "
                               f"spilled: {exc}; {kept or 'it stays on disk'}", 502) from None
        lost = (*spill.lost, *lost_words(answer.get("errors") or {}, "loaded"))
        self.remove(spill.lease_id)
        seconds = time.monotonic() - began
        self.log.info("resumed lease %s from disk into a new worker (pid %s) in %.1fs: %d name(s) loaded",
                      spill.lease_id, worker.pid, seconds, len(answer.get("loaded", [])))
        return WorkerResumed(worker.pid, worker.connection(), "disk", round(seconds, 4), tuple(lost))

