"""``gpupool simulate``: trace-driven replay against the real scheduler and reclaim rules.

    gpupool simulate [--workload sensei] [--data DIR | --from-store URL] [--pool-size 352,384]
                     [--policy dedicated,reservation,gpupool,batch] [--backlog] [--users 100] [--out DIR]
    gpupool simulate --workload openb [--data DIR] [--dimensions gpu|all] [--max-load 1.3]

Without ``--data`` and ``--from-store`` it replays traces it generates
(:mod:`.synthetic`, seeded), so it runs from the wheel; ``--data
DIR`` reads the public traces (``sensei_june_60sec.csv``,
``openb_*.csv``), ``--from-store URL`` a pool's own recorded leases
(:mod:`.store`; what the history lacks is printed). ``--backlog``
adds openb's GPU pods as preemptible batch jobs, enough to keep demand at
120 % of the pool. One table row per (policy, pool size); ``--out DIR``
also writes the rows as JSON. ``bench/simulate_report.py`` runs the
comparisons of ``bench/REPORT.md``. Needs numpy: ``pip install
gpupool[simulate]`` (or the ``hub`` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gpupool.tables import table
from gpupool.units import format_duration, parse_duration

from .defaults import IDLE_TIMEOUT_S, PRESSURE_GRACE_S


def sensei_workload_for(args):
    """The notebook workload the arguments name, and what to say about it."""
    from .traces import openb_slice_millis, read_sensei
    from .workload import build_sessions

    if args.from_store:
        from .store import MISSING, before_cells, load_store

        history = load_store(args.from_store)
        missing = ([before_cells(history.without_cells)] if history.without_cells else []) + list(MISSING)
        notes = [f"store: {history.leases} ended leases ({history.skipped} never started or still open, left "
                 f"out), {history.pool_gpus} GPUs now, {history.recorded_gpu_hours:,.3g} GPU-h held on record",
                 "not in the history (assumed instead):"] + [f"  - {m}" for m in missing]
        return history.workload, notes, history.pool_gpus
    if args.data is not None:
        return build_sessions(read_sensei(args.data), openb_slice_millis(args.data), users=args.users,
                              seed=args.seed), [], None
    from .synthetic import sensei_rows, slice_millis

    return (build_sessions(sensei_rows(args.seed), slice_millis(args.seed), users=args.users, seed=args.seed),
            ["no --data: a generated notebook month (gpupool.hub_plugin.simulate.synthetic, seeded)"], None)


def openb_tables_for(args):
    from .synthetic import openb_tables
    from .traces import read_openb_tasks

    if args.data is not None and (args.data / "openb_pod_list_default.csv").exists():
        return read_openb_tasks(args.data)
    return openb_tables(args.seed)


def run_sensei(args) -> list[dict]:
    from .backlog import BatchSource
    from .notebooks import simulate_notebooks
    from .policies import dedicated_gpus, policies
    from .results import HEADERS, gpu_hours, rows
    from .workload import period_seconds

    workload, notes, store_gpus = sensei_workload_for(args)
    chosen = policies(args.idle_timeout, args.pressure_grace)
    names = args.policy or ["dedicated", *chosen]
    unknown = [n for n in names if n not in chosen and n != "dedicated"]
    if unknown:
        raise SystemExit(f"gpupool simulate: unknown policy {unknown[0]!r} for sensei; "
                         f"choose from dedicated, {', '.join(chosen)}")
    print(f"{len(workload.cells)} cells in {len(workload.sessions)} sessions; rule: {workload.rule}")
    for note in notes:
        print(note)
    if "gpupool" in names:
        gpupool = chosen["gpupool"]
        print(f"gpupool's settings here: idle timeout {format_duration(gpupool.idle_timeout or 0)}, pressure grace "
              f"{format_duration(gpupool.pressure_grace or 0)} (--idle-timeout, --pressure-grace; not the pool's own, "
              "which its store does not hold)")
    sizes = args.pool_size or [store_gpus or 448]
    backlog = None
    if args.backlog:
        _, tasks = openb_tables_for(args)
        gpu = tasks.gpu_pods()
        backlog = (gpu.milli, gpu.num, gpu.lifetime)
    out = []
    if "dedicated" in names:
        owned = dedicated_gpus(workload)
        busy = workload.busy_gpu_hours()
        held = sum(owned.values()) * period_seconds(max(c.submit for c in workload.cells)) / 3600
        users = f"{len(owned)} user{'s' if len(owned) != 1 else ''}"
        print(f"dedicated: {sum(owned.values())} GPUs ({users}, each owning the most GPUs they run at "
              f"once), {gpu_hours(held)} GPU-h held, {busy / held:.1%} utilization, no waits")
        out.append({"policy": "dedicated", "pool_size": sum(owned.values()), "held_gpu_hours": round(held, 3),
                    "busy_gpu_hours": round(busy, 3)})
    results = [simulate_notebooks(workload, chosen[name], size, per_node=args.per_node,
                                  backlog=BatchSource(*backlog, users=args.users, seed=args.seed) if backlog else None)
               for size in sizes for name in names if name != "dedicated"]
    print(table(HEADERS, rows(results))[0])
    return out + [r.row() for r in results]


def run_openb(args) -> list[dict]:
    from .openb import OPENB_POLICIES, fill, openb_specs, sample_tasks

    nodes, tasks = openb_tables_for(args)
    if args.dimensions == "all":
        from . import multidim as multi

        choices, gpus = multi.POLICIES, sum(n.gpus for n in nodes)
        drawn = multi.sample(tasks, gpus, args.max_load, args.seed)
        run = lambda name: multi.fill(nodes, drawn, name, seed=args.seed)  # noqa: E731
        what = f"{len(drawn.num)} tasks (CPU, memory and GPU asks) drawn"
    else:
        choices, specs = OPENB_POLICIES, openb_specs(nodes)
        gpu = tasks.gpu_pods()
        drawn = sample_tasks(gpu.num, gpu.milli, len(specs), args.max_load, args.seed)
        gpus = len(specs)
        run = lambda name: fill(specs, *drawn, name)  # noqa: E731
        what = f"{len(drawn[0])} GPU tasks drawn (GPU dimension only)"
    names = args.policy or list(choices)
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise SystemExit(f"gpupool simulate: unknown policy {unknown[0]!r} for openb --dimensions "
                         f"{args.dimensions}; choose from {', '.join(choices)}")
    results = [run(name) for name in names]
    loads = [x / 10 for x in range(5, int(args.max_load * 10) + 1)]
    print(f"openb: {len(nodes)} nodes, {gpus} GPUs, {what} (seed {args.seed})")
    rows = [[r.policy] + [f"{r.at(load):.1%}" for load in loads] + [f"{r.failed[-1]:.1%}", f"{r.seconds:.1f}"]
            for r in results]
    print("unallocated GPU share by arrived load (GPU demand / capacity):")
    print(table(["policy"] + [f"{load:.0%}" for load in loads] + ["failed", "seconds"], rows)[0])
    return [{"policy": r.policy, "arrived": r.arrived.tolist(), "unallocated": r.unallocated.tolist(),
             "failed": r.failed.tolist(), "seconds": r.seconds} for r in results]


#: What ``--help`` says after the options: the policies and the sources, in plain text.
EPILOG = """policies of the notebook workload (sensei):
  dedicated    each user owns, for the whole period, the most GPUs they ever run at once (what pooling replaces)
  reservation  whole GPUs from a notebook's first cell until it is 30 minutes idle, one queue (no classes)
  gpupool      the slice or whole GPUs until --idle-timeout idle, parked early after --pressure-grace while
               others wait, classes and preemption as the service's rules decide; a park parks in place
               and the next cell resumes on its node (on another, a cold move, when its own has no
               room), paying the park's costs (docs/simulate.md)
  batch        each cell a job holding whole GPUs only while it runs, strict first in first out
