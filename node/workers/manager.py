"""The workers of one node: which lease has which worker, and the calls the
agent makes (start, stop, park, resume, reports, recover)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, BinaryIO, Mapping

from gpupool.errors import GPUPoolError, Reason
from gpupool.wire.nodes import WorkerReport
from gpupool.wire.parking import ParkRequest, WorkerParked, WorkerResumed

from ..cgroups import Containment, containment
from ..enforcement import EnforcementMode
from ..host_limits import enforce as enforce_host_limits
from ..process_limits import limit_tasks
from .accounts import WorkerAccounts
from .binding import bind
from .handle import Worker
from .kernel import KernelManagers
from .launchers import WorkerLauncher, launcher_class
from .parking import ParkSettings, WorkerParking
from .parkstate import Spilled
from .recovery import Recovery
from .spec import WorkerBindError, WorkerLaunch, WorkerSpec, WorkerStartError
from .spilling import SpillFailed
from .spillmove import fetch_spill
from .stopping import Reaper, quietly
from . import warmmove
from .warmpool import WarmPool


#: Seconds an offer for a move waits for its node where no ``c.AgentParking.spill_fetch_timeout`` is known.
DEFAULT_MOVE_TIMEOUT_S = 240.0


class WorkerManager:
    """Starts, tracks and stops the workers of one node, as ``settings``
    says (:class:`~.spec.WorkerLaunch`).

    ``cgroups``: where workers' cgroups are made (:mod:`..cgroups`; default
    ``containment("auto", "", state_dir)``: the best this host offers).
    ``launcher``: the class that starts them, or its name
    (:func:`~.launchers.launcher_class`; the agent passes the class
    ``c.AgentWorkers.worker_launcher`` names; default ``"local"``).
    The warm pool (``settings.warm``) starts filling on
    :meth:`start_warm_pool`. ``parking``: how this node parks workers in
    place (:class:`~.parking.ParkSettings`; None: it does not, and
    :meth:`park` refuses).

    All methods run on the agent's event loop; calls for the same lease are
    serialized, calls for different leases run concurrently.
    """

    def __init__(self, settings: WorkerLaunch, *, cgroups: Containment | None = None,
                 launcher: type[WorkerLauncher] | str = "local", log: logging.Logger | None = None,
                 parking: ParkSettings | None = None) -> None:
        self.settings = settings
        self.log = log or logging.getLogger("gpupool.agent")
        self.workers_dir = settings.workers_dir
        self.workers_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        accounts = WorkerAccounts(settings, self.log)
        # Not listable by anyone but the agent; with worker users, enterable:
        # each reads its own connection file there while it starts.
        self.workers_dir.chmod(0o711 if accounts.others else 0o700)
        self.cgroups = cgroups if cgroups is not None else containment("auto", "", settings.state_dir, log=self.log)
        self.log.info("worker cgroups: %s under %s", self.cgroups.mode, self.cgroups.where)
        self._kernels = KernelManagers(settings, self.log)
        self._reaper = Reaper(settings, accounts, self.log)
        if isinstance(launcher, str):
            launcher = launcher_class(launcher)
        self._launcher = launcher(settings, accounts, self.cgroups, self._kernels, self._reaper, self.log)
        self._recovery = Recovery(settings, accounts, self._kernels, self.log, self._launcher)
        self._workers: dict[str, Worker] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._offers: set[asyncio.Future] = set()  # the expiries of offers for moves (kept from the collector)
        self._closing = False
        self.parking = WorkerParking(parking, self, self.log) if parking is not None else None
        warm = settings.warm
        self.pool: WarmPool[Worker] = WarmPool(warm.size, warm.max_age, launch=self._launcher.warm,
                                               discard=self._reaper.terminate, alive=lambda w: not w.process.exited(),
                                               log=self.log)

    @property
    def closing(self) -> bool:
        """Whether the agent is stopping (:meth:`spill_all`, :meth:`stop_all`): no new worker is started."""
        return self._closing

    @property
    def launcher(self) -> WorkerLauncher:
        """The launcher that starts this node's workers (read-only: for the agent's start log)."""
        return self._launcher

    def use_enforcement(self, mode: EnforcementMode) -> None:
        """Start every worker from now on in ``mode``'s slices (the agent's mode
        changed when the GPUs were read again, e.g. ``auto`` found MIG
        instances). The settings object is shared by the launcher, the kernel
        managers and the reaper: its ``enforcement`` is the one field set after
        start, so they all see the new mode at once."""
        object.__setattr__(self.settings, "enforcement", mode)

    # -- queries ----------------------------------------------------------------

    def get(self, lease_id: str) -> Worker:
        """The worker of ``lease_id``; KeyError when there is none."""
        return self._workers[lease_id]

    def find(self, lease_id: str) -> Worker | None:
        """The worker of ``lease_id``, or None (none, or spilled to disk)."""
        return self._workers.get(lease_id)

    def lease_ids(self) -> list[str]:
        return list(self._workers)

    def spilled_ids(self) -> list[str]:
        """The leases whose parked worker was spilled to disk (no process)."""
        return list(self.parking.spilling.spilled) if self.parking is not None else []

    def poll(self) -> list[Worker]:
        """Notice workers that exited by themselves; returns the newly dead.

        A dead worker stays listed (reported ``dead`` with its exit code) until
        :meth:`stop` is called for its lease. Its cgroup (without one: its
        process group) is killed on the spot (:meth:`~.stopping.Reaper.reap`).
        """
        newly_dead = []
        for worker in self._workers.values():
            if worker.dead or worker.stopping or not worker.process.exited():
                continue
            self._reaper.reap(worker)
            newly_dead.append(worker)
        return newly_dead

    def reports(self, process_memory: Mapping[int, int] | None = None) -> list[WorkerReport]:
        """A WorkerReport per worker, after :meth:`poll`. ``process_memory``
        (pid -> GPU bytes, from the inventory) gives each worker's
        ``memory_used``, summed over its process tree; None when unknown."""
        self.poll()
        result = []
        for worker in self._workers.values():
            memory = None
            if process_memory and not worker.dead:
                pids = [worker.pid, *(p.pid for p in worker.descendants())]
                if any(pid in process_memory for pid in pids):
                    memory = sum(process_memory.get(pid, 0) for pid in pids)
            result.append(worker.report(memory))
        if self.parking is not None:
            result += self.parking.spilling.reports()
        return result

    # -- start ------------------------------------------------------------------

    async def start(self, spec: WorkerSpec) -> Worker:
        """Start the worker of ``spec.lease_id`` and wait until it answers
        ``kernel_info``; return it.

        Idempotent: a live worker of the same lease is returned as it is (a
        dead one is replaced). Raises :class:`~.spec.WorkerStartError` with
        the reason when the kernel does not come up within
        ``start_timeout``; nothing is left running then. A 400 GPUPoolError
        for a lease whose worker is parked (it resumes instead).
        """
        if self._closing:
            raise WorkerStartError("the agent is shutting down")
        async with self._lock(spec.lease_id):
            existing = self._workers.get(spec.lease_id)
            if spec.lease_id in self.spilled_ids() or existing is not None and existing.parked is not None:
                raise GPUPoolError(Reason.bad_request, f"the worker of lease {spec.lease_id} is parked: POST "
                                   f"/workers/{spec.lease_id}/resume brings it back", 400)
            return await self.start_locked(spec)

    async def start_locked(self, spec: WorkerSpec) -> Worker:
        """:meth:`start`, for a caller that holds the lease's lock (a resume from disk)."""
        if self._closing:
            raise WorkerStartError("the agent is shutting down")
        existing = self._workers.get(spec.lease_id)
        if existing is not None:
            self.poll()
            if not existing.dead:
                if existing.spec != spec:
                    self.log.warning("lease %s already has a worker with other limits; keeping it",
                                     spec.lease_id)
                return existing
            await self._reaper.terminate(self._workers.pop(spec.lease_id))
        began = time.monotonic()
        # Warm workers run the agent's Python as the manager's user.
        worker = self.pool.take() if spec.python is None and spec.user is None else None
        if worker is not None and not await self._bind(worker, spec):
            worker = None
        how = "warm" if worker is not None else "cold"
        if worker is None:
            worker = await self._launcher.cold(spec)
            await asyncio.to_thread(self._limit, worker, spec)
        self._workers[spec.lease_id] = worker
        worker.record().write(self.workers_dir)
        self.log.info("worker for lease %s of %s started %s in %.0f ms: pid %s, GPUs %s, fraction %g, "
                      "memory %s bytes", spec.lease_id, spec.owner, how, 1000 * (time.monotonic() - began),
                      worker.pid, ",".join(g.uuid for g in spec.gpus), spec.fraction, spec.memory)
        return worker

    def _limit(self, worker: Worker, spec: WorkerSpec) -> None:
        """The lease's host limits and its task limit on the worker's cgroup, before it is handed out."""
        enforce_host_limits(worker.cgroup, spec.lease_id, spec.cpus, spec.host_memory, self.log)
        budget, owner = self.settings.pids, worker.cgroup.task_limit_owner
        if owner is not None:
            self.log.info("lease %s: its tasks are limited by %s", spec.lease_id, owner)
        elif budget is not None and worker.cgroup.confines:
            limit_tasks(worker.cgroup, spec.lease_id, budget.for_lease(len(spec.gpus), spec.fraction), self.log)

    def start_warm_pool(self) -> None:
        """Start filling the warm pool in the background (no-op for size 0).
        Call once, on the agent's event loop."""
        self.pool.start()

    async def _bind(self, worker: Worker, spec: WorkerSpec) -> bool:
        """Bind the warm ``worker`` to ``spec`` (:func:`~.binding.bind`) and
        write its limits (:meth:`_limit`) meanwhile: a thread's file writes,
        no reason to wait for them in turn. False when the binding failed:
        that worker is stopped, never offered again."""
        env = self.settings.enforcement.environment(spec.gpus, spec.fraction, spec.memory, spec.lease_id,
                                                   spec.owner, self.settings.node)
        limiting = asyncio.ensure_future(asyncio.to_thread(self._limit, worker, spec))
        try:
            await bind(worker, spec, env, self.settings.start_timeout)
        except WorkerBindError as exc:
            await asyncio.gather(limiting, return_exceptions=True)  # done with its cgroup before it goes
            self.log.warning("warm worker %s (pid %s) could not be bound to lease %s (%s); stopping it and "
                             "starting a cold one", worker.name, worker.pid, spec.lease_id, exc)
            await quietly(self._reaper.terminate(worker))
            return False
        await limiting
        return True

    # -- after an agent restart -------------------------------------------------

    async def recover(self) -> list[Worker]:
        """Take over what an earlier run of the agent left in ``workers_dir``;
        returns the workers re-adopted. Call once, before anything else.

        A lease's worker that still runs and answers on its control channel
        within :data:`~.recovery.ADOPT_TIMEOUT_S` is re-adopted as it is
        (variables, a running cell); the next report names it, and the
        service keeps its lease or says to stop it. Everything else that
        earlier run started is ended by the launcher's sweep, with what it
        started: warm workers, workers that do not answer or have no record,
        and what the cells of dead workers left behind. Their files are
        removed. How a record's worker is found and what a sweep ends are
        the launcher's (:meth:`~.launchers.base.WorkerLauncher.adopt`,
        :meth:`~.launchers.base.WorkerLauncher.sweep`; the local one's:
        :mod:`.launchers.local.adoption`).
        """
        adopted = await self._recovery.recover()
        await self._launcher.prepare()
        for worker in adopted:
            self._workers[worker.spec.lease_id] = worker
        if self.parking is not None:
            for spill in self.parking.spilling.recover():
                if spill.lease_id in self._workers:  # killed after the spill was saved, before its worker ended
                    self.log.warning("lease %s was spilled to disk: stopping its worker", spill.lease_id)
                    await self.stop_locked(spill.lease_id)
                    self.parking.spilling.spilled[spill.lease_id] = spill
            self.parking.check_budget()  # restarted with a smaller parked_memory: the longest-parked go to disk
        return [worker for worker in adopted if worker.spec.lease_id in self._workers]

    # -- stop -------------------------------------------------------------------

    async def stop(self, lease_id: str) -> int | None:
        """Stop the worker of ``lease_id`` and verify that its processes are
        gone; returns its exit code (negative: killed by that signal).

        Graceful first (interrupt, ``shutdown_request``), SIGTERM and SIGKILL
        after ``stop_timeout``; a worker parked in memory is killed where it
        is frozen and what its checkpointer holds is dropped; a spilled one's
        files are removed (exit code None). Raises KeyError for an unknown
        lease and :class:`~.spec.WorkerStopError` when a process survives
        SIGKILL.
        """
        async with self._lock(lease_id):
            code = await self.stop_locked(lease_id)
        self._locks.pop(lease_id, None)
        return code

    async def stop_locked(self, lease_id: str) -> int | None:
        """:meth:`stop`, for a caller that holds the lease's lock."""
        worker = self._workers.get(lease_id)
        if worker is None:
            if self.parking is not None and self.parking.spilling.remove(lease_id):
                return None
            self._locks.pop(lease_id, None)
            raise KeyError(lease_id)
        try:
            if self.parking is not None:
                await self.parking.release(worker)
            code = await self._reaper.terminate(worker)
        finally:
            self._workers.pop(lease_id, None)
        self.log.info("worker for lease %s stopped (exit code %s)", lease_id, code)
        return code

    # -- park and resume (docs/parking.md) -------------------------------------------

    def _parking(self) -> WorkerParking:
        if self.parking is None:
            raise GPUPoolError(Reason.not_configured, "this agent does not park workers in place", 409)
        return self.parking

    async def park(self, lease_id: str, request: ParkRequest) -> WorkerParked:
        """Park the worker of ``lease_id`` as ``request`` says
        (:meth:`.parking.WorkerParking.park`); idempotent (a parked one answers
        where it is). KeyError for an unknown lease; GPUPoolError 409
        ``worker_busy``, 409 for a dead worker, 502 ``park_failed``."""
        parking = self._parking()
        async with self._lock(lease_id):
            spill = parking.spilling.spilled.get(lease_id)
            if spill is not None:
                return WorkerParked("disk", parking.checkpointer.name, disk_bytes=spill.disk_bytes, lost=spill.lost)
            worker = self._live(lease_id)
            return await parking.park(worker, request)

    async def resume(self, lease_id: str, spec: WorkerSpec, spill_from: str | None = None,
                     move_from: str | None = None) -> WorkerResumed:
        """Resume the parked worker of ``lease_id`` on ``spec``'s GPUs and
        limits, or, spilled, load it into a new worker
        (:meth:`.parking.WorkerParking.resume`, :meth:`.spilling.Spilling.resume`).
        When this node has neither its worker nor its spill, it moves here:
        ``move_from``, the base URL of the agent whose worker of the lease is
        parked in memory, worker to worker (:func:`.warmmove.take`), or
        ``spill_from``, the one that holds its spill (:meth:`_resume_moved`).
        KeyError for an unknown lease; GPUPoolError 400, 409, 502."""
        parking = self._parking()
        async with self._lock(lease_id):
            spill = parking.spilling.spilled.get(lease_id)
            if spill is not None:
                return await parking.spilling.resume(spill, spec)
            if lease_id not in self._workers and (move_from or spill_from) is not None:
                if parking.settings.spill_source is None:
                    raise GPUPoolError(Reason.not_configured, f"this agent cannot move lease {lease_id} here from "
                                       f"{move_from or spill_from}: it takes no leases from other nodes", 409)
                if move_from is not None:
                    return await warmmove.take(self, spec, move_from, parking.settings.spill_source, self.log)
                return await self._resume_moved(parking, spec, spill_from)
            worker = self._live(lease_id)
            if worker.parked is not None and worker.parked.offered:  # a move that did not take it
                spill = await self._spill_offered(parking, worker, "it resumes here, not on the node it was offered to")
                return await parking.spilling.resume(spill, spec)
            return await parking.resume(worker, spec)

    async def _resume_moved(self, parking: WorkerParking, spec: WorkerSpec, url: str) -> WorkerResumed:
        """Fetch the spill of ``spec.lease_id`` from the agent at ``url``
        (:func:`.spillmove.fetch_spill`) and load it into a new worker here.
        Under the lease's lock. Whatever fails leaves nothing of the lease on
        this node (the spill stays where it was): 409 for another owner's
        spill, 502 ``park_failed`` for one that cannot be fetched, or the
        load's own 502."""
        lease_id, url = spec.lease_id, url.rstrip("/")
        source = parking.settings.spill_source
        assert source is not None  # checked by resume
        spill = await fetch_spill(source, url, lease_id, spec.owner, parking.spilling.spill_dir, self.log)
        parking.spilling.spilled[lease_id] = spill
        try:
            return await parking.spilling.resume(spill, spec, kept=f"the spill stays on the other node ({url}), its "
                                                 "copy here was removed")
        finally:
            if lease_id not in self._workers:
                parking.spilling.remove(lease_id)

    async def offer(self, lease_id: str, owner: str) -> dict[str, Any]:
        """Offer the namespace of ``lease_id``'s worker, parked in memory, to
        the node it moves to (:func:`.warmmove.offer`); an offer that node
        has not taken within the move's timeout is spilled to disk
        (:meth:`_expire_offer`). KeyError when no worker of the lease is
        here (a spilled one's state moves through :meth:`open_spill`);
        GPUPoolError 409, 502."""
        parking = self._parking()
        timeout = self._move_timeout(parking)
        async with self._lock(lease_id):
            offered = await warmmove.offer(parking, self._live(lease_id), owner, timeout)
        self._offers.add(asyncio.ensure_future(self._expire_offer(lease_id, timeout)))
        return offered

    async def _expire_offer(self, lease_id: str, after: float) -> None:
        """``after`` seconds on, spill the worker of ``lease_id`` if it is still offered: no node took it."""
        try:
            await asyncio.sleep(after)
            async with self._lock(lease_id):
                worker = self._workers.get(lease_id)
                if worker is not None and worker.parked is not None and worker.parked.offered:
                    await self._spill_offered(self._parking(), worker, f"no node took it within {after:g} s of its "
                                              "offer for a move (c.AgentParking.spill_fetch_timeout)")
        except Exception as exc:  # noqa: BLE001 - logged; it stays offered, spilled at its next resume
            self.log.error("could not spill the offered worker of lease %s: %s", lease_id, exc)
        finally:
            self._offers.discard(asyncio.current_task())

    async def _spill_offered(self, parking: WorkerParking, worker: Worker, why: str) -> Spilled:
        """Spill an offered ``worker`` (under its lease's lock): thawed, its state readable, it is not
        frozen again; a spill saves it as it is and ends it."""
        await parking.spilling.spill(worker, time.monotonic(), why)
        return parking.spilling.spilled[worker.name]

    @staticmethod
    def _move_timeout(parking: WorkerParking) -> float:
        source = parking.settings.spill_source
        return source.timeout if source is not None else DEFAULT_MOVE_TIMEOUT_S

    async def open_spill(self, lease_id: str) -> tuple[Spilled, BinaryIO]:
        """The spill of ``lease_id`` on this node and its namespace file,
        open for reading (the caller closes it), for another node that
        fetches it (:mod:`.spillmove`). Taken under the lease's lock: the
        open file stays whole for its reader even if a DELETE or a resume
        removes the spill meanwhile. KeyError when the lease has no spill
        here (a worker parked in memory has none until it is spilled)."""
        spilled = self.parking.spilling.spilled if self.parking is not None else {}
        if lease_id not in spilled:  # no lock made for a lease this node never had
            raise KeyError(lease_id)
        async with self._lock(lease_id):
            spill = spilled.get(lease_id)
            if spill is None:
                raise KeyError(lease_id)
            return spill, await asyncio.to_thread(open, spill.namespace, "rb", buffering=0)

    async def spill(self, lease_id: str, why: str) -> WorkerParked | None:
        """Spill the worker of ``lease_id`` if it is still parked in memory (``why``: logged); None if not."""
        parking = self._parking()
        async with self._lock(lease_id):
            worker = self._workers.get(lease_id)
            if worker is None or worker.parked is None:
                return None
            return await parking.spilling.spill(worker, time.monotonic(), why)

    async def end_spilled(self, worker: Worker) -> None:
        """End a worker whose namespace was just spilled (it runs, thawed, idle). Under the lease's lock."""
        if worker.parked is not None and self.parking is not None:
            await self.parking.checkpointer.discard(self.parking.target(worker), worker.parked.moved)
            worker.parked = None
        try:
            await self._reaper.terminate(worker)
        finally:
            self._workers.pop(worker.name, None)

    def _live(self, lease_id: str) -> Worker:
        """The live worker of ``lease_id``: KeyError for none, 409 for a dead one."""
        worker = self._workers[lease_id]
        self.poll()
        if worker.dead:
            raise GPUPoolError(Reason.park_failed, f"the worker of lease {lease_id} has died "
                               f"({worker.death or worker.process.exit_note or f'exit code {worker.exit_code}'})", 409)
        return worker

    async def spill_all(self, why: str, timeout: float) -> tuple[list[str], dict[str, str]]:
        """At the agent's stop: save every lease's live worker (active, or parked in memory) to
        the spill folder and end it, all at once, within ``timeout`` seconds, so that its lease
        stays parked on this node's disk for the next agent (docs/parking.md, "Agent restarts");
        ``why``: in words, logged. A running cell is interrupted (the spill says so). Refuses new
        starts. Returns the leases spilled now, and why each other's spill failed or ran past
        ``timeout`` (words); those, and workers dead or still starting, are left for
        :meth:`stop_all`, which ends them."""
        self._closing = True
        if self.parking is None:
            return [], {}
        self.poll()
        leases = sorted(lease for lease, worker in self._workers.items() if not worker.dead)
        results = await asyncio.gather(*(asyncio.wait_for(self._spill_at_stop(lease, why), timeout)
                                         for lease in leases), return_exceptions=True)
        failed = {lease: _spill_failure(result, timeout) for lease, result in zip(leases, results)
                  if isinstance(result, BaseException)}
        for lease, words in failed.items():
            self.log.error("the worker of lease %s was not saved to disk before the stop (%s): it is stopped "
                           "instead, and its lease ends", lease, words)
        return [lease for lease, result in zip(leases, results) if result is True], failed

    async def _spill_at_stop(self, lease_id: str, why: str) -> bool:
        assert self.parking is not None
        async with self._lock(lease_id):
            worker = self._workers.get(lease_id)
            if worker is None or worker.dead:
                return False
            await self.parking.spilling.spill(worker, time.monotonic(), why)
            return True

    async def stop_all(self, keep_spills: bool = False) -> dict[str, int | None]:
        """Stop every worker concurrently, including those still starting,
        and refuse new starts; returns lease id -> exit code. A worker that
        could not be stopped is logged and maps to None. The spills on disk
        are removed too (their leases end, exit code None) unless
        ``keep_spills`` (:meth:`spill_all`: the next agent resumes them)."""
        self._closing = True
        for expiry in self._offers:
            expiry.cancel()
        spills = set(self.spilled_ids())
        leases = sorted((set(self._workers) | set(self._locks) | spills) - (spills if keep_spills else set()))
        *results, pooled = await asyncio.gather(*(self.stop(lease) for lease in leases), self.pool.close(),
                                                return_exceptions=True)
        if isinstance(pooled, BaseException):
            self.log.error("could not stop the warm workers: %s", pooled)
        codes: dict[str, int | None] = {}
        for lease, result in zip(leases, results):
            if isinstance(result, KeyError):  # its start failed meanwhile
                continue
            if isinstance(result, BaseException):
                self.log.error("could not stop the worker of lease %s: %s", lease, result)
                codes[lease] = None
            else:
                codes[lease] = result
        try:
            await self._launcher.close()
        except Exception as exc:  # noqa: BLE001 - logged; the agent stops anyway
            self.log.error("could not close the worker launcher: %s", exc)
        self.cgroups.close()  # the agent's subtree, now empty (close() tries again)
        return codes

    def _lock(self, lease_id: str) -> asyncio.Lock:
        return self._locks.setdefault(lease_id, asyncio.Lock())

    def close(self) -> None:
        """Release the ZMQ context and the agent's empty cgroup subtree;
        call after :meth:`stop_all`."""
        self._kernels.close()
        self.cgroups.close()


def _spill_failure(error: BaseException, timeout: float) -> str:
    """Why a spill at the agent's stop did not happen, in words (the worker is stopped then)."""
    if isinstance(error, asyncio.TimeoutError):
        return f"not done within c.AgentParking.park_on_stop_timeout, {timeout:g} s"
    if isinstance(error, SpillFailed):
        return error.cause
    return getattr(error, "message", None) or repr(error)
