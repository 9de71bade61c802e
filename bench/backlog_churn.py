"""How often pressure preempts the same batch jobs: the notebook month plus a batch backlog.

    .venv/bin/python bench/backlog_churn.py [--hours 6] [--pool-size 336] [--pool-wide] [--data ../shared/data]

Replays the first ``--hours`` of the sensei month (0: all of it) with openb's GPU pods as a
preemptible batch backlog under the service's default rules, as ``bench/simulate_report.py``'s
backlog part does, and counts the preemptions: in all, of how many jobs, and the most of one
job. ``--pool-wide`` turns node clearing off (``c.PoolPressure.pressure_clears_nodes = False``),
which counts pressure in GPUs pool-wide: there the same jobs are preempted over and over, since
each one's own resume is placed back on what its preemption freed. Also prints utilization,
the interactive p95 wait, the waiters each preemption was for, and the replay's wall time.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import simulate_report as report  # noqa: E402  (bench/ is on the path above)

from gpupool.hub_plugin.simulate import notebooks  # noqa: E402
from gpupool.leaseclasses import lease_class  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=6.0, help="the month's first hours to replay (0: all)")
    parser.add_argument("--pool-size", type=int, default=report.BACKLOG_POOL)
    parser.add_argument("--pool-wide", action="store_true", help="pressure_clears_nodes = False")
    parser.add_argument("--data", default=str(Path(__file__).parents[1] / ".." / "shared" / "data"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    data = args.data if Path(args.data, "sensei_june_60sec.csv").exists() else None
    workload = report.first_hours(report.load_sensei(data, args.seed, 100), args.hours or None)
    policy = replace(report.policies()["gpupool"], name="gpupool (the service's defaults)"
                     + (", pressure pool-wide" if args.pool_wide else ""), clear_nodes=not args.pool_wide)
    victims: collections.Counter = collections.Counter()
    waiters: collections.Counter = collections.Counter()
    preempt = notebooks._Replay.preempt

    def counted(replay, sid, now):
        victims[sid] += 1
        people = [w for w in replay.sweep.waiters.values() if lease_class(w.lease_class).preempts]
        waiters[("a resume" if any(w.node for w in people) else "")
                + (" and " if any(w.node for w in people) and any(not w.node for w in people) else "")
                + ("a new request" if any(not w.node for w in people) else "")] += 1
        return preempt(replay, sid, now)

    notebooks._Replay.preempt = counted
    started = time.perf_counter()
    result = report.backlog_run(workload, data, args.seed, args.pool_size, policy, print)
    wall = time.perf_counter() - started
    most = max(victims.values(), default=0)
    print(f"{policy.name}, {args.hours or 'all'} h, {args.pool_size} GPUs: {result.preemptions:,} preemptions of "
          f"{len(victims):,} jobs (one job {most:,} times); cluster utilization {result.cluster_utilization:.1%}, "
          f"interactive p95 wait {result.wait_percentile(95):.0f} s; replay {wall:.0f} s")
    print("a person waiting for:", ", ".join(f"{kind} {count:,}" for kind, count in waiters.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
