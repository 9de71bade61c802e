"""``gpupool simulate``: trace-driven replay against the real scheduler and reclaim rules.

    gpupool simulate --workload sensei [--policy reservation,gpupool,batch] --pool-size 384,448
                     [--idle-timeout 5m] [--users 100] [--seed 0] [--data ../shared/data] [--out DIR]
    gpupool simulate --workload openb [--policy gpupool,firstfit,bestfit,random] [--max-load 1.3]

Prints one table row per (policy, pool size) for sensei, and the unallocated
GPU share per arrived load for openb; ``--out DIR`` also writes the rows as
JSON (``simulate-<workload>.json``). The models and their assumptions are in
:mod:`.simulator_workload`, :mod:`.simulator_notebooks` and
:mod:`.simulator_openb`; ``bench/simulate_report.py`` runs the comparisons of
``bench/REPORT.md``. Needs numpy (and the ``hub`` extra, for the reclaim rules).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gpupool.tables import table
from gpupool.units import parse_duration

from .simulator_workload import DEFAULT_DATA

NOTEBOOK_HEADERS = ("policy", "GPUs", "GPU-h held", "GPU-h busy", "util", "p50 wait s", "p95 wait s",
                    "waited", "acquired", "peak held")


def notebook_rows(results) -> list[list]:
    """Table rows for :class:`.simulator_notebooks.NotebookResult` s."""
    return [[r.policy, r.pool_size, f"{r.held_gpu_hours:,.0f}", f"{r.busy_gpu_hours:,.0f}",
             f"{r.utilization:.1%}", f"{r.wait_percentile(50):g}", f"{r.wait_percentile(95):g}",
             f"{r.waited_share:.2%}", f"{r.acquisitions / len(r.waits):.1%}", f"{r.peak_held_gpus:.0f}"]
            for r in results]


def run_sensei(args) -> list[dict]:
    from .simulator_notebooks import policies, simulate_notebooks
    from .simulator_workload import sensei_workload

    workload = sensei_workload(args.data, seed=args.seed, users=args.users)
    chosen = policies(args.idle_timeout)
    names = args.policy or list(chosen)
    unknown = [n for n in names if n not in chosen]
    if unknown:
        raise SystemExit(f"gpupool simulate: unknown policy {unknown[0]!r} for sensei; choose from {', '.join(chosen)}")
    print(f"sensei: {len(workload.cells)} cells in {len(workload.sessions)} sessions; rule: {workload.rule}")
    results = [simulate_notebooks(workload, chosen[name], size) for size in args.pool_size for name in names]
    print(table(NOTEBOOK_HEADERS, notebook_rows(results))[0])
    return [r.row() for r in results]


def run_openb(args) -> list[dict]:
    from .simulator_openb import OPENB_POLICIES, fill, openb_specs, sample_tasks
    from .simulator_workload import read_openb

    nodes, num, milli = read_openb(args.data)
    specs = openb_specs(nodes)
    names = args.policy or list(OPENB_POLICIES)
    unknown = [n for n in names if n not in OPENB_POLICIES]
    if unknown:
        raise SystemExit(f"gpupool simulate: unknown policy {unknown[0]!r} for openb; "
                         f"choose from {', '.join(OPENB_POLICIES)}")
    tasks = sample_tasks(num, milli, len(specs), args.max_load, args.seed)
    results = [fill(specs, *tasks, name) for name in names]
    loads = [x / 10 for x in range(5, int(args.max_load * 10) + 1)]
    print(f"openb: {len(nodes)} nodes, {len(specs)} GPUs, {len(tasks[0])} tasks drawn (seed {args.seed})")
    rows = [[r.policy] + [f"{r.at(load):.1%}" for load in loads] + [f"{r.failed[-1]:.1%}", f"{r.seconds:.1f}"]
            for r in results]
    print("unallocated GPU share by arrived load (GPU demand / capacity):")
    print(table(["policy"] + [f"{load:.0%}" for load in loads] + ["failed", "seconds"], rows)[0])
    return [{"policy": r.policy, "arrived": r.arrived.tolist(), "unallocated": r.unallocated.tolist(),
             "failed": r.failed.tolist(), "seconds": r.seconds} for r in results]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpupool simulate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("sensei", "openb"), default="sensei")
    p.add_argument("--policy", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="comma-separated policies (default: all of the workload's)")
    p.add_argument("--pool-size", type=lambda s: [int(x) for x in s.split(",")], default=[448],
                   help="sensei: comma-separated pool sizes in GPUs, on nodes of 8 (default 448)")
    p.add_argument("--idle-timeout", type=parse_duration, default=300.0,
                   help="sensei: gpupool's idle timeout (default 5m); reservation always uses 30m")
    p.add_argument("--users", type=int, default=100, help="sensei: synthetic users (default 100)")
    p.add_argument("--max-load", type=float, default=1.3,
                   help="openb: stop when arrived GPU demand reaches this multiple of capacity (default 1.3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder of the traces (default ../shared/data)")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON into this folder")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gpupool simulate``; returns the exit code."""
    args = parser().parse_args(argv)
    # sensei also reads openb's pod list (the slice fractions of 1-GPU notebooks).
    needed = ["openb_pod_list_default.csv"]
    needed.append("sensei_june_60sec.csv" if args.workload == "sensei" else "openb_node_list_gpu_node.csv")
    if not all((args.data / name).exists() for name in needed):
        raise SystemExit(f"gpupool simulate: no traces in {args.data}; pass --data DIR (see ../shared/data/README.md)")
    rows = run_sensei(args) if args.workload == "sensei" else run_openb(args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"simulate-{args.workload}.json"
        path.write_text(json.dumps(rows, indent=1))
        print(f"wrote {path}")
    return 0
