"""Slurm launcher timings on this machine: the private Slurm of tests/support/slurm.py
(munged, slurmctld, slurmd) started and stopped, and a lease's worker from
``SlurmLauncher.start`` to its first cell finished, as a lease job of its own
(whole GPU) and as a step of a share job (slice), N times each.

    .venv/bin/python bench/slurm_bench.py --n 3 --out bench

writes ``OUT/slurm.json`` and prints a Markdown table. Needs root and Debian's
Slurm and munge (``make install``); says why and exits 0 without them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

import slurm  # noqa: E402  (tests/support/slurm.py)
from test_slurm import Worker, spec  # noqa: E402

from gpupool.node.workers.launchers.slurm import SlurmLauncher  # noqa: E402


async def _workers(launcher: SlurmLauncher, n: int, folder: Path, times: dict[str, list[float]]) -> None:
    for kind, lease in (("lease job, first cell", spec(f"B-job-{n}")),
                        ("slice step, first cell", spec(f"B-step-{n}", fraction=0.5))):
        worker = Worker(folder / kind.split(",")[0].replace(" ", "-"), lease)
        began = time.monotonic()
        record = await worker.start(launcher)
        await worker.run("pass")
        times[kind].append(time.monotonic() - began)
        began = time.monotonic()
        await launcher.stop(record)
        times[kind.replace("first cell", "stop")].append(time.monotonic() - began)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    why = slurm.unavailable()
    if why:
        print(f"slurm_bench: {why}")
        return 0
    times: dict[str, list[float]] = {name: [] for name in (
        "fixture start", "fixture stop", "lease job, first cell", "lease job, stop", "slice step, first cell",
        "slice step, stop")}
    for n in range(args.n):
        cluster = slurm.SlurmCluster(Path(tempfile.mkdtemp(prefix="gpupool-slurm-")))
        cluster.start()
        times["fixture start"].append(cluster.timings["start"])
        try:
            launcher = SlurmLauncher(node=cluster.name, slurm_conf=str(cluster.conf))
            asyncio.run(_workers(launcher, n, Path(tempfile.mkdtemp()), times))
        finally:
            cluster.stop()
        times["fixture stop"].append(cluster.timings["stop"])
    print("| what | median s | min s | max s |\n| --- | --- | --- | --- |")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "slurm.json").write_text(json.dumps({"n": args.n, "seconds": times}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
