"""NVML in a watched helper process: a hanging driver call is contained.

:class:`~gpupool.node.inventory.nvml.watch.WatchedInventory` runs a real helper
process (:mod:`gpupool.node.inventory.nvml.helper`) whose ``pynvml`` is
:class:`fakenvml.ControlledNVML`; the control file makes its calls fail or
hang. A helper whose answer passes the timeout is killed and, on the backoff
schedule, replaced by one that works once the fake stops hanging.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time

import psutil
import pytest

from fakenvml import AGENT_GPUS, hanging_pid, helper_command, set_error, set_hang
from gpupool.node.inventory.nvml.watch import WatchedInventory

#: The helper names the call that hung when it could tell in time (half the timeout), as it does on an idle machine.
STOPPED_ANSWERING = re.compile(r"the GPU driver stopped answering: (nvmlDeviceGetCount did not return|NVML did not "
                               r"answer) within 1s")


class Clock:
    """Monotonic seconds that a test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def gone(pid: int) -> bool:
    """True when ``pid`` ended (a killed child not yet reaped counts as ended)."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def ended(pid: int) -> bool:
    """Wait (a bound only) until ``pid`` has ended; True when it did."""
    for _ in range(500):
        if gone(pid):
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def watched(tmp_path):
    """``(inventory, control, clock)``: a WatchedInventory on a working fake
    over :data:`AGENT_GPUS`; 1 s per round of readings, 2 s to open NVML,
    helpers replaced after 5 s, then 10 s... of the test's clock."""
    control = tmp_path / "nvml.json"
    clock = Clock()
    inv = WatchedInventory(command=helper_command(control), timeout=1.0, open_timeout=2.0, clock=clock)
    yield inv, control, clock
    set_hang(control, False)
    inv.close()


def test_readings_come_from_the_helper_and_are_served_without_it(watched):
    inv, _control, _clock = watched
    assert inv.error is None and [g.uuid for g in inv.discover()] == list(AGENT_GPUS)
    assert inv.helper_pid not in (None, os.getpid())
    assert inv.refresh() is False  # working: nothing came back
    assert [r["uuid"] for r in inv.metrics()] == list(AGENT_GPUS)
    assert all(r["memory_used"] == 0 and r["healthy"] for r in inv.metrics())
    assert inv.versions() == {"driver": "550.54.15", "cuda": "12.4"}
    assert set(inv.health()) == set(AGENT_GPUS) and inv.process_known() == set(AGENT_GPUS)
    # the caller may change what it gets (the agent adds memory_unattributed) without changing the inventory
    inv.metrics()[0]["memory_unattributed"] = 7
    assert "memory_unattributed" not in inv.metrics()[0]


def test_a_hung_helper_is_killed_and_replaced_and_works_again_once_the_driver_answers(watched, caplog):
    inv, control, clock = watched
    first = inv.helper_pid
    set_hang(control, True)
    with caplog.at_level(logging.INFO, "gpupool.agent"):
        assert inv.refresh() is False
        assert STOPPED_ANSWERING.fullmatch(inv.error) and inv.helper_pid is None
        assert ended(first)
        # last known GPUs, no readings (unknown, never stale)
        assert [g.uuid for g in inv.discover()] == list(AGENT_GPUS)
        assert (inv.metrics(), inv.process_usage(), inv.process_memory(), inv.health()) == ([], [], {}, {})
        # no new helper before the backoff has passed
        clock.now = 4.9
        assert inv.refresh() is False and inv.helper_pid is None
        # a new one still hangs (in nvmlInit): killed too; the next wait is twice as long
        clock.now = 5.0
        assert inv.refresh() is False and inv.failures == 2 and inv.next_attempt == 5.0 + 10.0
        assert re.fullmatch(r"the GPU driver stopped answering: (nvmlInit did not return|NVML did not answer) "
                            r"within 2s", inv.error)
        set_hang(control, False)
        clock.now = 15.0
        assert inv.refresh() is True  # came back: the agent registers the GPUs again
    assert inv.error is None and inv.failures == 0 and inv.helper_pid not in (None, first)
    assert [r["uuid"] for r in inv.metrics()] == list(AGENT_GPUS)
    assert inv.refresh() is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # stopped answering, answers again: not one per attempt
    assert STOPPED_ANSWERING.match(warnings[0]) and "dmesg" in warnings[0]
    assert warnings[1].startswith("the GPU driver answers again")


def test_update_waits_off_the_event_loop_while_a_call_hangs(tmp_path):
    control = tmp_path / "nvml.json"
    inv = WatchedInventory(command=helper_command(control), timeout=2.0)
    helper = inv.helper_pid

    async def scenario() -> bool:
        set_hang(control, ["nvmlDeviceGetComputeRunningProcesses"])
        update = asyncio.ensure_future(inv.update())
        # this loop goes on running while the helper hangs in the driver call
        while hanging_pid(control) != helper and not update.done():
            await asyncio.sleep(0.01)
        assert not update.done(), "the loop did not run while the helper hung"
        return await update

    try:
        assert asyncio.run(scenario()) is False
        # the helper said which call had not returned (after 1 s), and the words name it
        assert inv.error == ("the GPU driver stopped answering: nvmlDeviceGetComputeRunningProcesses did not return "
                             "within 2s") and ended(helper)
    finally:
        set_hang(control, False)
        inv.close()


def test_a_helper_that_dies_is_replaced(watched):
    inv, _control, clock = watched
    os.kill(inv.helper_pid, signal.SIGKILL)
    assert inv.refresh() is False
    assert inv.error == f"the NVML helper process stopped (exit code {-signal.SIGKILL})"
    clock.now = 5.0
    assert inv.refresh() is True and inv.error is None


def test_nvml_failing_in_the_helper_is_retried_there(tmp_path):
    control = tmp_path / "nvml.json"
    inv = WatchedInventory(command=helper_command(control), timeout=1.0, first=0.1, longest=0.2)
    try:
        set_error(control, "DRIVER_NOT_LOADED")
        helper = inv.helper_pid
        assert inv.refresh() is False
        assert inv.error == "NVML stopped working (Driver Not Loaded)" and inv.helper_pid == helper  # no hang
        assert [g.uuid for g in inv.discover()] == list(AGENT_GPUS) and inv.metrics() == []
        set_error(control, None)
        # the helper opens NVML again on its own schedule (0.1 s, then 0.2 s): ask until it has
        for _ in range(100):
            if inv.refresh():
                break
            time.sleep(0.05)
        assert inv.error is None and inv.helper_pid == helper and len(inv.metrics()) == 2
    finally:
        inv.close()


def test_close_ends_even_a_hung_helper(tmp_path):
    control = tmp_path / "nvml.json"
    inv = WatchedInventory(command=helper_command(control), timeout=1.0)
    helper = inv.helper_pid
    set_hang(control, True)  # nvmlShutdown hangs too
    inv.close()
    assert ended(helper)
    inv.close()  # idempotent
    assert inv.refresh() is False
