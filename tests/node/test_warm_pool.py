"""The warm pool: workers started ahead of leases, bound to one lease each.

The first group drives :class:`WarmPool` with plain objects and a clock that
tests move; the second real ipykernel workers through WorkerManager; the last
a real service and agent.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import types
from datetime import datetime

import psutil
import pytest

from gpupool.node import worker_extension
from gpupool.node.enforcement import MPS
from gpupool.node.inventory.simulated import SimulatedInventory
from gpupool.node.workers import WarmSettings, WorkerManager, WorkerLaunch, WorkerSpec
from gpupool.node.workers.binding import bind_code, preload_code
from gpupool.node.workers.warmpool import WarmPool
from workercell import run_worker_cell
from procs import processes_mentioning, wait_for

GiB = 1024**3
GPUS = SimulatedInventory("2xA100-80GB", "node-1").discover()
SECRETS = {"GPUPOOL_AGENT_TOKEN": "agent-secret", "MY_API_KEY": "k"}


# -- the pool's rules, with plain objects ---------------------------------------------------------------------

class Item:
    """A stand-in worker: a number, alive until killed."""

    def __init__(self, number: int) -> None:
        self.number, self.alive, self.discarded = number, True, False


class Launcher:
    """Starts numbered items; ``fail`` makes starts raise."""

    def __init__(self) -> None:
        self.started: list[Item] = []
        self.fail = False

    async def launch(self) -> Item:
        if self.fail:
            raise RuntimeError("no kernel today")
        item = Item(len(self.started) + 1)
        self.started.append(item)
        return item

    async def discard(self, item: Item) -> None:
        item.discarded, item.alive = True, False


def small_pool(launcher: Launcher, now: list[float], size: int = 2, max_age: float = 100.0,
               refill_delay: float = 0.0) -> WarmPool:
    return WarmPool(size, max_age, launch=launcher.launch, discard=launcher.discard, alive=lambda i: i.alive,
                    clock=lambda: now[0], refill_delay=refill_delay)


async def settle(pool: WarmPool, count: int) -> None:
    """Let the pool's background work run until ``count`` items are ready."""
    for _ in range(1000):
        if len(pool.ready) == count:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{len(pool.ready)} ready, expected {count}")


def test_pool_hands_each_item_out_once_and_refills():
    async def scenario():
        launcher, now = Launcher(), [0.0]
        pool = small_pool(launcher, now)
        pool.start()
        await settle(pool, 2)
        first, second = pool.take(), pool.take()
        assert (first.number, second.number) == (1, 2)
        await settle(pool, 2)
        assert [i.number for i in pool.ready] == [3, 4]  # never 1 or 2 again
        await pool.close()
        assert all(i.discarded for i in launcher.started[2:])
        assert not first.discarded and not second.discarded  # taken: the taker stops them

    asyncio.run(scenario())


def test_pool_recycles_dead_and_old_items():
    async def scenario():
        launcher, now = Launcher(), [0.0]
        pool = small_pool(launcher, now, size=1, max_age=10.0)
        pool.start()
        await settle(pool, 1)
        [old] = pool.ready
        now[0] = 10.0  # waited max_age: not handed out
        assert pool.take() is None
        await settle(pool, 1)
        assert old.discarded
        await settle(pool, 1)
        [young] = pool.ready
        young.alive = False  # its process died
        assert pool.take() is None
        await settle(pool, 1)
        assert pool.ready[0].number == 3
        await pool.close()

    asyncio.run(scenario())


def test_pool_backs_off_when_starts_fail():
    async def scenario():
        launcher, now = Launcher(), [0.0]
        launcher.fail = True
        pool = small_pool(launcher, now, size=1)
        pool.start()
        for _ in range(20):
            await asyncio.sleep(0.001)
        assert pool.take() is None and pool._failures == 1  # one try, then the back-off
        launcher.fail = False
        now[0] = 1.0  # the first back-off is 1 s
        pool._wake.set()
        await settle(pool, 1)
        await pool.close()

    asyncio.run(scenario())


def test_replacement_starts_after_the_refill_delay():
    async def scenario():
        launcher, now = Launcher(), [0.0]
        pool = small_pool(launcher, now, size=1, refill_delay=5.0)
        pool.start()
        await settle(pool, 1)
        assert pool.take().number == 1
        for _ in range(20):
            await asyncio.sleep(0.001)
        assert len(launcher.started) == 1  # the attach that just happened keeps the CPU
        now[0] = 5.0
        pool._wake.set()
        await settle(pool, 1)
        assert pool.ready[0].number == 2
        await pool.close()

    asyncio.run(scenario())


def test_pool_settings_are_checked():
    with pytest.raises(ValueError, match="0 or more"):
        WarmPool(-1, 10, launch=None, discard=None, alive=None)
    with pytest.raises(ValueError, match="positive"):
        WarmPool(1, 0, launch=None, discard=None, alive=None)


