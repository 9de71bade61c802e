"""Scheduler decisions per second and decision latency under churn.

    .venv/bin/python bench/scheduler_bench.py [--decisions 20000] [--seed 0] [--no-report]

For pools of 1,000 and 10,000 simulated GPUs (A100-80GB, 8 per node) it
keeps the pool about 97 % allocated: leases end at random, and new requests
arrive (slices of 0.1/0.25/0.5/1.0 GPU with the weights below, and 3 %
requests for 2, 4 or 8 whole GPUs). Each request is one decision, timed
alone with ``time.perf_counter_ns``:

- ``index``: :class:`gpupool.hub_plugin.placement_index.PlacementIndex`,
  which returns ``scheduler.place()``'s exact answer (tests/test_scheduler.py
  checks it) without scanning every GPU;
- ``full scan``: ``scheduler.place(demand, all GPUs)``, what the service
  calls per request today (fewer decisions: it is slow).

Refusals are decisions too (the request is dropped). Writes the
"Scheduler" section of bench/REPORT.md unless ``--no-report``.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from gpupool.hub_plugin.placement_index import PlacementIndex  # noqa: E402
from gpupool.hub_plugin.scheduler import Demand, GPUState, Placement, place  # noqa: E402

SLICES = ((0.1, 0.2), (0.25, 0.3), (0.5, 0.3), (1.0, 0.2))  # (fraction, weight)
WHOLE = (2, 4, 8)
WHOLE_SHARE = 0.03
TARGET_ALLOCATED = 0.97
MEMORY = 80 * 10**9


def pool(size: int) -> list[GPUState]:
    return [GPUState(uuid=f"GPU-{i}", node=f"node-{i // 8:04d}", name="NVIDIA A100-SXM4-80GB", index=i % 8,
                     memory_total=MEMORY, memory_usable=MEMORY) for i in range(size)]


def demand(rng: random.Random) -> Demand:
    if rng.random() < WHOLE_SHARE:
        return Demand(1.0, rng.choice(WHOLE))
    return Demand(rng.choices([f for f, _ in SLICES], [w for _, w in SLICES])[0])


def run(size: int, decisions: int, seed: int, full_scan: bool) -> dict[str, float]:
    """Churn on a pool of ``size`` GPUs; returns rates and latencies (ms)."""
    rng = random.Random(seed)
    index = PlacementIndex(pool(size))
    held: list[Placement] = []
    allocated = 0.0
    latencies: list[int] = []
    placed = 0

    def change(p: Placement, sign: int) -> None:
        for uuid in p.gpus:
            g = index.states[uuid]
            index.update(dataclasses.replace(g, allocated_fraction=max(0.0, g.allocated_fraction + sign * p.fraction),
                                             allocated_memory=g.allocated_memory + sign * p.memory))

    while len(latencies) < decisions:
        if held and (allocated > TARGET_ALLOCATED * size or rng.random() < 0.3):
            gone = held.pop(rng.randrange(len(held)))
            change(gone, -1)
            allocated -= gone.fraction * len(gone.gpus)
            continue
        ask = demand(rng)
        start = time.perf_counter_ns()
        decision = place(ask, index.all()) if full_scan else index.place(ask)
        latencies.append(time.perf_counter_ns() - start)
        if isinstance(decision, Placement):
            placed += 1
            held.append(decision)
            change(decision, +1)
            allocated += decision.fraction * len(decision.gpus)
    total_s = sum(latencies) / 1e9
    cuts = statistics.quantiles(latencies, n=100)
    return {"gpus": size, "decisions": len(latencies), "per_s": len(latencies) / total_s,
            "p50_ms": cuts[49] / 1e6, "p99_ms": cuts[98] / 1e6, "max_ms": max(latencies) / 1e6,
            "placed": placed / len(latencies)}


def report(rows: list[tuple[str, dict[str, float]]], command: str) -> str:
    lines = ["## Scheduler", "",
             "Decisions per second and decision latency of `scheduler.place()` under churn "
             "(`bench/scheduler_bench.py`; its docstring has the workload). Reproduce from the repository root:", "",
             "```", command, "```", "",
             f"Machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
             "one thread; the machine was shared with other work, so treat the figures as rough.", "",
             "| path | GPUs | decisions | decisions/s | p50 ms | p99 ms | max ms | placed |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['gpus']:,} | {r['decisions']:,} | {r['per_s']:,.0f} | {r['p50_ms']:.3f} | "
                     f"{r['p99_ms']:.3f} | {r['max_ms']:.2f} | {r['placed']:.0%} |")
    big = next(r for n, r in rows if n == "index" and r["gpus"] == 10_000)
    met = big["per_s"] >= 5000 and big["p99_ms"] <= 5
    lines += ["", f"Target at 10,000 GPUs (≥ 5,000 decisions/s and p99 ≤ 5 ms) with the index: "
              f"**{'met' if met else 'not met'}** ({big['per_s']:,.0f}/s, p99 {big['p99_ms']:.2f} ms).", "",
              "The index returns `place()`'s own answer (it calls `place()` on the few candidates it finds; "
              "`tests/test_scheduler.py::test_placement_index_gives_the_same_answer_under_churn` compares the two "
              "on random pools). A refusal scans every GPU, since its message tallies a reason for each one; that "
              "is where the slow tail (max) comes from: at 1,000 GPUs the 1 % of requests refused set the p99; "
              "a run at 10,000 GPUs with 1 % or more refusals would have a p99 near the full-scan p50, so the "
              "target holds for placements, not for refusals. decisions/s is decisions over the time spent "
              "deciding (the churn's bookkeeping is not counted). The service itself still builds the GPU list "
              "from SQL per request and calls `place()` on all of it (the full-scan rows); the index serves this "
              "benchmark (the simulator keeps its own candidate subset, hub_plugin/simulator_pool.py).", ""]
    return "\n".join(lines)


def write_section(text: str) -> None:
    """Replace (or append) the "## Scheduler" section of bench/REPORT.md, leaving the rest as it is."""
    path = ROOT / "bench" / "REPORT.md"
    old = path.read_text()
    start = old.find("\n## Scheduler\n")
    if start == -1:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + 1)
        new = old[:start + 1] + text + ("" if end == -1 else "\n" + old[end + 1:])
    path.write_text(new.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decisions", type=int, default=20000, help="decisions per pool with the index")
    parser.add_argument("--full-scan-decisions", type=int, default=300, help="decisions per pool, full scan")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-report", action="store_true", help="print only; leave bench/REPORT.md alone")
    args = parser.parse_args(argv)
    rows = []
    for size in (1_000, 10_000):
        rows.append(("index", run(size, args.decisions, args.seed, full_scan=False)))
        rows.append(("full scan", run(size, args.full_scan_decisions, args.seed, full_scan=True)))
        for name, r in rows[-2:]:
            print(f"{name:9} {size:6,} GPUs: {r['per_s']:9,.0f} decisions/s  p50 {r['p50_ms']:.3f} ms  "
                  f"p99 {r['p99_ms']:.3f} ms  max {r['max_ms']:.2f} ms  placed {r['placed']:.0%}", flush=True)
    command = ".venv/bin/python bench/scheduler_bench.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]) if a != "--no-report")
    if not args.no_report:
        write_section(report(rows, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
