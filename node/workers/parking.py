"""Park in place (docs/parking.md, "The agent's part"): a lease's worker
frozen where it is, its GPU state in host memory, and resumed on the GPUs
the service grants again; or, when the node's parked-memory budget or its
host memory runs short, spilled to disk (:mod:`.spilling`).

:class:`WorkerParking` is what :class:`~.manager.WorkerManager` calls, under
the lease's lock. It touches a worker only through its handle
(:class:`~.handle.Worker`: its cgroup, processes, connection, activity), so
it works for whichever launcher started it. The order of freezing and moving
is the checkpointer's (:attr:`~..checkpoint.Checkpointer.frozen`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

import psutil

from gpupool.errors import GPUPoolError, Reason, bad_request
from gpupool.remote import interrupt_from_thread
from gpupool.schema import WorkerState
from gpupool.units import format_bytes
from gpupool.wire.parking import ParkRequest, WorkerParked, WorkerResumed
from gpupool.wire.transfer import ForgetTraceback

from ..cgroups import CgroupError
from ..checkpoint import Checkpointer, CheckpointError, ParkTarget
from ..checkpoint.framework import ask
from ..host_limits import enforce as enforce_host_limits
from .handle import Worker
from .parkstate import ParkedInMemory
from .spec import WorkerSpec
from .spillmove import SpillSource
from .spilling import Spilling

if TYPE_CHECKING:
    from .manager import WorkerManager

#: Seconds a worker's processes get to freeze.
FREEZE_TIMEOUT_S = 10.0
#: Seconds a running cell gets to stop after the interrupt a park sends.
INTERRUPT_WAIT_S = 10.0
#: Seconds a park waits for the idle status of a cell that seems to run before it refuses or interrupts it.
IDLE_GRACE_S = 0.5
#: Seconds an idle worker gets to drop its last traceback before a park (it goes on without).
FORGET_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ParkSettings:
    """How this node parks (``c.AgentParking.*``): its ``checkpointer``, the
    ``budget`` of host bytes its parked workers may hold (``parked_memory``),
    the ``spill_dir``, the ``headroom`` of host memory a park must leave
    available (``park_headroom``), ``gpu_memory``, the inventory's
    latest per-process GPU bytes (pid -> bytes), and ``spill_source``: how
    it fetches the spill of a lease moved here from another node
    (:mod:`.spillmove`; None: it does not, and such a resume is refused)."""

    checkpointer: Checkpointer
    budget: int
    spill_dir: Path
    headroom: int = 1 << 30
    gpu_memory: Callable[[], Mapping[int, int]] = dict
    spill_source: SpillSource | None = None


def mem_available(meminfo: str) -> int | None:
    """``MemAvailable`` of a ``/proc/meminfo`` text, in bytes (None: not there)."""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def no_room(gpu_bytes: int, rss: int, budget: int, available: int | None, headroom: int,
            quota_room: int | None = None) -> str | None:
    """Why a worker of ``rss`` host bytes holding ``gpu_bytes`` on its GPU
    cannot park in memory, in words; None when it can. Pure: ``budget`` the
    node's parked-memory budget, ``available`` the host's MemAvailable now
    (None: unknown), ``headroom`` what must stay available after the move,
    ``quota_room`` what its owner's ``max_parked_memory`` leaves (None: no cap)."""
    if quota_room is not None and gpu_bytes + rss > quota_room:
        return (f"it would hold {format_bytes(gpu_bytes + rss)} of host memory, more than the "
                f"{format_bytes(quota_room)} its owner's max_parked_memory leaves")
    if gpu_bytes + rss > budget:
        return (f"it would hold {format_bytes(gpu_bytes + rss)} of host memory, more than this node's parked-memory "
                f"budget of {format_bytes(budget)} (c.AgentParking.parked_memory)")
    if available is not None and gpu_bytes > available - headroom:
        return (f"the host has {format_bytes(available)} of memory available, and moving {format_bytes(gpu_bytes)} "
                f"of GPU memory there would leave less than {format_bytes(headroom)} (c.AgentParking.park_headroom)")
    return None


def rss(pids: tuple[int, ...]) -> int:
    """Resident host bytes of ``pids`` together that are their own: their
    RSS less what maps files and shared memory (program text, libraries, and
    simulated GPU memory, which is counted as GPU memory)."""
    total = 0
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_info()
        except psutil.Error:
            continue
        total += info.rss - getattr(info, "shared", 0)
    return total


