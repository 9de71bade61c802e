"""What reading NVML through the watched helper process costs, and what a hung
driver call costs the agent.

No GPU is needed: NVML is the test suite's fake (``tests/support/fakenvml.py``),
so the numbers are the helper's own overhead (a process, a socket, pickles),
not the driver's.

1. One heartbeat's readings (refresh, GPU metrics, process list and samples,
   health) of a node with ``--gpus`` GPUs and 4 processes each: in-process
   (:class:`~gpupool.node.inventory.retrying.RetryingInventory` over
   :class:`~gpupool.node.inventory.nvml.inventory.NVMLInventory`, what the agent did
   before) and through the helper (:class:`~gpupool.node.inventory.nvml.watch.WatchedInventory`).
2. Replacing a helper: killing a hung one and starting one that opens NVML.
3. A real service and agent (NVML helper on the fake): ``GET /health`` on
   the agent, idle and while every NVML call hangs (``nvml_timeout`` 1 s, so
   helpers are killed and replaced all along).

    .venv/bin/python bench/nvml_helper_bench.py --rounds 300 --health 300

prints the report section (bench/REPORT.md, "NVML helper") as Markdown.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

from fakenvml import ControlledNVML, FakeGPU, FakeProcess, FakeSample, hanging_pid, set_hang  # noqa: E402

from gpupool.node.inventory.retrying import RetryingInventory  # noqa: E402
from gpupool.node.inventory.nvml.inventory import NVMLInventory  # noqa: E402
from gpupool.node.inventory.nvml.watch import WatchedInventory  # noqa: E402


def uuids(count: int) -> list[str]:
    return [f"GPU-{i:08x}-1111-2222-3333-444444444444" for i in range(count)]


def busy_gpus(count: int) -> list[FakeGPU]:
    return [FakeGPU(u, processes=[FakeProcess(1000 + 10 * i + p, 2**30) for p in range(4)],
                    samples=[FakeSample(1000 + 10 * i + p, 1_000 + p, 25) for p in range(4)])
            for i, u in enumerate(uuids(count))]


def percentiles(samples: list[float]) -> tuple[float, float]:
    """(p50, p99) in milliseconds of ``samples`` in seconds."""
    ordered = sorted(samples)
    return 1000 * statistics.median(ordered), 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def heartbeat_readings(inv) -> None:
    inv.refresh()
    inv.process_usage(), inv.metrics(), inv.process_known(), inv.health()


def time_rounds(inv, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        heartbeat_readings(inv)
        times.append(time.perf_counter() - start)
    return times


def helper_command_busy(control: Path, count: int) -> list[str]:
    """A helper on the fake with ``count`` busy GPUs (the launcher builds them)."""
    code = ("import sys; sys.path.insert(0, %r); import fakenvml; from pathlib import Path; "
            "sys.modules['pynvml'] = fakenvml.ControlledNVML(__import__('nvml_helper_bench').busy_gpus(%d), "
            "Path(%r)); from gpupool.node.inventory.nvml import helper; sys.exit(helper.main(sys.argv[1:]))"
            % (str(ROOT / "tests" / "support"), count, str(control)))
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); " + code]


def readings_section(rounds: int, gpus: int, tmp: Path) -> list[str]:
    control = tmp / "nvml.json"
    local = RetryingInventory(lambda: NVMLInventory(ControlledNVML(busy_gpus(gpus), control)))
    in_process = time_rounds(local, rounds)
    local.close()
    watched = WatchedInventory(command=helper_command_busy(control, gpus), timeout=5.0)
    assert watched.error is None and len(watched.discover()) == gpus, watched.error
    helper = time_rounds(watched, rounds)
    replace = []
    watched.timeout = 0.2
    for _ in range(10):
        set_hang(control, True)
        watched.refresh()  # times out after 0.2 s: killed
        set_hang(control, False)
        watched.next_attempt = 0.0
        start = time.perf_counter()
        assert watched.refresh() is True
        replace.append(time.perf_counter() - start)
    watched.close()
    (a50, a99), (b50, b99), (r50, r99) = percentiles(in_process), percentiles(helper), percentiles(replace)
    return [f"**One heartbeat's NVML readings**, {gpus} GPUs with 4 processes each, {rounds} rounds:", "",
            "| how | p50 ms | p99 ms |", "| --- | --- | --- |",
            f"| in the agent's process (before) | {a50:.2f} | {a99:.2f} |",
            f"| through the helper process | {b50:.2f} | {b99:.2f} |", "",
            f"**Replacing a helper** (a new process that imports the binding and opens NVML), 10 times: "
            f"p50 {r50:.0f} ms, p99 {r99:.0f} ms.", ""]


def health_section(count: int, tmp: Path) -> list[str]:
    from procs import start_service
    from test_nvml_degraded import node_in_state, start_nvml_agent

    service = start_service(tmp)
    control = tmp / "agent-nvml.json"
    agent = start_nvml_agent(tmp, service, control, extra=("--AgentInventory.nvml_timeout=1",))
    try:
        node_in_state(service.client(), agent, "up")

        def health_times() -> list[float]:
            times = []
            for _ in range(count):
                start = time.perf_counter()
                with urllib.request.urlopen(f"{agent.url}/health", timeout=30) as response:
                    response.read()
                times.append(time.perf_counter() - start)
            return times

        idle = health_times()
        set_hang(control, True)
        while hanging_pid(control) is None:
            time.sleep(0.01)
        hung = health_times()
        set_hang(control, False)
    finally:
        set_hang(control, False)
        agent.stop()
        service.stop()
    (i50, i99), (h50, h99) = percentiles(idle), percentiles(hung)
    return [f"**Agent `GET /health`**, {count} requests each (real service and agent, NVML helper on the fake, "
            "`nvml_timeout` 1 s):", "",
            "| NVML | p50 ms | p99 ms |", "| --- | --- | --- |",
            f"| answering | {i50:.2f} | {i99:.2f} |",
            f"| every call hangs (helpers killed and replaced meanwhile) | {h50:.2f} | {h99:.2f} |", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--health", type=int, default=300)
    args = parser.parse_args()
    logging.getLogger("gpupool").setLevel(logging.ERROR)  # the helper's warnings are expected here
    with tempfile.TemporaryDirectory() as tmp:
        lines = readings_section(args.rounds, args.gpus, Path(tmp))
        lines += health_section(args.health, Path(tmp))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
