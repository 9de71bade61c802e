"""Containment costs: the start gate, and killing a lease's processes.

- ``gate``: starting ``python -c pass`` directly vs behind the workers'
  start gate (:data:`gpupool.node.workers.launchers.local.gate.START_GATE`: a shell that
  waits until the agent put its pid in a cgroup, then execs), including the
  agent's write to ``cgroup.procs``; the difference is what every worker
  start pays.
- ``kill``: :meth:`LeaseCgroup.kill` of a cgroup holding a shell and
  ``--procs`` sleeping processes, half of them in sessions of their own, until
  the cgroup is empty; per mode (v2 ``cgroup.kill``, v2 freeze-and-kill as on
  kernels before 5.14, v1 freezer, and none, which misses the setsid half).

Needs root and the cgroup file systems (each mode missing here is skipped
and said so)::

    sudo .venv/bin/python bench/containment_bench.py --runs 30

prints the section and replaces the "## Containment" section of
bench/REPORT.md unless ``--no-report``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from gpupool.node.cgroups import CgroupError, containment
from gpupool.node.workers.launchers.local.gate import START_GATE
from report import write_section  # noqa: E402  (bench/ is on the path when a bench runs)

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Containment"


def p50_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def time_gate(runs: int, state: Path) -> dict[str, float]:
    """Seconds per start of ``python -c pass``: direct, and through the gate into a v2 (or v1) cgroup."""
    tree = None
    for mode in ("v2", "v1"):
        try:
            tree = containment(mode, f"gpupool/bench-{secrets.token_hex(4)}", state)
            break
        except CgroupError:
            continue
    if tree is None:
        return {}
    direct, gated = [], []
    cmd = [sys.executable, "-c", "pass"]
    try:
        for i in range(runs):
            began = time.perf_counter()
            subprocess.run(cmd, check=True)
            direct.append(time.perf_counter() - began)
            group = tree.create(f"gate-{i}")
            began = time.perf_counter()
            proc = subprocess.Popen([*START_GATE, *cmd], stdin=subprocess.PIPE)
            group.add(proc.pid)
            proc.stdin.write(b"go\n")
            proc.stdin.close()
            proc.wait()
            gated.append(time.perf_counter() - began)
            group.remove()
    finally:
        tree.close()
    return {"mode": tree.mode, "direct": p50_ms(direct), "gated": p50_ms(gated)}


def spawn_tree(procs: int) -> str:
    """A shell command that starts ``procs`` sleepers (every other one in a session of its own), then waits."""
    half = procs // 2
    return (f"for i in $(seq {half}); do sleep 600 & done; "
            f"for i in $(seq {procs - half}); do (setsid sleep 600 </dev/null >/dev/null 2>&1 &); done; "
            "exec sleep 600")


def time_kill(mode: str, runs: int, procs: int, state: Path, freeze_fallback: bool = False) -> dict | None:
    try:
        tree = containment(mode, f"gpupool/bench-{secrets.token_hex(4)}", state)
    except CgroupError:
        return None
    # Without a cgroup the bench still needs one to count and clean up what escaped.
    net_tree = containment("v2", f"gpupool/bench-{secrets.token_hex(4)}", state) if mode == "none" else None
    times, left = [], []
    try:
        for i in range(runs):
            group = tree.create(f"kill-{i}")
            shell = subprocess.Popen(["sh", "-c", f"read -r _; {spawn_tree(procs)}"], stdin=subprocess.PIPE,
                                     start_new_session=True)
            net = net_tree.create(f"net-{i}") if net_tree is not None else group
            net.add(shell.pid)
            group.add(shell.pid)
            shell.stdin.write(b"go\n")
            shell.stdin.close()
            deadline = time.monotonic() + 30
            while len(net.pids()) < procs + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            real_exists = Path.exists
            patch = mock.patch.object(Path, "exists", lambda p: p.name != "cgroup.kill" and real_exists(p)) \
                if freeze_fallback else mock.patch.object(Path, "exists", real_exists)
            with patch:
                began = time.perf_counter()
                group.kill(30.0)
                times.append(time.perf_counter() - began)
            shell.wait()
            left.append(len(net.pids()))
            if net is not group:  # what escaped the process group and tree
                net.kill()
                net.remove()
            group.remove()
    finally:
        tree.close()
        if net_tree is not None:
            net_tree.close()
    return {"p50": p50_ms(times), "max": 1000 * max(times), "left": statistics.median(left) if left else 0}


def markdown(gate: dict, kills: dict[str, dict | None], runs: int, procs: int, command: str) -> str:
    lines = [SECTION, "",
             f"`{command}` on this project's 2-core test machine (root; cgroup v2 at /sys/fs/cgroup/unified with "
             "`cgroup.kill`, v1 freezer/memory/pids/cpu). Medians of "
             f"{runs} runs; load average {os.getloadavg()[0]:.1f} (other test suites ran meanwhile, so a few "
             "ms are noise).", ""]
    if gate:
        lines += ["Start gate (every worker start; `python -c pass`, the gate's `sh` exec and the agent's "
                  f"`cgroup.procs` write, {gate['mode']}):", "",
                  "| start | p50 |", "| --- | --- |",
                  f"| direct | {gate['direct']:.1f} ms |", f"| through the gate | {gate['gated']:.1f} ms |",
                  f"| the gate's cost | {gate['gated'] - gate['direct']:.1f} ms |", ""]
    lines += [f"Killing a lease's processes (a shell and {procs} sleepers, half in sessions of their own), "
              "until its cgroup is empty:", "", "| mode | p50 | max | processes left |", "| --- | --- | --- | --- |"]
    for name, result in kills.items():
        if result is None:
            lines.append(f"| {name} | not available here | | |")
        else:
            lines.append(f"| {name} | {result['p50']:.1f} ms | {result['max']:.1f} ms | {result['left']:g} |")
    lines += ["", "`none` kills the process group and tree only: the sleepers in sessions of their own are left "
              "(the bench kills them itself). A worker start costs a kernel boot (about a second, bench's "
              "\"Attach latency\"), so the gate is noise there; warm workers hide it.", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per measurement (default 30)")
    parser.add_argument("--procs", type=int, default=50, help="processes in each killed cgroup (default 50)")
    parser.add_argument("--no-report", action="store_true", help="print only; leave bench/REPORT.md alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state:
        gate = time_gate(args.runs, Path(state))
        kills = {
            "v2 (`cgroup.kill`)": time_kill("v2", args.runs, args.procs, Path(state)),
            "v2 (freeze, kill, thaw)": time_kill("v2", args.runs, args.procs, Path(state), freeze_fallback=True),
            "v1 (freezer)": time_kill("v1", args.runs, args.procs, Path(state)),
            "none": time_kill("none", max(3, args.runs // 10), args.procs, Path(state)),
        }
    command = f"sudo .venv/bin/python bench/containment_bench.py --runs {args.runs} --procs {args.procs}"
    section = markdown(gate, kills, args.runs, args.procs, command)
    print(section)
    if not args.no_report:
        write_section(SECTION, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