# -- binding, in this process -----------------------------------------------------------------------------------

def test_bind_and_preload_code_are_literal_calls():
    assert bind_code({"CUDA_VISIBLE_DEVICES": "GPU-a", "GPUPOOL_OWNER": "o'brien"}) == (
        "__import__('gpupool.node.worker_extension', fromlist=['bind'])"
        ".bind({'CUDA_VISIBLE_DEVICES': 'GPU-a', 'GPUPOOL_OWNER': \"o'brien\"})")
    assert preload_code(["torch", "numpy"]) == "__import__('torch')\n__import__('numpy')\n"


def test_bind_refuses_once_cuda_is_initialised(monkeypatch):
    initialised = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", initialised)
    monkeypatch.delenv("GPUPOOL_LEASE_ID", raising=False)
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="CUDA is already initialised"):
        worker_extension.bind({"CUDA_VISIBLE_DEVICES": "GPU-a", "GPUPOOL_LEASE_ID": "L-1"})
    assert dict(os.environ) == before


def test_bind_refuses_a_second_lease(monkeypatch):
    monkeypatch.setenv("GPUPOOL_LEASE_ID", "L-first")
    with pytest.raises(RuntimeError, match="already bound to lease L-first"):
        worker_extension.bind({"GPUPOOL_LEASE_ID": "L-second"})
    assert os.environ["GPUPOOL_LEASE_ID"] == "L-first"


# -- real workers ---------------------------------------------------------------------------------------------

def manager(tmp_path, **warm) -> WorkerManager:
    return WorkerManager(WorkerLaunch(tmp_path / "state", node="node-1", environ={**os.environ, **SECRETS},
                                        stop_timeout=5, start_timeout=30, warm=WarmSettings(**warm),
                                        enforcement=MPS()))


def spec(lease_id: str, owner: str = "ann") -> WorkerSpec:
    return WorkerSpec(lease_id, owner, (GPUS[1],), 0.5, 40 * GiB)


async def ready_pool(workers: WorkerManager, count: int = 1) -> list:
    """Wait (polling, 60 s at most) until ``count`` warm workers are ready."""
    for _ in range(1200):
        if len(workers.pool.ready) >= count:
            return workers.pool.ready
        await asyncio.sleep(0.05)
    raise AssertionError(f"the warm pool did not fill: {len(workers.pool.ready)} of {count}")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_warm_worker_is_bound_to_its_slice_and_tracked_like_a_cold_one(tmp_path):
    async def scenario():
        workers = manager(tmp_path, size=1, preload=("xml.dom.minidom",))
        workers.start_warm_pool()
        try:
            [warm] = await ready_pool(workers)
            asked = datetime.now().timestamp()
            worker = await workers.start(spec("L-000000000001"))
            assert worker.pid == warm.pid and worker.name == "L-000000000001"
            [report] = workers.reports()
            assert (report.lease_id, report.pid, report.execution_state) == ("L-000000000001", warm.pid, "idle")
            ready_at = datetime.fromisoformat(report.idle_since.replace("Z", "+00:00")).timestamp()
            assert ready_at >= asked  # idle since the lease got it, not since the warm start

            code = ("import json, os, sys\n"
                    "print(json.dumps({'env': dict(os.environ), 'preloaded': 'xml.dom.minidom' in sys.modules,\n"
                    "                  'names': [n for n in globals() if n in ('xml', 'torch')],\n"
                    "                  'inputs': len([cell for cell in In if cell])}))")
            seen = json.loads(await run_worker_cell(worker.connection(), code))
            env = seen["env"]
            assert env["CUDA_VISIBLE_DEVICES"] == GPUS[1].uuid
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
            assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40960M"
            assert env["GPUPOOL_LEASE_ID"] == "L-000000000001" and env["GPUPOOL_OWNER"] == "ann"
            assert env["GPUPOOL_MEMORY_LIMIT"] == str(40 * GiB)
            assert not set(SECRETS) & set(env), "agent secrets leaked into the worker"
            assert seen["preloaded"] and seen["names"] == []
            assert seen["inputs"] == 1  # this cell: the agent's binding and preload left no trace in the history

            # busy while a cell runs, idle_since = when it ended
            cell = asyncio.create_task(run_worker_cell(worker.connection(), "import time; time.sleep(1)"))
            states = set()
            while not cell.done():
                states.add(workers.reports()[0].execution_state)
                await asyncio.sleep(0.05)
            await cell
            assert "busy" in states

            # the lease's owner cannot rebind it to another GPU through the agent's function
            refused = await run_worker_cell(worker.connection(),
                                            "from gpupool.node.worker_extension import bind\n"
                                            "try:\n    bind({'CUDA_VISIBLE_DEVICES': 'GPU-other'})\n"
                                            "except RuntimeError as e:\n    print(e)")
            assert "already bound to lease L-000000000001" in refused

            [replacement] = await ready_pool(workers)
            assert replacement.pid != warm.pid
            assert replacement.connection()["key"] != worker.connection()["key"]  # its own HMAC key
            assert await workers.stop("L-000000000001") == 0
            assert not alive(warm.pid)
        finally:
            await workers.stop_all()
            workers.close()
        assert not processes_mentioning(str(tmp_path / "state"))
        assert not list((tmp_path / "state" / "workers").glob("*.json"))

    asyncio.run(scenario())


