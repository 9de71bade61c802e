"""Remoting overhead: what attaching a notebook kernel to a gpupool worker costs.

In one run on one machine, side by side:

- per-cell round trip of a trivial cell (``pass``) as a front end sees it
  (execute_request sent -> reply and idle status received), in (a) a plain
  local ipykernel, (b) a gpupool kernel attached to a worker, (c) the same
  worker spoken to directly (no notebook kernel in between: the breakdown),
  (d) a plain kernel running ``%%px`` and (e) ``%%px --block`` on one
  ipyparallel engine; interleaved, one of each per round, p50/p99 over --cells rounds;
- a 1-second compute cell, local vs attached, alternating, --compute-runs each;
- push/pull throughput of NumPy arrays (timed inside the notebook kernel
  around ``%gpu push``/``%gpu pull``), against a raw loopback TCP socket
  sending the same bytes, and ipyparallel's push/pull to one engine.

Writes bench/remoting.json, bench/remoting_overhead.png and the
"Remoting overhead" section of bench/REPORT.md (replacing only that
section). Run from the repository root:

    .venv/bin/python bench/remoting_bench.py [--cells 500] [--compute-runs 10] [--max-mib 256]

The pool is local (service + agent with simulated GPUs, as ``make demo``):
what is measured is the remoting path, not CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

from gpupool import demo_pool
from report import write_section  # noqa: E402  (bench/ is on the path when a bench runs)

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024**2
SECTION = "## Remoting overhead"
COMPUTE = "import time\n_t = time.perf_counter()\nwhile time.perf_counter() - _t < 1.0:\n    pass"


# -- driving a kernel ------------------------------------------------------------


def roundtrip(kc, code: str, timeout: float = 120) -> tuple[float, dict]:
    """Seconds from sending ``code`` to having both its reply and its idle
    status; also the reply content (raises if the cell failed)."""
    start = time.perf_counter()
    msg_id = kc.execute(code)
    reply, idle = None, False
    while reply is None:
        msg = kc.get_shell_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") == msg_id:
            reply = msg["content"]
    while not idle:
        msg = kc.get_iopub_msg(timeout=timeout)
        idle = (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle")
    elapsed = time.perf_counter() - start
    if reply["status"] != "ok":
        raise RuntimeError(f"cell failed: {code!r}: {reply.get('ename')}: {reply.get('evalue')}")
    return elapsed, reply


def value_of(kc, expression: str, timeout: float = 600) -> float:
    """Evaluate ``expression`` in the kernel through user_expressions (no output)."""
    msg_id = kc.execute("", silent=True, user_expressions={"v": expression})
    while True:
        msg = kc.get_shell_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") == msg_id:
            result = msg["content"]["user_expressions"]["v"]
            if result["status"] != "ok":
                raise RuntimeError(f"{expression!r}: {result.get('ename')}: {result.get('evalue')}")
            return float(result["data"]["text/plain"])


def start_kernel(name: str, kernel_dirs: list[str] | None = None, cwd: str | None = None):
    ksm = KernelSpecManager(kernel_dirs=kernel_dirs) if kernel_dirs else KernelSpecManager()
    km = KernelManager(kernel_name=name, kernel_spec_manager=ksm)
    km.start_kernel(cwd=cwd, env={**os.environ})
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    return km, kc


def stop_kernel(km, kc) -> None:
    kc.stop_channels()
    km.shutdown_kernel(now=False)


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50_ms": pick(0.5) * 1e3, "p99_ms": pick(0.99) * 1e3, "n": len(ordered)}


def interleaved_latency(runners: dict, rounds: int) -> dict[str, dict[str, float]]:
    """Each runner (name -> callable returning seconds) once per round, in
    rotation, so that machine noise falls on all alike; p50/p99 per runner."""
    for _ in range(20):  # warm up
        for run in runners.values():
            run()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            samples[name].append(run())
    return {name: percentiles(values) for name, values in samples.items()}


def direct_worker(service):
    """A connection straight to the attached lease's worker (the same sockets
    and keys the notebook kernel uses): what the worker alone costs."""
    from gpupool.api import ServiceClient
    from gpupool.remote import RemoteKernel

    client = ServiceClient(service.url, (service.state_dir / "user_token").read_text().strip())
    lease, = client.list_leases(active=True)
    remote = RemoteKernel(lease.connection)
    remote.wait_ready(30)
    return remote


def direct_roundtrip(remote) -> float:
    start = time.perf_counter()
    reply = remote.execute("pass", lambda msg: None)
    if reply.get("status") != "ok":
        raise RuntimeError(f"direct cell failed: {reply}")
    return time.perf_counter() - start


# -- transfers ---------------------------------------------------------------------


def raw_socket_seconds(nbytes: int) -> float:
    """Send ``nbytes`` over a loopback TCP connection; seconds until all arrived."""
    payload = memoryview(bytearray(nbytes))
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = bytearray(nbytes)

    def receive() -> None:
        conn, _ = server.accept()
        view, got = memoryview(received), 0
        while got < nbytes:
            got += conn.recv_into(view[got:], min(nbytes - got, 4 * MIB))
        conn.sendall(b"k")
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        start = time.perf_counter()
        conn.sendall(payload)
        conn.recv(1)
        elapsed = time.perf_counter() - start
    thread.join()
    server.close()
    return elapsed


def gpupool_transfer_seconds(kc, nbytes: int) -> tuple[float, float]:
    """(push seconds, pull seconds) of an ``nbytes`` uint8 array, timed inside the kernel."""
    roundtrip(kc, f"%%local\nimport numpy as np, time\nbench_a = np.ones({nbytes}, dtype=np.uint8)")
    roundtrip(kc, "%%local\n_t = time.perf_counter()\nget_ipython().run_line_magic('gpu', 'push bench_a')\n"
                  "bench_push_s = time.perf_counter() - _t\ndel bench_a")
    roundtrip(kc, f"import numpy as np\nbench_b = np.ones({nbytes}, dtype=np.uint8)\ndel bench_a")
    roundtrip(kc, "%%local\n_t = time.perf_counter()\nget_ipython().run_line_magic('gpu', 'pull bench_b')\n"
                  "bench_pull_s = time.perf_counter() - _t\nassert bench_b.nbytes == " + str(nbytes) + "\ndel bench_b")
    roundtrip(kc, "del bench_b")
    push, pull = value_of(kc, "bench_push_s"), value_of(kc, "bench_pull_s")
    return push, pull


def ipp_transfer_seconds(view, nbytes: int) -> tuple[float, float]:
    import numpy as np

    array = np.ones(nbytes, dtype=np.uint8)
    start = time.perf_counter()
    view.push({"bench_a": array}, block=True)
    push = time.perf_counter() - start
    view.execute(f"import numpy as np; bench_b = np.ones({nbytes}, dtype=np.uint8); del bench_a", block=True)
    start = time.perf_counter()
    pulled = view.pull("bench_b", block=True)
    pull = time.perf_counter() - start
    assert pulled.nbytes == nbytes
    view.execute("del bench_b", block=True)
    return push, pull


# -- the run -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=500,
                        help="rounds of trivial cells, one per kernel each, interleaved (default 500)")
    parser.add_argument("--compute-runs", type=int, default=10, help="1-second cells per side (default 10)")
    parser.add_argument("--max-mib", type=int, default=256, help="largest array in MiB (default 256; 1024 = 1 GiB)")
    parser.add_argument("--repeats", type=int, default=3, help="transfers per size and direction; best is kept")
    parser.add_argument("--out", type=Path, default=ROOT / "bench", help="where the JSON and PNG go")
    parser.add_argument("--transport-encryption", choices=("curve", "none"), default="curve",
                        help="the agent's kernel-worker transport (default curve, the agent's own default)")
    parser.add_argument("--no-report", action="store_true", help="do not rewrite bench/REPORT.md")
    parser.add_argument("--skip-transfers", action="store_true",
                        help="measure cells only; keep the transfer rows of OUT/remoting.json (none if it has none)")
    parser.add_argument("--report-only", action="store_true",
                        help="measure nothing: rewrite the section and the PNG from OUT/remoting.json")
    args = parser.parse_args(argv)
    if args.report_only:
        results = json.loads((args.out / "remoting.json").read_text())
        plot(results, args.out / "remoting_overhead.png")
        write_section(SECTION, report(results, results.get("command", "bench/remoting_bench.py")))
        return 0
    sizes = [s for s in (1, 4, 16, 64, 256, 1024) if s <= args.max_mib]
    results: dict = {"cells": args.cells, "compute_runs": args.compute_runs, "sizes_mib": sizes,
                     "machine": f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}",
                     "transport_encryption": args.transport_encryption}
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as tmp:
        root = Path(tmp)
        service = demo_pool.start_service(root / "service")
        agent = demo_pool.start_agent(root / "agent", service, simulate="2xA100-80GB",
                                      extra_args=[f"--transport-encryption={args.transport_encryption}"])
        started = []
        try:
            subprocess.run([*demo_pool.GPUPOOL, "kernelspec", "install", f"--prefix={root / 'prefix'}",
                            f"--url={service.url}", f"--token-file={service.state_dir / 'user_token'}"],
                           check=True, capture_output=True)
            kernels = str(root / "prefix" / "share" / "jupyter" / "kernels")
            plain = start_kernel("python3", cwd=tmp)
            started.append(plain)
            pooled = start_kernel("gpupool", [kernels], cwd=tmp)
            started.append(pooled)
            roundtrip(pooled[1], "%gpu acquire 0.5")
            px = start_kernel("python3", cwd=tmp)
            started.append(px)
            roundtrip(px[1], "import ipyparallel as ipp\n_cluster = ipp.Cluster(n=1, log_level=40)\n"
                             "_rc = _cluster.start_and_connect_sync()\n_rc.wait_for_engines(1, timeout=120)\n"
                             "_rc[:].activate()", timeout=300)

            print("trivial cells, interleaved...", flush=True)
            worker = direct_worker(service)
            try:
                results["latency"] = interleaved_latency({
                    "local": lambda: roundtrip(plain[1], "pass")[0],
                    "gpupool": lambda: roundtrip(pooled[1], "pass")[0],
                    "worker": lambda: direct_roundtrip(worker),
                    "px": lambda: roundtrip(px[1], "%%px\npass")[0],
                    "px_block": lambda: roundtrip(px[1], "%%px --block\npass")[0]}, args.cells)
            finally:
                worker.close()
            print(json.dumps(results["latency"]), flush=True)

            print("1-second cells...", flush=True)
            local_s, pooled_s = [], []
            for _ in range(args.compute_runs):
                local_s.append(roundtrip(plain[1], COMPUTE)[0])
                pooled_s.append(roundtrip(pooled[1], COMPUTE)[0])
            results["compute"] = {"local_s": local_s, "gpupool_s": pooled_s,
                                  "overhead_pct": 100 * (statistics.median(pooled_s) / statistics.median(local_s) - 1)}
            print(json.dumps(results["compute"]), flush=True)

            if args.skip_transfers:  # the last run's rows, none where OUT has no earlier run (the table is empty)
                earlier = args.out / "remoting.json"
                results["transfer"] = json.loads(earlier.read_text())["transfer"] if earlier.exists() else []
            else:
                print("transfers...", flush=True)
                results["transfer"] = transfers_against_ipp(pooled[1], sizes, args.repeats)
            roundtrip(px[1], "_rc.close()\n_cluster.stop_cluster_sync()", timeout=120)
        finally:
            for km, kc in reversed(started):
                stop_kernel(km, kc)
            agent.stop()
            service.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    results["command"] = " ".join(["bench/remoting_bench.py", *(argv if argv is not None else sys.argv[1:])])
    (args.out / "remoting.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "remoting_overhead.png")
    section = report(results, results["command"])
    print(section)
    if not args.no_report:
        write_section(SECTION, section)
    return 0


def transfers_against_ipp(kc, sizes: list[int], repeats: int) -> list[dict]:
    """:func:`transfers` beside one ipyparallel engine of its own."""
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=1, log_level=40)
    rc = cluster.start_and_connect_sync()
    rc.wait_for_engines(1, timeout=120)
    try:
        return transfers(kc, rc[0], sizes, repeats)
    finally:
        rc.close()
        cluster.stop_cluster_sync()


def transfers(kc, engine, sizes: list[int], repeats: int) -> list[dict]:
    rows = []
    for mib in sizes:
        nbytes = mib * MIB
        raw = min(raw_socket_seconds(nbytes) for _ in range(repeats))
        ours = [gpupool_transfer_seconds(kc, nbytes) for _ in range(repeats)]
        theirs = [ipp_transfer_seconds(engine, nbytes) for _ in range(repeats)]
        row = {"mib": mib, "raw_mib_s": mib / raw,
               "push_mib_s": mib / min(p for p, _ in ours), "pull_mib_s": mib / min(p for _, p in ours),
               "ipp_push_mib_s": mib / min(p for p, _ in theirs), "ipp_pull_mib_s": mib / min(p for _, p in theirs)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["local", "gpupool", "worker", "px", "px_block"]
    labels = ["plain\nipykernel", "gpupool\nattached", "its worker,\ndirectly", "%%px\n(default)", "%%px\n--block"]
    lat = results["latency"]
    xs = range(len(names))
    left.bar([x - 0.2 for x in xs], [lat[n]["p50_ms"] for n in names], 0.4, label="p50")
    left.bar([x + 0.2 for x in xs], [lat[n]["p99_ms"] for n in names], 0.4, label="p99")
    left.set_xticks(list(xs), labels)
    left.set_ylabel("ms per trivial cell")
    left.set_title(f"cell round trip ({lat['local']['n']} cells each)")
    left.legend()
    rows = results["transfer"]
    if not rows:  # transfers skipped with no earlier run: the cells' panel alone
        right.set_title("NumPy array transfers: not measured in this run")
        right.axis("off")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        return
    mib = [r["mib"] for r in rows]
    for key, label in (("raw_mib_s", "raw loopback socket"), ("push_mib_s", "gpupool push"),
                       ("pull_mib_s", "gpupool pull"), ("ipp_push_mib_s", "ipyparallel push"),
                       ("ipp_pull_mib_s", "ipyparallel pull")):
        right.plot(mib, [r[key] for r in rows], marker="o", label=label)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("array size, MiB")
    right.set_ylabel("MiB/s")
    right.set_title("NumPy array transfer throughput")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def report(results: dict, command: str) -> str:
    lat, compute, rows = results["latency"], results["compute"], results["transfer"]
    added_ours = lat["gpupool"]["p50_ms"] - lat["local"]["p50_ms"]
    added_px = lat["px"]["p50_ms"] - lat["local"]["p50_ms"]
    added_px_block = lat["px_block"]["p50_ms"] - lat["local"]["p50_ms"]
    big = [r for r in rows if r["mib"] >= 64]
    worst = min((min(r["push_mib_s"], r["pull_mib_s"]) / r["raw_mib_s"] for r in big), default=float("nan"))
    vs_ipp = [r[k] / r["ipp_" + k] for r in big for k in ("push_mib_s", "pull_mib_s")] or [float("nan")]
    met = lambda ok: "**met**" if ok else "**not met**"  # noqa: E731
    lines = [
        SECTION, "",
        "What attaching costs a notebook: the same trivial cell in a plain ipykernel, in a gpupool kernel attached "
        "to a worker (local service + agent with simulated GPUs, so the remoting path and not CUDA is measured), "
        "and in a plain kernel running `%%px` on one ipyparallel engine; a 1-second compute cell; NumPy array "
        f"transfers. One run on one machine ({results['machine']}; the CPUs are shared with other work, so "
        "absolute numbers are noisy; the ratios are within the same run). Kernel-worker transport: "
        f"`{results.get('transport_encryption', 'none')}` (the agent's `transport_encryption`; CurveZMQ costs "
        "transfers most, see docs/security.md, \"What encryption costs\").", "",
        "Reproduce (from the repository root; about five minutes):", "",
        "```", f".venv/bin/python {command}".rstrip(), "```", "",
        "![remoting overhead](remoting_overhead.png)", "",
        f"**Trivial cell (`pass`) round trip, front end to reply and idle, {lat['local']['n']} cells each:**", "",
        "| kernel | p50 ms | p99 ms | added p50 ms |", "|---|---|---|---|",
    ]
    for name, label in (("local", "plain ipykernel"), ("gpupool", "gpupool attached"),
                        ("worker", "the same worker, spoken to directly (no notebook kernel between)"),
                        ("px", "ipyparallel `%%px` (default: `rc[:].activate()` leaves the view non-blocking)"),
                        ("px_block", "ipyparallel `%%px --block` (waits for the engine, like gpupool)")):
        added = lat[name]["p50_ms"] - lat["local"]["p50_ms"]
        lines.append(f"| {label} | {lat[name]['p50_ms']:.2f} | {lat[name]['p99_ms']:.2f} | "
                     f"{'' if name == 'local' else f'{added:.2f}'} |")
    lines += [
        "", f"**1-second compute cell** ({len(compute['local_s'])} alternating runs each): median local "
        f"{statistics.median(compute['local_s']):.4f} s, attached {statistics.median(compute['gpupool_s']):.4f} s, "
        f"overhead {compute['overhead_pct']:.2f} %.", "",
        "**NumPy array transfer, MiB/s** (best of the repeats; gpupool timed inside the notebook kernel around "
        "`%gpu push`/`%gpu pull`, including pickling and the worker's unpickling; raw = one loopback TCP socket "
        "sending the same bytes from a buffer):", "",
        "| MiB | raw socket | gpupool push | gpupool pull | push/raw | pull/raw | ipyparallel push | ipyparallel pull |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['mib']} | {r['raw_mib_s']:.0f} | {r['push_mib_s']:.0f} | {r['pull_mib_s']:.0f} | "
                     f"{r['push_mib_s'] / r['raw_mib_s']:.0%} | {r['pull_mib_s'] / r['raw_mib_s']:.0%} | "
                     f"{r['ipp_push_mib_s']:.0f} | {r['ipp_pull_mib_s']:.0f} |")
    lines += [
        "", "**Targets of issue 27, as ratios within this run:**", "",
        f"- added latency p50 ≤ 0.25 × what `%%px --block` adds: {added_ours:.2f} ms vs {added_px_block:.2f} ms "
        f"(ratio {added_ours / added_px_block if added_px_block else float('nan'):.2f}; p99 "
        f"{lat['gpupool']['p99_ms']:.2f} ms attached, {lat['local']['p99_ms']:.2f} ms plain): "
        f"{met(added_ours <= added_px_block / 4)}; the default `%%px` (which does not wait for the engine) adds "
        f"{added_px:.2f} ms (ratio {added_ours / added_px if added_px else float('nan'):.2f})",
        f"- 1-second compute cell ≤ 0.2 % slower than local: {compute['overhead_pct']:.2f} %: "
        f"{met(compute['overhead_pct'] <= 0.2)}",
        f"- ≥ 70 % of raw socket throughput at ≥ 64 MiB (worst of push and pull, best of the repeats; "
        f"bench/transfer_bench.py measures each size cold): {worst:.0%}: {met(worst >= 0.70)}", "",
        "**Where an attached cell's time goes** (p50, this run): the worker alone, spoken to directly over the same "
        f"CurveZMQ sockets, {lat['worker']['p50_ms']:.2f} ms, against {lat['local']['p50_ms']:.2f} ms for a plain local "
        f"kernel ({lat['worker']['p50_ms'] - lat['local']['p50_ms']:+.2f} ms: the network hop and CurveZMQ, less "
        "what a worker leaves out: the shell-channel thread and ipykernel's 0.5 ms sleep before each reply); the "
        f"gpupool kernel in between adds {lat['gpupool']['p50_ms'] - lat['worker']['p50_ms']:.2f} ms: ipykernel's "
        "dispatch of the request on its main thread, the forward, the worker's reply passed on the moment it comes, "
        "and the relay thread re-signing each IOPub message (the worker's busy and idle included) onto ipykernel's "
        "IOPub thread, whose send of the idle the cell's end waits for (else that thread waits for the GIL while "
        "the notebook kernel files the cell in its history). The cell runs once, on the worker. The notebook kernel and the worker run ipykernel without "
        "its shell-channel thread (`gpupool.kernelapp`: they have no subshells), which the plain ipykernel 7 "
        "kernel has: two thread hand-offs per request fewer, on each of the two kernels. A cell that reads a name "
        "only the notebook kernel holds makes one more round trip (the worker's `have` answer) before it runs. "
        "`%%px` as `activate()` sets it up does not wait for the engine, so its added latency is a submission "
        "only; `%%px --block` is the like-for-like comparison. Transfers are issue 15's (a data plane of their "
        f"own); at 64 MiB and above gpupool moves {min(vs_ipp):.1f}-{max(vs_ipp):.1f}x what ipyparallel does.", "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