class WorkerParking:
    """Parks and resumes the workers of ``manager`` as ``settings`` says."""

    def __init__(self, settings: ParkSettings, manager: WorkerManager, log: logging.Logger) -> None:
        self.settings = settings
        self.checkpointer = settings.checkpointer
        self.manager = manager
        self.log = log
        self.spilling = Spilling(settings.spill_dir, manager, self, log)
        self._budget_task: asyncio.Task | None = None

    # -- what a checkpointer sees -----------------------------------------------

    def target(self, worker: Worker) -> ParkTarget:
        """``worker`` as its checkpointer sees it, now."""
        pids = tuple(sorted({worker.pid, *(p.pid for p in worker.descendants())}))
        memory = self.settings.gpu_memory()
        return ParkTarget(worker.spec.lease_id, worker.pid, pids, tuple(g.uuid for g in worker.spec.gpus),
                          worker.spec.memory, {pid: memory[pid] for pid in pids if pid in memory},
                          worker.connection(), worker.user.uid if worker.user is not None else None)

    # -- freezing ---------------------------------------------------------------

    async def freeze(self, worker: Worker) -> None:
        """Freeze ``worker``'s processes (CgroupError: they run on)."""
        await asyncio.to_thread(worker.cgroup.freeze, FREEZE_TIMEOUT_S)
        log = self.log.warning if not worker.cgroup.confines else self.log.info
        log("froze the worker (pid %s) of lease %s: %s", worker.pid, worker.name, worker.cgroup.freeze_method)

    async def thaw(self, worker: Worker) -> None:
        await asyncio.to_thread(worker.cgroup.thaw)
        self.log.info("thawed the worker (pid %s) of lease %s", worker.pid, worker.name)

    async def settle(self, worker: Worker, running_cell: str) -> bool:
        """Deal with a running cell before a park as ``running_cell`` says;
        True when it was interrupted. 409 ``worker_busy`` for ``refuse``, or
        when the cell does not stop within :data:`INTERRUPT_WAIT_S`."""
        if worker.activity.execution_state != WorkerState.busy:
            return False
        if running_cell != "freeze" or not self.checkpointer.mid_cell:
            # A cell that just ended: its idle status may still be on its way to the agent's watcher.
            deadline = time.monotonic() + IDLE_GRACE_S
            while worker.activity.execution_state == WorkerState.busy and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if worker.activity.execution_state != WorkerState.busy:
                return False
        if running_cell == "refuse":
            raise GPUPoolError(Reason.worker_busy, f"a cell is running on the worker of lease {worker.name}: not "
                               "parked (running_cell 'refuse'); park it once it is idle, or with running_cell "
                               "'freeze' or 'interrupt'", 409)
        if running_cell == "freeze" and self.checkpointer.mid_cell:
            return False
        await self.interrupt(worker)
        return True

    async def interrupt(self, worker: Worker) -> None:
        """Interrupt the running cell and wait until the worker is idle; 409 ``worker_busy`` when it stays busy."""
        await asyncio.to_thread(interrupt_from_thread, worker.connection())
        deadline = time.monotonic() + INTERRUPT_WAIT_S
        while worker.activity.execution_state == WorkerState.busy:
            if time.monotonic() > deadline:
                raise GPUPoolError(Reason.worker_busy, f"the running cell of lease {worker.name} did not stop within "
                                   f"{INTERRUPT_WAIT_S:g}s of an interrupt: not parked", 409)
            await asyncio.sleep(0.02)
        self.log.info("interrupted the running cell of lease %s to park it", worker.name)

    # -- park ---------------------------------------------------------------------

    async def park(self, worker: Worker, request: ParkRequest) -> WorkerParked:
        """Park ``worker`` as ``request`` says (docs/parking.md); its answer.
        Call under the lease's lock. GPUPoolError 409 ``worker_busy``, 502
        ``park_failed``."""
        began = time.monotonic()
        if worker.parked is not None:
            if request.tier == "disk":
                return await self.spilling.spill(worker, began, f"asked to ({request.reason or 'no reason given'})")
            return self.parked_answer(worker.parked, 0.0)
        self.log.info("parking the worker of lease %s (%s; tier %s, running cell: %s)", worker.name,
                      request.reason or "no reason given", request.tier, request.running_cell)
        interrupted = await self.settle(worker, request.running_cell)
        cleared = await self.forget_traceback(worker)
        if interrupted:  # the traceback was the interrupt's own, which the answer says already
            cleared = None
        target = self.target(worker)
        why = None if request.tier == "memory" else f"asked to ({request.reason or 'no reason given'})"
        if why is None:
            why = worker.cgroup.frozen_keeps_gpu or no_room(
                sum(target.gpu_memory.values()), rss(target.pids), self.settings.budget, _host_available(),
                self.settings.headroom, request.max_host_bytes)
        if why is None:
            try:
                parked = await self._in_memory(worker, target, interrupted, cleared)
            except (CheckpointError, CgroupError) as exc:
                why = f"it could not be parked in memory: {exc}"
            else:
                self.check_budget()
                return self.parked_answer(parked, time.monotonic() - began)
        answer = await self.spilling.spill(worker, began, why, interrupted=interrupted)
        return answer if request.tier == "disk" else dataclasses.replace(answer, reason=why)

    async def forget_traceback(self, worker: Worker) -> str | None:
        """Ask an idle ``worker`` to drop the last traceback its shell keeps
        (its frames pin what they referred to: GPU memory freed instead of
        moved; the worker's ``forget_traceback`` op); the traceback's label
        (``"last traceback (ValueError; frames of Cell In[3])"``), None when
        it kept none, runs a cell, or did not answer (logged; the park goes on)."""
        if worker.activity.cell_running:
            return None  # frozen mid-cell: its comm would answer only after the cell
        try:
            answer = await asyncio.to_thread(ask, worker.connection(), ForgetTraceback(), FORGET_TIMEOUT_S)
        except CheckpointError as exc:
            self.log.warning("lease %s: its last traceback is kept through the park: %s", worker.name, exc)
            return None
        cleared = answer.get("cleared")
        if cleared:
            self.log.info("lease %s: the worker dropped its %s before the park", worker.name, cleared)
        return str(cleared) if cleared else None

    async def _in_memory(self, worker: Worker, target: ParkTarget, interrupted: bool,
                         cleared: str | None = None) -> ParkedInMemory:
        """Freeze ``worker`` and move its GPU state to host memory, in the
        checkpointer's order; its ParkedInMemory, written to its record, saying
        ``cleared`` (:meth:`forget_traceback`) among what was not kept.
        Raises CheckpointError or CgroupError with the worker as it was."""
        cp = self.checkpointer
        mid_cell = worker.activity.cell_running
        if cp.frozen:
            await self.freeze(worker)
            try:
                moved = await cp.park(target)
            except BaseException:
                await self.thaw(worker)
                raise
        else:
            moved = await cp.park(target)
            try:
                await self.freeze(worker)
            except BaseException:
                await cp.resume(target, moved, target.gpus, target.memory)
                raise
        if cleared:
            moved = dataclasses.replace(moved, lost=(cleared_words(cleared),) + moved.lost)
        frozen_as = WorkerState.busy if mid_cell else WorkerState.idle
        parked = ParkedInMemory(cp.name, moved, time.time(), frozen_as, rss(target.pids) + moved.host_bytes,
                                interrupted)
        worker.parked = parked
        worker.record().write(self.manager.workers_dir)
        self.log.info("parked the worker of lease %s in memory with %s: %s moved off the GPU, %s kept there, %s of "
                      "host memory%s", worker.name, cp.name, format_bytes(moved.gpu_bytes_moved),
                      format_bytes(moved.gpu_bytes_kept), format_bytes(parked.host_bytes),
                      " (frozen mid-cell)" if parked.execution_state == WorkerState.busy else "")
        return parked

    def parked_answer(self, parked: ParkedInMemory, seconds: float) -> WorkerParked:
        moved = parked.moved
        return WorkerParked("memory", parked.checkpointer, host_bytes=parked.host_bytes,
                            gpu_bytes_moved=moved.gpu_bytes_moved, gpu_bytes_kept=moved.gpu_bytes_kept,
                            interrupted=parked.interrupted,
                            lost=(("the running cell was interrupted",) if parked.interrupted else ()) + moved.lost,
                            seconds=round(seconds, 4))

    # -- the budget -------------------------------------------------------------

    def check_budget(self) -> None:
        """In the background: spill the longest-parked workers while those
        parked in memory hold more than the budget."""
        if self._budget_task is None or self._budget_task.done():
            self._budget_task = asyncio.create_task(self._keep_budget())

    async def _keep_budget(self) -> None:
        while True:
            parked = sorted((w.parked.since, lease) for lease in self.manager.lease_ids()
                            if (w := self.manager.find(lease)) is not None and w.parked is not None)
            held = sum(w.parked.host_bytes for lease in self.manager.lease_ids()
                       if (w := self.manager.find(lease)) is not None and w.parked is not None)
            if held <= self.settings.budget or not parked:
                return
            lease = parked[0][1]
            why = (f"the node's parked workers held {format_bytes(held)}, more than its budget of "
                   f"{format_bytes(self.settings.budget)} (c.AgentParking.parked_memory), and it was the longest "
                   "parked")
            try:
                await self.manager.spill(lease, why)
            except Exception as exc:  # noqa: BLE001 - logged; the next park tries again
                self.log.error("could not spill the worker of lease %s: %s", lease, exc)
                return

    # -- resume -----------------------------------------------------------------

    async def resume(self, worker: Worker, spec: WorkerSpec) -> WorkerResumed:
        """Put a parked ``worker`` back on ``spec``'s GPUs and limits and thaw
        it; its answer. A worker that is not parked answers as it is (the
        same GPUs), 400 for others. Call under the lease's lock."""
        began = time.monotonic()
        old = worker.spec
        if worker.parked is None:
            if [g.uuid for g in spec.gpus] != [g.uuid for g in old.gpus]:
                raise bad_request(f"the worker of lease {worker.name} is not parked: it runs on "
                                  f"{', '.join(g.uuid for g in old.gpus)}, not on the GPUs asked for")
            return WorkerResumed(worker.pid, worker.connection(), "memory", 0.0)
        self.check_gpus(old, spec)
        parked, target = worker.parked, self.target(worker)
        gpus = tuple(g.uuid for g in spec.gpus)
        await asyncio.to_thread(enforce_host_limits, worker.cgroup, spec.lease_id, spec.cpus, spec.host_memory,
                                self.log)
        try:
            if self.checkpointer.frozen:
                await self.checkpointer.resume(target, parked.moved, gpus, spec.memory)
                await self.thaw(worker)
            else:
                await self.thaw(worker)
                await self.checkpointer.resume(target, parked.moved, gpus, spec.memory)
        except (CheckpointError, CgroupError) as exc:
            if not self.checkpointer.frozen:
                await self.freeze(worker)
            raise GPUPoolError(Reason.park_failed, f"could not resume the worker of lease {worker.name}: {exc}; it "
                               "stays parked in memory", 502) from None
        worker.spec = dataclasses.replace(old, gpus=spec.gpus, fraction=spec.fraction, memory=spec.memory,
                                          cpus=spec.cpus, host_memory=spec.host_memory)
        worker.parked = None
        worker.record().write(self.manager.workers_dir)
        seconds = time.monotonic() - began
        self.log.info("resumed the worker of lease %s on %s in %.0f ms (parked %.0fs)", worker.name, ", ".join(gpus),
                      1000 * seconds, time.time() - parked.since)
        return WorkerResumed(worker.pid, worker.connection(), "memory", round(seconds, 4))

    def check_gpus(self, old: WorkerSpec, new: WorkerSpec) -> None:
        """400 unless ``new``'s GPUs can take ``old``'s state: as many, of the
        same models, and the same ones unless the checkpointer can remap."""
        if len(new.gpus) != len(old.gpus):
            raise bad_request(f"'gpus': the worker of lease {old.lease_id} was parked from {len(old.gpus)} GPU(s) "
                              f"and resumes onto as many, not {len(new.gpus)}")
        for was, now in zip(old.gpus, new.gpus):
            if was.name != now.name:
                raise bad_request(f"'gpus': {now.uuid} is a {now.name}; the worker of lease {old.lease_id} was parked "
                                  f"from a {was.name} and resumes onto the same model")
        if [g.uuid for g in new.gpus] != [g.uuid for g in old.gpus] and not self.checkpointer.remap:
            raise bad_request(f"'gpus': this node's checkpointer ({self.checkpointer.name}) restores onto the GPUs a "
                              f"worker was parked from only: {', '.join(g.uuid for g in old.gpus)}")

    # -- stop -------------------------------------------------------------------

    async def release(self, worker: Worker) -> None:
        """Before a parked ``worker`` is stopped: kill it where it is frozen
        (a frozen kernel answers no shutdown request), drop what its
        checkpointer holds."""
        parked = worker.parked
        if parked is None:
            return
        target = self.target(worker)
        try:
            await asyncio.to_thread(worker.cgroup.kill, 10.0)
            await asyncio.to_thread(worker.cgroup.thaw)  # SIGSTOPped (no cgroup): SIGKILL lands; a thaw is harmless
        except CgroupError as exc:
            self.log.error("could not kill the parked worker of lease %s: %s", worker.name, exc)
        await self.checkpointer.discard(target, parked.moved)


def cleared_words(label: str) -> str:
    """What the user is told of a last traceback dropped at a park (``label``: its holder's name)."""
    return f"the {label}, cleared so that the memory its frames held could be freed (%debug has nothing to show)"


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            return mem_available(meminfo.read())
    except OSError:
        return None