def test_no_worker_ever_serves_a_second_lease(tmp_path):
    async def scenario():
        workers = manager(tmp_path, size=1)
        workers.start_warm_pool()
        handed: list[int] = []
        try:
            for number, owner in enumerate(["ann", "bob", "ann", "cy"]):
                await ready_pool(workers)
                assert not set(w.pid for w in workers.pool.ready) & set(handed), "a used worker is back in the pool"
                lease = f"L-00000000000{number}"
                worker = await workers.start(spec(lease, owner))
                assert worker.pid not in handed
                handed.append(worker.pid)
                leftovers = await run_worker_cell(worker.connection(),
                                                  "print(sorted(n for n in globals() if n.startswith('secret')))\n"
                                                  f"secret_{number} = 'of {owner}'")
                assert leftovers.strip() == "[]"  # nothing of the previous lease's
                assert await workers.stop(lease) == 0
                assert not alive(worker.pid), "a released worker was kept"
            assert len(set(handed)) == 4
        finally:
            await workers.stop_all()
            workers.close()
        assert not processes_mentioning(str(tmp_path / "state"))

    asyncio.run(scenario())


def test_warm_workers_that_wait_too_long_are_replaced(tmp_path):
    async def scenario():
        workers = manager(tmp_path, size=1, max_age=0.5)
        workers.start_warm_pool()
        try:
            [first] = await ready_pool(workers)
            for _ in range(1200):
                if workers.pool.ready and workers.pool.ready[0].pid != first.pid and not alive(first.pid):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the old warm worker was not replaced")
        finally:
            await workers.stop_all()
            workers.close()
        assert not processes_mentioning(str(tmp_path / "state"))

    asyncio.run(scenario())


def test_failed_preload_leaves_leases_to_cold_starts(tmp_path):
    async def scenario():
        workers = manager(tmp_path, size=1, preload=("gpupool_no_such_module",))
        workers.start_warm_pool()
        try:
            for _ in range(1200):
                if workers.pool._failures:
                    break
                await asyncio.sleep(0.05)
            assert workers.pool.ready == []
            worker = await workers.start(spec("L-cold"))
            env = json.loads(await run_worker_cell(worker.connection(),
                                                   "import os, json; print(json.dumps(dict(os.environ)))"))
            assert env["CUDA_VISIBLE_DEVICES"] == GPUS[1].uuid
            assert worker.pid in processes_mentioning(str(tmp_path / "state"))
        finally:
            await workers.stop_all()
            workers.close()
        assert not processes_mentioning(str(tmp_path / "state"))

    asyncio.run(scenario())


# -- through the service and a real agent ---------------------------------------------------------------------

def test_lease_gets_a_prestarted_worker_and_agent_stop_leaves_nothing(tmp_path, service):
    from gpupool.wire.leases import LeaseRequest
    from procs import start_agent

    agent = start_agent(tmp_path, service, name="node-w", extra_args=["--warm-workers=2"])
    try:
        def warm_pids():
            lines = [line for line in agent.log.read_text().splitlines()
                     if "warm worker warm-" in line and "ready" in line]
            return [int(line.rsplit("pid ", 1)[1]) for line in lines] if len(lines) >= 2 else None

        prestarted = wait_for(warm_pids, 60, "two warm workers")
        client = service.client()
        lease = client.get_lease(client.create_lease(LeaseRequest(fraction=0.5)).id, wait=30, state="starting")
        assert lease.state.value == "active" and lease.worker["pid"] in prestarted
        env = json.loads(asyncio.run(run_worker_cell(lease.connection,
                                                     "import os, json; print(json.dumps(dict(os.environ)))")))
        assert env["GPUPOOL_LEASE_ID"] == lease.id and env["CUDA_VISIBLE_DEVICES"] == lease.gpus[0]["uuid"]
        released = client.release(lease.id)
        assert released.state.value == "released"
        wait_for(lambda: not alive(lease.worker["pid"]), 10, "the released worker to stop")
    finally:
        assert agent.stop() == 0  # raises if any process under its state dir (warm ones too) survived
