"""Attach latency: ``%gpu acquire`` to the first remote cell finished, cold and warm.

Starts a real ``gpupool service`` and a real ``gpupool agent`` (simulated
GPUs) on this machine, then acquires a 0.5 slice N times per mode, each time
the way ``%gpu acquire`` does (``gpupool.api.ServiceClient.create_lease`` with
``start_wait=gpupool.leasewait.START_WAIT_S``, so the answer is the active lease
when the worker started within that; else long polls
``GET /leases/{id}?wait=2&state=...`` until active), then
``gpupool.magics.attachment.Attachment.connect``: a
``gpupool.remote.RemoteKernel`` that waits for ``kernel_info`` and a
heartbeat thread), runs one cell (``x = 1``) on the worker, and releases.
It drives these classes directly rather than a notebook kernel: the magic
adds only argument parsing and printing around them.

Modes: ``cold`` (``--warm-workers=0``: every lease's worker is forked from
the agent's worker template, ``gpupool.zygote``), ``boot``
(``--warm-workers=0 --AgentWorkers.worker_templates=False``: every lease boots
a new interpreter) and ``warm`` (``--warm-workers=W``). Before each warm acquire the bench waits
until the agent has W warm workers ready again (the agent logs each one), as
a user's think time would; what it waited is not part of the attach time.

Where the time goes, per acquire (the phases add up to the total):

- ``create``: from sending ``POST /leases`` to the lease's ``created_at``
  (the request's way in: HTTP, auth, up to the placing transaction);
- ``agent``: the agent's ``POST /workers`` work (bind a warm worker, or fork
  or boot a cold one), from the agent's log line ``started warm|cold in N ms``;
- ``service``: the rest of the time between the lease's ``created_at`` and
  ``started_at`` (quota, placement and the SQL write of the reservation, the
  service's call to the agent);
- ``wake``: from ``started_at`` until the client had the active lease (writing
  ``active``, the answer);
- ``connect``: ``Attachment.connect`` (kernel_info round trip, heartbeat);
- ``cell``: the first cell, sent to finished.

    .venv/bin/python bench/attach_bench.py --n 50 --out bench

writes ``OUT/attach_results.json`` (every acquire) and ``OUT/attach_latency.png``
and prints the report section's tables as Markdown.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from gpupool import demo_pool
from gpupool.leasewait import START_WAIT_S
from gpupool.magics.attachment import Attachment
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest

PHASES = ("create", "service", "agent", "wake", "connect", "cell")
MODES = ("cold", "boot", "warm")
#: The p50 targets (ms) of the warm and cold attach; the boot mode is reported beside them.
TARGETS = {"warm": 40.0, "cold": 250.0}
COLORS = {"cold": "tab:blue", "boot": "tab:gray", "warm": "tab:orange"}
_STARTED = re.compile(r"worker for lease (\S+) of \S+ started (warm|cold) in (\d+) ms")


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def acquire_once(client, agent_log: Path) -> dict[str, float | str]:
    """One acquire -> first cell -> release; returns seconds per phase, the
    total, and whether the agent served it warm or cold."""
    t0_wall, t0 = time.time(), time.monotonic()
    lease = client.create_lease(LeaseRequest(fraction=0.5), start_wait=START_WAIT_S)
    while lease.state in (LeaseState.queued, LeaseState.starting):
        lease = client.get_lease(lease.id, wait=2, state=lease.state.value)
    t2_wall, t2 = time.time(), time.monotonic()
    if lease.state is not LeaseState.active:
        raise RuntimeError(f"lease {lease.id} ended {lease.state.value}: {lease.reason}")
    attachment = Attachment.connect(client, lease)
    t3 = time.monotonic()
    try:
        reply = attachment.remote.execute("x = 1", lambda msg: None)
        t4 = time.monotonic()
        assert reply.get("status") == "ok", reply
    finally:
        attachment.release(reason="bench")
    how, agent_ms = _agent_line(agent_log, lease.id)
    held = _epoch(lease.started_at) - _epoch(lease.created_at)
    return {"lease": lease.id, "how": how, "total": t4 - t0, "create": max(0.0, _epoch(lease.created_at) - t0_wall),
            "agent": agent_ms / 1000, "service": max(0.0, held - agent_ms / 1000),
            "wake": max(0.0, t2_wall - _epoch(lease.started_at)), "connect": t3 - t2, "cell": t4 - t3,
            "t0_wall": t0_wall}


def _agent_line(log: Path, lease_id: str) -> tuple[str, float]:
    for _ in range(100):
        for line in log.read_text(errors="replace").splitlines():
            found = _STARTED.search(line)
            if found and found.group(1) == lease_id:
                return found.group(2), float(found.group(3))
        time.sleep(0.02)
    return "unknown", float("nan")


def _warm_ready(log: Path) -> int:
    return sum(1 for line in log.read_text(errors="replace").splitlines()
               if "warm worker warm-" in line and " ready:" in line)


def run_mode(state: Path, service, mode: str, n: int, warm: int, preload: list[str]) -> list[dict]:
    """Start an agent for ``mode``, run ``n`` acquires, stop the agent."""
    args = [f"--warm-workers={warm if mode == 'warm' else 0}"]
    if mode == "boot":
        args.append("--AgentWorkers.worker_templates=False")
    if preload and mode == "warm":
        args.append("--AgentWorkers.preload_modules=" + json.dumps(preload))
    # One node name for both modes, so no lease is placed on the stopped agent.
    agent = demo_pool.start_agent(state / f"agent-{mode}", service, name="node-bench", extra_args=args,
                                  client=service.client(), timeout=60)
    # The node keeps its name across modes: wait until the service has this
    # agent's address, not the stopped one's.
    demo_pool.wait_for(lambda: "registered with" in agent.log.read_text(errors="replace"), 60,
                       "agent registration", agent.proc, agent.log)
    if mode == "cold":  # the agent starts its template as it starts: a node that has run a while has it
        demo_pool.wait_for(lambda: "worker template of" in agent.log.read_text(errors="replace"), 60,
                           "the worker template", agent.proc, agent.log)
    client = service.client()
    results = []
    try:
        for i in range(n):
            if mode == "warm":  # think time: until the pool is full again
                demo_pool.wait_for(lambda: _warm_ready(agent.log) >= i + warm, 120, "warm workers", agent.proc,
                                   agent.log)
            else:
                time.sleep(0.2)
            results.append(acquire_once(client, agent.log))
            print(f"{mode} {i + 1}/{n}: {results[-1]['total'] * 1000:.0f} ms ({results[-1]['how']})",
                  file=sys.stderr, flush=True)
    finally:
        agent.stop()
    return results


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def summarize(results: dict[str, list[dict]]) -> dict:
    summary = {}
    for mode, rows in results.items():
        totals = [r["total"] for r in rows]
        summary[mode] = {
            "n": len(rows), "served": {how: sum(r["how"] == how for r in rows) for how in ("warm", "cold", "unknown")},
            "p50_ms": 1000 * percentile(totals, 50), "p99_ms": 1000 * percentile(totals, 99),
            "phases_p50_ms": {p: 1000 * statistics.median(r[p] for r in rows) for p in PHASES},
        }
    return summary


def markdown(summary: dict, command: str, warm: int, preload: list[str]) -> str:
    lines = ["## Attach latency", "",
             "`%gpu acquire 0.5` to the first remote cell finished, through a real service and agent "
             "(simulated GPUs) on this machine (2 shared CPU cores), driven with `gpupool.api.ServiceClient` "
             "and `gpupool.magics.attachment.Attachment` (the classes the magic uses), not a notebook kernel. "
             f"Warm: `--warm-workers={warm}`" + (f", preloading {', '.join(preload)}" if preload else ", no preload")
             + "; before each warm acquire the bench waits until the pool is full again (think time, not counted). "
             "Cold: `--warm-workers=0`, no heavy imports, each worker forked from the agent's worker template; "
             "boot: the same with `--AgentWorkers.worker_templates=False` (a new interpreter per worker).", "",
             f"Reproduce: `{command}`", "",
             "| mode | acquires | served warm / cold | p50 | p99 | target (p50) | met |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for mode in (m for m in MODES if m in summary):
        s, target = summary[mode], TARGETS.get(mode)
        met = "-" if target is None else "yes" if s["p50_ms"] <= target else "**no**"
        lines.append(f"| {mode} | {s['n']} | {s['served']['warm']} / {s['served']['cold']} | {s['p50_ms']:.0f} ms | "
                     f"{s['p99_ms']:.0f} ms | {'-' if target is None else f'≤ {target:.0f} ms'} | {met} |")
    lines += ["", "Where the time goes (median per phase, ms):", "",
              "| mode | " + " | ".join(PHASES) + " |", "| --- |" + " --- |" * len(PHASES)]
    for mode in (m for m in MODES if m in summary):
        phases = summary[mode]["phases_p50_ms"]
        lines.append(f"| {mode} | " + " | ".join(f"{phases[p]:.0f}" for p in PHASES) + " |")
    lines += ["", "Phases (they add up to the total): `create` = sending `POST /leases` (with `start_wait`, as "
              "`%gpu acquire` does) to the lease's `created_at` (HTTP, auth); `service` = `created_at` to "
              "`started_at` minus the agent's part (quota, placement and the reservation's SQL write, the "
              "service's HTTP call to the agent); `agent` = the agent's own `POST /workers` time (binding a warm "
              "worker, or forking or booting a kernel); `wake` = `started_at` to the client holding the active "
              "lease (the `active` write, the answer; a long poll's, when the start took longer than "
              "`start_wait`); `connect` = `kernel_info` round trip and heartbeat start; `cell` = `x = 1` sent "
              "to finished.", "",
              "![attach latency](attach_latency.png)", ""]
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    modes = [m for m in MODES if m in results]
    for mode in modes:
        totals = sorted(1000 * r["total"] for r in results[mode])
        left.plot(totals, [(i + 1) / len(totals) for i in range(len(totals))], label=mode, color=COLORS[mode])
    left.set_xscale("log")
    left.set_xlabel("acquire -> first cell finished (ms, log)")
    left.set_ylabel("share of acquires")
    for mode, target in TARGETS.items():
        left.axvline(target, color=COLORS[mode], linestyle=":", label=f"{mode} target")
    left.legend()
    positions = range(len(PHASES))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        right.bar([p + (i - (len(modes) - 1) / 2) * width for p in positions],
                  [summary[mode]["phases_p50_ms"][p] for p in PHASES], width, label=mode, color=COLORS[mode])
    right.set_xticks(list(positions), PHASES)
    right.set_yscale("log")
    right.set_ylabel("median ms per phase (log)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50, help="acquires per mode (default 50)")
    parser.add_argument("--warm-workers", type=int, default=1, help="warm pool size for the warm mode (default 1)")
    parser.add_argument("--preload", action="append", default=[], help="module the warm workers preload (repeatable)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent, help="where results go (default bench/)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from OUT/attach_results.json")
    args = parser.parse_args(argv)
    if args.replot:
        saved = json.loads((args.out / "attach_results.json").read_text())
        plot(saved["results"], saved["summary"], args.out / "attach_latency.png")
        return 0
    state = Path(tempfile.mkdtemp(prefix="gpupool-attach-"))
    service = demo_pool.start_service(state / "service")
    results: dict[str, list[dict]] = {}
    try:
        for mode in args.modes.split(","):
            results[mode] = run_mode(state, service, mode, args.n, args.warm_workers, args.preload)
    finally:
        service.stop()
    summary = summarize(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attach_results.json").write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    command = "python bench/attach_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if {"cold", "warm"} <= set(results):
        plot(results, summary, args.out / "attach_latency.png")
        print(markdown(summary, command.strip(), args.warm_workers, args.preload))  # for bench/REPORT.md
    print(json.dumps(summary, indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
