"""Which names hold GPU memory (for park in place): the worker's
``gpu_memory`` op, asked on its real transfer comm, lists the names and the
last traceback holding simulated GPU memory, each allocation counted once;
a park drops the last traceback (its frames' memory freed instead of moved)
and says so, only when there was one. A real agent on simulated GPUs
(:mod:`parkagent`), its workers real ipykernel processes.
"""

from __future__ import annotations

import secrets
import shutil
import sys
import time
from pathlib import Path

import pytest

from frontend import run
from gpupool.node import simgpu_store
from gpupool.node.checkpoint.framework import ask
from gpupool.node.inventory.simulated import simulated_uuid
from gpupool.node.worker_extension import gpumemory, lasttraceback
from gpupool.wire.transfer import GpuMemory
from parkagent import MiB, ParkAgent

pytestmark = pytest.mark.timeout(300)

HOLDERS = """
from gpupool.node import simgpu
x = simgpu.zeros(64 << 20, 'uint8')
view = x[::2]
d = {'small': simgpu.zeros(16 << 20, 'uint8'), 'again': [x]}
numbers = list(range(50000))
def f():
    pinned = simgpu.zeros(32 << 20, 'uint8')
    1 / 0
"""
TRACEBACK = "last traceback (ZeroDivisionError; frames of Cell In[2], Cell In[1])"


def cell(kc, code: str) -> str:
    done = run(kc, code, timeout=120)
    assert done.ok, done.text()
    return done.stdout


def holders(connection) -> dict:
    return ask(connection, GpuMemory(top=3), timeout=60)


@pytest.mark.parametrize("checkpointer", ["simulated", "framework"])
def test_names_holding_gpu_memory_are_listed_once_each_and_a_park_drops_the_last_traceback(tmp_path, checkpointer):
    agent = ParkAgent(tmp_path, args=(f"--checkpointer={checkpointer}",))
    try:
        started = agent.start_worker("L-holders")
        connection = started["connection"]
        kc = agent.client(connection)
        cell(kc, HOLDERS)
        assert "ZeroDivisionError" in run(kc, "f()").text()
        assert cell(kc, "print(simgpu.memory_allocated(0) >> 20)").strip() == "112", "x, d's and the traceback's"

        listed = holders(connection)
        rows = [(h["name"], h["bytes"], h["devices"], h["shares"]) for h in listed["holders"]]
        assert rows == [("x", 64 * MiB, ["simgpu:0"], []),
                        (TRACEBACK, 32 * MiB, ["simgpu:0"], []),
                        ("d", 16 * MiB, ["simgpu:0"], ["x"])], rows
        assert listed["more"] == {"count": 1, "bytes": 0}, "view: x's allocation, counted once"
        assert listed["complete"] is False, "numbers: only its first ITEMS were looked at"
        everything = ask(connection, GpuMemory())["holders"]
        assert ("view", 0, ["x"]) in [(h["name"], h["bytes"], h["shares"]) for h in everything]

        status, parked = agent.park("L-holders", reason="idle for 30m")
        assert status == 200, parked
        assert parked["lost"] == [f"the {TRACEBACK}, cleared so that the memory its frames held could be freed "
                                  "(%debug has nothing to show)"], parked
        if checkpointer == "simulated":
            assert parked["gpu_bytes_moved"] == 80 * MiB, "the traceback's 32 MiB was freed, not moved"
        assert agent.resume("L-holders")[0] == 200

        after = holders(connection)
        assert [h["name"] for h in after["holders"]] == ["x", "d", "view"] and after["more"]["count"] == 0
        assert cell(kc, "print(simgpu.memory_allocated(0) >> 20)").strip() == "80"
        status, again = agent.park("L-holders")
        assert status == 200 and again["lost"] == [], "no traceback kept: nothing said"
    finally:
        agent.stop()


NESTED = """
from gpupool.node import simgpu
class Trainer:
    def __init__(self):
        self.weights = {'w': simgpu.zeros(8 << 20, 'uint8')}
        self.me = self
trainer = Trainer()
deep = [[[[simgpu.zeros(4 << 20, 'uint8')]]]]
def inner():
    held = simgpu.zeros(2 << 20, 'uint8')
    raise KeyError('inner')
def outer():
    try:
        inner()
    except KeyError as exc:
        raise ValueError('outer') from exc
"""


@pytest.fixture
def shell(monkeypatch):
    """A real IPython shell in this process, on one simulated GPU of a root of its own."""
    from IPython.core.interactiveshell import InteractiveShell

    root = Path("/dev/shm") / f"gpupool-test-holders-{secrets.token_hex(4)}"
    monkeypatch.setenv(simgpu_store.ROOT_ENV, str(root))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", simulated_uuid("holders", 0))
    ip = InteractiveShell()  # not the global instance: see tests/service/test_queue.py
    yield ip
    lasttraceback.forget(ip)
    ip.user_ns.clear()
    shutil.rmtree(root, ignore_errors=True)


def test_attributes_chained_exceptions_and_the_depth_bound_in_one_shell(shell):
    shell.run_cell(NESTED)
    shell.run_cell("outer()")
    listed = gpumemory.listing(shell)
    rows = {h["name"]: h["bytes"] for h in listed["holders"]}
    label = "last traceback (ValueError; frames of Cell In[1])"
    assert rows == {"trainer": 8 * MiB, label: 2 * MiB}, "deep's array is 4 levels down: past DEPTH"
    assert lasttraceback.forget(shell) == label and lasttraceback.forget(shell) is None
    assert not hasattr(sys, "last_traceback") and sys.modules["gpupool.node.simgpu"].memory_allocated() \
        == 12 * MiB, "inner's frame, reached through the chained KeyError, was cleared"


def test_a_huge_namespace_is_looked_at_within_the_bounds(shell):
    shell.run_cell("from gpupool.node import simgpu\nx = simgpu.zeros(1 << 20, 'uint8')\n"
                   "rows = [{'a': [i, str(i)]} for i in range(400_000)]")
    began = time.monotonic()
    listed = gpumemory.listing(shell)
    assert time.monotonic() - began < 3 * gpumemory.SECONDS
    assert listed["complete"] is False and [h["name"] for h in listed["holders"]] == ["x"]


def test_pytorch_values_in_host_memory_hold_none_and_are_not_walked_into(shell):
    """The PyTorch branch with real PyTorch (a CPU build here: its CUDA part runs in ``make gpu-check``)."""
    pytest.importorskip("torch")
    shell.run_cell("import torch\nfrom gpupool.node import simgpu\nmodel = torch.nn.Linear(64, 64)\n"
                   "pair = [torch.zeros(1000), model]\nx = simgpu.zeros(1 << 20, 'uint8')")
    listed = gpumemory.listing(shell)
    assert [h["name"] for h in listed["holders"]] == ["x"] and listed["complete"] is True
    assert gpumemory.allocations(shell.user_ns["model"]) == {}, "a module is a leaf: its parameters, on the CPU"
