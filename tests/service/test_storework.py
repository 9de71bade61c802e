"""The store threads take turns between callers (hub_plugin/storework.py)."""

from __future__ import annotations

import asyncio
import threading

from gpupool.hub_plugin.storework import CALLER, FairQueue


def test_waiting_calls_take_turns_between_callers_and_one_caller_holds_one_reader():
    """One thread, busy: five calls of "flood" wait, then one of "ann": ann's runs
    second, not sixth. With two threads and per_caller=1, flood never holds both."""
    ran: list[str] = []
    gate = threading.Event()

    def blocker() -> None:
        gate.wait(10)

    def record(name: str) -> str:
        ran.append(name)
        return name

    async def submit(caller: str, fn, *args):
        CALLER.set(caller)  # each task has its own copy of the context
        return await queue.run(fn, *args)

    async def scenario() -> list[str]:
        tasks = [asyncio.create_task(submit("flood", blocker))]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(submit("flood", record, f"flood-{i}")) for i in range(5)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(submit("ann", record, "ann")))
        await asyncio.sleep(0.05)
        assert queue.waiting() == 6 and ran == []
        gate.set()
        await asyncio.gather(*tasks)
        return ran

    queue = FairQueue(1, "test-store")
    try:
        assert asyncio.run(scenario()) == ["flood-0", "ann", "flood-1", "flood-2", "flood-3", "flood-4"]
    finally:
        queue.close()

    ran.clear()
    gate.clear()
    queue = FairQueue(2, "test-store", per_caller=1)
    try:
        async def two_threads() -> None:
            flood = [asyncio.create_task(submit("flood", blocker)) for _ in range(3)]
            await asyncio.sleep(0.05)
            # flood holds one thread, the other is free: ann's call runs at once.
            assert await asyncio.wait_for(submit("ann", record, "ann"), 5) == "ann"
            gate.set()
            await asyncio.gather(*flood)

        asyncio.run(two_threads())
    finally:
        queue.close()


def test_an_exception_comes_back_to_its_caller():
    queue = FairQueue(1, "test-store")

    def fail() -> None:
        raise ValueError("no")

    async def scenario() -> str:
        try:
            await queue.run(fail)
        except ValueError as exc:
            return str(exc)
        return "nothing"

    try:
        assert asyncio.run(scenario()) == "no"
    finally:
        queue.close()