policies of openb --dimensions all: fgd, fgd+memory, fgd-k8s, bestfit, firstfit, random

Without --data and --from-store it replays traces it generates (seeded), so it runs from the wheel;
--data DIR reads the public traces (sensei_june_60sec.csv, openb_*.csv); --from-store URL replays a
pool's own leases and the cells its workers ran (what the history lacks is printed). One row per
policy and pool size; --out DIR also writes them as JSON. Needs numpy: pip install 'gpupool[simulate]'.
docs/simulate.md has the rest."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpupool simulate", description="Trace-driven replay of a pool against the "
                                "service's own scheduler, reclaim and pressure rules: how many GPUs for what wait.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    p.add_argument("--workload", choices=("sensei", "openb"), default="sensei",
                   help="sensei: notebooks (a trace, a generated month or --from-store); openb: fill a cluster")
    p.add_argument("--policy", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="comma-separated policies (default: all of the workload's)")
    p.add_argument("--pool-size", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="sensei: comma-separated pool sizes in GPUs (default 448, or the store's GPU count)")
    p.add_argument("--per-node", type=int, default=8, help="sensei: GPUs per node of the simulated pool (default 8)")
    p.add_argument("--idle-timeout", type=parse_duration, default=IDLE_TIMEOUT_S,
                   help="sensei: gpupool's idle timeout (default: the service's, c.PoolLeases.idle_timeout, "
                   f"{IDLE_TIMEOUT_S / 60:g}m); reservation always uses 30m")
    p.add_argument("--pressure-grace", type=parse_duration, default=PRESSURE_GRACE_S,
                   help="sensei: gpupool parks an idle lease after this long while others wait (default: the "
                   f"service's, {PRESSURE_GRACE_S / 60:g}m)")
    p.add_argument("--backlog", action="store_true",
                   help="sensei: add openb's GPU pods as preemptible batch jobs (demand >= 120%% of the pool)")
    p.add_argument("--users", type=int, default=100, help="sensei: synthetic users (default 100)")
    p.add_argument("--dimensions", choices=("gpu", "all"), default="gpu",
                   help="openb: place on GPUs only, or on GPUs, CPU and memory (fgd, fgd+memory, fgd-k8s, bestfit, firstfit, random)")
    p.add_argument("--max-load", type=float, default=1.3,
                   help="openb: stop when arrived GPU demand reaches this multiple of capacity (default 1.3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=None,
                   help="folder of the public traces (default: generate traces)")
    p.add_argument("--from-store", metavar="URL", default=None,
                   help="sensei: replay the leases recorded in a pool's store (its c.GPUPool.db_url)")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON into this folder")
    return p


def check_data(data: Path, workload: str) -> None:
    """Exit with words naming what is missing when ``data`` lacks the traces ``workload`` reads."""
    from .traces import OPENB_NODES, OPENB_PODS, SENSEI

    if not data.is_dir():
        raise SystemExit(f"gpupool simulate: --data {data}: no such folder; pass the folder that holds the "
                         "public traces (docs/simulate.md, \"Traces\"), or leave --data out to generate them")
    needed = [OPENB_PODS, SENSEI if workload == "sensei" else OPENB_NODES]
    missing = [name for name in needed if not (data / name).exists()]
    if missing:
        raise SystemExit(f"gpupool simulate: no {missing[0]} in {data}; pass --data DIR with the traces "
                         "(docs/simulate.md, \"Traces\"), or leave --data out to generate them")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gpupool simulate``; returns the exit code."""
    args = parser().parse_args(argv)
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise SystemExit("gpupool simulate needs numpy: pip install 'gpupool[simulate]'") from None
    if args.data is not None:
        check_data(args.data, args.workload)
    rows = run_sensei(args) if args.workload == "sensei" else run_openb(args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"simulate-{args.workload}.json"
        path.write_text(json.dumps(rows, indent=1))
        print(f"wrote {path}")
    return 0
