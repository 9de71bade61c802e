"""Bulk transfers: `%gpu push` / `%gpu pull` on the data plane against the wire.

In one run, interleaved per size (one of each per round, --repeats rounds):
a raw loopback TCP socket sending the same bytes (into a buffer touched
beforehand; the same split over N sockets at once; into fresh memory: what
faulting pages in costs a receiver; and into the data plane's own fresh
receive buffer), gpupool push and pull on one lane and on N
(``c.GPUMagics.transfer_streams``; N: ``--streams``, default one per core
up to 4) with the agent's transport encrypted (``curve``: the data plane
then uses AES-256-GCM, or ChaCha20-Poly1305 without AES-NI) and not
(``none``: plain chunks), and ipyparallel's push/pull to one engine (skipped,
with a note, when ipyparallel is not installed). Transfers are timed inside
the notebook kernel around the magic, so pickling, the comm round trips and
the worker's unpickling count. Cold by default: each transfer is the first
of a new value, with no untimed run before it, and the worst round is
reported; ``--warm-up`` times each step right after an untimed run of its
own and keeps the best (how this report measured before).

Memory: for each gpupool transfer the peak resident set (``VmHWM``, reset
through ``/proc/PID/clear_refs``) of the notebook kernel and of the worker,
minus their resident set just before, as a multiple of the payload: the
receiving side should rise by about the payload (its destination) and the
sending side by nearly nothing (no copy of what it sends).

Writes bench/transfer.json, bench/transfer.png and the "Bulk transfers"
section of bench/REPORT.md. Run from the repository root:

    .venv/bin/python bench/transfer_bench.py [--max-mib 1024] [--repeats 5] [--streams N] [--warm-up]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from remoting_bench import ipp_transfer_seconds, raw_socket_seconds, roundtrip, start_kernel, stop_kernel, value_of
from report import write_section

from gpupool import demo_pool
from gpupool.dataplane import allocate, default_cipher
from gpupool.dataplane import streams_for

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024**2
SECTION = "## Bulk transfers"
MODES = ("curve", "none")


def raw_fresh_seconds(nbytes: int, huge: bool = False) -> float:
    """As remoting_bench.raw_socket_seconds, but received into fresh memory
    (an anonymous mapping made inside the timed window, as any receiver of a
    new value must): the wire plus the cost of faulting pages in. ``huge``:
    the mapping is the data plane's own (``gpupool.dataplane.allocate``,
    transparent huge pages), so gpupool against it is the protocol alone."""
    import mmap
    import socket
    import threading
    import time

    server = socket.create_server(("127.0.0.1", 0))
    payload = memoryview(bytearray(nbytes))
    elapsed: list[float] = []

    def receive() -> None:
        conn, _ = server.accept()
        start = time.perf_counter()
        view, got = (allocate(nbytes) if huge else memoryview(mmap.mmap(-1, nbytes))), 0
        while got < nbytes:
            got += conn.recv_into(view[got:], min(nbytes - got, 4 * MIB))
        elapsed.append(time.perf_counter() - start)
        conn.sendall(b"k")
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    with socket.create_connection(server.getsockname()) as conn:
        conn.sendall(payload)
        conn.recv(1)
    thread.join()
    server.close()
    return elapsed[0]


def raw_streams_seconds(nbytes: int, streams: int) -> float:
    """``nbytes`` over ``streams`` loopback TCP connections at once (an equal share each, a thread per
    side of each, into one buffer touched beforehand); seconds until all arrived."""
    import socket
    import threading
    import time

    server = socket.create_server(("127.0.0.1", 0), backlog=streams)
    payload, received = memoryview(bytearray(nbytes)), memoryview(bytearray(nbytes))
    cuts = [nbytes * i // streams for i in range(streams + 1)]

    def receive(conn, lo: int, hi: int) -> None:
        got = lo
        while got < hi:
            got += conn.recv_into(received[got:hi], min(hi - got, 4 * MIB))
        conn.sendall(b"k")
        conn.close()

    conns = [socket.create_connection(server.getsockname()) for _ in range(streams)]
    accepted = [server.accept()[0] for _ in range(streams)]
    readers = [threading.Thread(target=receive, args=(a, cuts[i], cuts[i + 1])) for i, a in enumerate(accepted)]
    for reader in readers:
        reader.start()

    def send(conn, lo: int, hi: int) -> None:
        conn.sendall(payload[lo:hi])
        conn.recv(1)

    start = time.perf_counter()
    writers = [threading.Thread(target=send, args=(c, cuts[i], cuts[i + 1])) for i, c in enumerate(conns)]
    for thread in writers:
        thread.start()
    for thread in writers + readers:
        thread.join()
    elapsed = time.perf_counter() - start
    for conn in conns:
        conn.close()
    server.close()
    return elapsed


def warm_memory(gib: float | None, largest_mib: int) -> tuple[float, float | None]:
    """Touch ``gib`` GiB of fresh memory once, in a process of its own, and
    free it: ``(gib, MiB/s of that first touch)``. On a VM the hypervisor
    backs guest memory the first time the guest touches it (measured here at
    about 0.4 GB/s, against 5-10 GB/s once backed), which a host that has
    been up for a while has done; without this the biggest sizes measure it
    instead of the transfer."""
    if gib is None:
        available = _meminfo_kib("MemAvailable") * 1024
        gib = min(8 * largest_mib / 1024, available / 2 / 1024**3)
    if gib <= 0:
        return 0.0, None
    code = ("import mmap, sys, time\nn = int(float(sys.argv[1]) * 2**30)\nm = mmap.mmap(-1, n)\nv = memoryview(m)\n"
            "t = time.perf_counter()\nv[::4096] = b'\\1' * len(v[::4096])\nprint(n / 2**20 / (time.perf_counter() - t))")
    out = subprocess.run([sys.executable, "-c", code, str(gib)], check=True, capture_output=True, text=True).stdout
    return round(gib, 1), round(float(out))


#: Where a VM's guest kernel says how it hands free memory back to its host
#: (virtio-balloon free page reporting; absent on bare metal).
PAGE_REPORTING = Path("/sys/module/page_reporting/parameters")


def page_reporting() -> dict[str, int] | None:
    """The guest's free page reporting settings and counter, or None where
    there is none: ``page_reporting_order`` (free blocks of 2**order pages
    and up are handed back to the host, whose next touch then faults at the
    hypervisor's pace), ``min_free_ms`` (how long a block stays free first,
    where the kernel has it) and ``reported_kib`` (KiB handed back since
    boot)."""
    values = {}
    for name in ("page_reporting_order", "min_free_ms", "reported_kib"):
        try:
            values[name] = int((PAGE_REPORTING / name).read_text())
        except (OSError, ValueError):
            continue
    return values or None


def _reported_mib() -> float:
    """MiB of free memory this guest has handed back to its host since boot (0 where it does not)."""
    return (page_reporting() or {}).get("reported_kib", 0) / 1024


def _meminfo_kib(field: str) -> int:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) for line in meminfo if line.startswith(field + ":"))


def reset_peak(pid: int) -> int:
    """Reset ``pid``'s peak RSS to its current RSS (Linux clear_refs 5); returns that RSS in bytes."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_kib(pid, "VmRSS") * 1024


def peak(pid: int) -> int:
    return _status_kib(pid, "VmHWM") * 1024


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


class Pooled:
    """A gpupool kernel attached to a lease on a pool of its own whose agent uses ``mode``."""

    def __init__(self, root: Path, mode: str) -> None:
        self.service = demo_pool.start_service(root / "service")
        self.agent = demo_pool.start_agent(root / "agent", self.service, simulate="1xA100-80GB",
                                           extra_args=[f"--transport-encryption={mode}"])
        subprocess.run([*demo_pool.GPUPOOL, "kernelspec", "install", f"--prefix={root / 'prefix'}",
                        f"--url={self.service.url}", f"--token-file={self.service.state_dir / 'user_token'}"],
                       check=True, capture_output=True)
        self.km, self.kc = start_kernel("gpupool", [str(root / "prefix" / "share" / "jupyter" / "kernels")],
                                        cwd=str(root))
        roundtrip(self.kc, "%gpu acquire 0.5")
        roundtrip(self.kc, "import os\nbench_worker_pid = os.getpid()")
        roundtrip(self.kc, "%gpu pull bench_worker_pid")
        self.worker_pid = int(value_of(self.kc, "bench_worker_pid"))
        self.kernel_pid = self.km.provisioner.process.pid
        # Cold is a new value's first transfer, not the process's: what a first push and pull import
        # (and the lanes' code) is loaded before anything is timed.
        self.transfer(2 * 16 * MIB, 2)

    def transfer(self, nbytes: int, streams: int) -> dict:
        """Push then pull ``nbytes`` of uint8 on at most ``streams`` lanes: seconds and peak RSS rises (bytes)."""
        kc = self.kc
        roundtrip(kc, f"%%local\nget_ipython().run_line_magic('config', 'GPUMagics.transfer_streams = {streams}')")
        roundtrip(kc, f"%%local\nimport numpy as np, time\nbench_a = np.ones({nbytes}, dtype=np.uint8)")
        roundtrip(kc, "bench_a = None")  # the worker's copy of the last round goes before the baseline
        base_k, base_w = reset_peak(self.kernel_pid), reset_peak(self.worker_pid)
        roundtrip(kc, "%%local\n_t = time.perf_counter()\nget_ipython().run_line_magic('gpu', 'push bench_a')\n"
                      "bench_push_s = time.perf_counter() - _t\ndel bench_a")
        push = {"s": value_of(kc, "bench_push_s"), "send_rise": peak(self.kernel_pid) - base_k,
                "recv_rise": peak(self.worker_pid) - base_w}
        roundtrip(kc, f"import numpy as np\nbench_b = np.ones({nbytes}, dtype=np.uint8)\ndel bench_a")
        base_k, base_w = reset_peak(self.kernel_pid), reset_peak(self.worker_pid)
        roundtrip(kc, "%%local\n_t = time.perf_counter()\nget_ipython().run_line_magic('gpu', 'pull bench_b')\n"
                      f"bench_pull_s = time.perf_counter() - _t\nassert bench_b.nbytes == {nbytes}\ndel bench_b")
        pull = {"s": value_of(kc, "bench_pull_s"), "send_rise": peak(self.worker_pid) - base_w,
                "recv_rise": peak(self.kernel_pid) - base_k}
        roundtrip(kc, "del bench_b")
        return {"push": push, "pull": pull}

    def stop(self) -> None:
        stop_kernel(self.km, self.kc)
        self.agent.stop()
        self.service.stop()


def ipp_engine():
    """One ipyparallel engine's view and its cluster, or ``(None, why)``."""
    try:
        import ipyparallel as ipp
    except ImportError:
        return None, "ipyparallel is not installed in this environment: its columns are left out"
    cluster = ipp.Cluster(n=1, log_level=40)
    rc = cluster.start_and_connect_sync()
    rc.wait_for_engines(1, timeout=120)
    return (cluster, rc), None


def ways(streams: int) -> list[tuple[str, int]]:
    """The gpupool columns: ``(mode, lanes)``, one lane and ``streams`` lanes of each mode."""
    return [(mode, lanes) for mode in MODES for lanes in sorted({1, streams})]


def column(mode: str, lanes: int) -> str:
    return mode if lanes == 1 else f"{mode}_x{lanes}"


def measure(pools: dict[str, Pooled], engine, sizes: list[int], repeats: int, streams: int, warm_up: bool
            ) -> list[dict]:
    rows = []
    pick = min if warm_up else max  # of the rounds' seconds: the best after a warm-up, else the worst
    for mib in sizes:
        nbytes = mib * MIB
        steps = {"raw": lambda: raw_socket_seconds(nbytes), "fresh": lambda: raw_fresh_seconds(nbytes),
                 "fresh_thp": lambda: raw_fresh_seconds(nbytes, huge=True),
                 **{column(mode, lanes): (lambda pooled=pools[mode], lanes=lanes: pooled.transfer(nbytes, lanes))
                    for mode, lanes in ways(streams)}}
        if streams > 1:
            steps["raw_n"] = lambda: raw_streams_seconds(nbytes, streams)
        if engine is not None:
            steps["ipp"] = lambda: ipp_transfer_seconds(engine[1][0], nbytes)
        runs: dict[str, list] = {name: [] for name in steps}
        returned = _reported_mib()
        for _ in range(repeats):  # interleaved: one of each per round
            for name, step in steps.items():
                # The untimed run of --warm-up: on a VM that hands freed memory back to its host (see
                # page_reporting), the first receiver after others freed their buffers lands on memory the
                # host must back again, and at 1 GiB that costs it 4-5x. Cold (the default), that is what
                # a new value meets, and the worst round shows it.
                if warm_up:
                    step()
                runs[name].append(step())
        row: dict = {"mib": mib, "raw_mib_s": mib / pick(runs["raw"]), "fresh_mib_s": mib / pick(runs["fresh"]),
                     "fresh_thp_mib_s": mib / pick(runs["fresh_thp"]), "load": os.getloadavg()[0],
                     "returned_mib": round(_reported_mib() - returned)}
        if "raw_n" in runs:
            row["raw_n_mib_s"] = mib / pick(runs["raw_n"])
        for mode, lanes in ways(streams):
            name = column(mode, lanes)
            for way in ("push", "pull"):
                done = runs[name]
                row[f"{name}_{way}_mib_s"] = mib / pick(r[way]["s"] for r in done)
                # Memory: the worst round (largest rise) as a multiple of the payload.
                row[f"{name}_{way}_recv_x"] = max(r[way]["recv_rise"] for r in done) / nbytes
                row[f"{name}_{way}_send_x"] = max(r[way]["send_rise"] for r in done) / nbytes
        if engine is not None:
            row["ipp_push_mib_s"] = mib / pick(p for p, _ in runs["ipp"])
            row["ipp_pull_mib_s"] = mib / pick(p for _, p in runs["ipp"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, streams = results["rows"], results.get("streams", 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    mib = [r["mib"] for r in rows]
    series = [("raw_mib_s", "raw loopback TCP", "k-"), ("raw_n_mib_s", f"raw, {streams} TCP streams", "k--"),
              ("fresh_mib_s", "raw TCP into fresh memory", "k:"),
              ("fresh_thp_mib_s", "raw TCP into a fresh THP buffer", "k-.")]
    for mode, lanes in ways(streams):
        name, label = column(mode, lanes), f"{mode}" + (f", {lanes} lanes" if lanes > 1 else "")
        series += [(f"{name}_push_mib_s", f"push ({label})", "o-"), (f"{name}_pull_mib_s", f"pull ({label})", "s--")]
    series += [("ipp_push_mib_s", "ipyparallel push", "x:"), ("ipp_pull_mib_s", "ipyparallel pull", "+:")]
    for key, label, style in series:
        if key in rows[0]:
            ax.plot(mib, [r[key] for r in rows], style, label=label)
    ax.set(xscale="log", xlabel="payload (MiB, log scale)", ylabel="MiB/s",
           title="gpupool bulk transfers (data plane) vs the wire" + ("" if results.get("warm_up") else ", cold"))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _reporting_words(settings: dict[str, int] | None) -> str:
    """What the report says of the guest's free page reporting (nothing on bare metal)."""
    if not settings or "page_reporting_order" not in settings:
        return ""
    order = settings["page_reporting_order"]
    wait = f", after {settings['min_free_ms']} ms free" if "min_free_ms" in settings else ""
    return (f"This VM hands free memory back to its host (virtio-balloon free page reporting: free blocks of "
            f"{4 * 2**order // 1024} MiB and up{wait}); the host backs such memory again on its next first touch, at "
            "its own pace, so a fresh receive buffer can be slow for reasons outside the process (returned to host "
            "= MiB handed back while that size was measured). ")


def report(results: dict) -> str:
    rows, streams, warm = results["rows"], results.get("streams", 1), results.get("warm_up", True)
    big = [r for r in rows if r["mib"] >= 64]
    has_ipp = "ipp_push_mib_s" in rows[0]
    names = [column(mode, lanes) for mode, lanes in ways(streams)]
    how = (f"best of {results['repeats']} interleaved rounds per size, each step timed right after an untimed run "
           "of its own" if warm else
           f"cold: {results['repeats']} interleaved rounds per size, each transfer the first of a new value with no "
           "untimed run before it, the worst round shown")
    lines = [SECTION, "",
             f"`{results['command']}` on {results['machine']}; transfers of one NumPy uint8 array, timed inside "
             "the notebook kernel around `%gpu push` / `%gpu pull` (pickling, comm round trips and unpickling "
             f"included), {how}"
             + (f" ({results['big_repeats']} at 1024 MiB)" if results.get("big_repeats") else "")
             + "; `curve` = the agent's transport "
             f"encrypted, so the data plane uses {results['cipher']}; `none` = plain chunks; ×{streams} = the "
             f"transfer on {streams} lanes (`c.GPUMagics.transfer_streams`; a lane per 16 MiB at most). Raw = one "
             "loopback TCP socket sending the same bytes in the same run, into a buffer touched beforehand (as "
             f"bench/remoting_bench.py measures it); raw ×{streams} = the same split over {streams} sockets at once; "
             "fresh = one socket into memory mapped inside the timed window, as "
             "a receiver of a new value must (the difference is the cost of faulting 4 KiB pages in on this VM). "
             f"Percentages are of raw (of raw ×{streams} for the lanes' columns). Load = the machine's 1-minute load "
             "average after the size (it is shared). "
             + "fresh THP = the same into the data plane's own receive buffer (transparent huge pages, "
             "`gpupool.dataplane.allocate`): gpupool against it is the protocol and cipher alone. "
             + (f"Before measuring, {results['warmed_gib']} GiB of memory was touched once and freed (first touch "
                f"{results['first_touch_mib_s']} MiB/s). " if results.get("warmed_gib") else "")
             + _reporting_words(results.get("page_reporting"))
             + (results.get("ipp_note") or ""), ""]
    heads = [f"{way} {name.replace('_x', ' ×')}" for name in names for way in ("push", "pull")]
    lines += ["| MiB | raw | " + (f"raw ×{streams} | " if streams > 1 else "") + "fresh | fresh THP | "
              + " | ".join(heads) + " |" + (" ipp push | ipp pull |" if has_ipp else "") + " load | returned to host |",
              "|" + " --- |" * (4 + (streams > 1) + len(heads) + 2 * has_ipp + 2)]
    for r in rows:
        def cell(name: str, way: str) -> str:
            base = r["raw_n_mib_s"] if "_x" in name else r["raw_mib_s"]
            return f"{r[f'{name}_{way}_mib_s']:.0f} ({r[f'{name}_{way}_mib_s'] / base:.0%})"

        cells = [cell(name, way) for name in names for way in ("push", "pull")]
        ipp = [f"{r['ipp_push_mib_s']:.0f}", f"{r['ipp_pull_mib_s']:.0f}"] if has_ipp else []
        raw_n = [f"{r['raw_n_mib_s']:.0f}"] if streams > 1 else []
        lines.append(f"| {r['mib']} | {r['raw_mib_s']:.0f} | " + " | ".join(raw_n + [f"{r['fresh_mib_s']:.0f}",
                     f"{r.get('fresh_thp_mib_s', 0):.0f}"] + cells + ipp) + f" | {r['load']:.1f} | "
                     f"{r.get('returned_mib', 0)} MiB |")
    lines += ["", "Peak RSS rise (VmHWM after minus RSS before, worst round), as a multiple of the payload "
              "(receiving side / sending side):", "",
              "| MiB | " + " | ".join(heads) + " |", "|" + " --- |" * (1 + len(heads))]
    for r in rows:
        cells = [f"{r[f'{n}_{w}_recv_x']:.2f} / {r[f'{n}_{w}_send_x']:.2f}" for n in names for w in ("push", "pull")]
        lines.append(f"| {r['mib']} | " + " | ".join(cells) + " |")
    if big:
        lines += ["", "Against issue 27's targets at ≥ 64 MiB (worst of push and pull, worst size):", ""]
        for name in names:
            base = "raw_n_mib_s" if "_x" in name else "raw_mib_s"
            share = min(min(r[f"{name}_push_mib_s"], r[f"{name}_pull_mib_s"]) / r[base] for r in big)
            goal = 0.7 if name.startswith("curve") else 0.9
            what = ("encrypted" if name.startswith("curve") else "unencrypted") + (
                f" on {streams} lanes, of raw ×{streams}" if "_x" in name else ", of raw TCP")
            lines.append(f"- {what} ≥ {goal:.0%}: {share:.0%}: {'met' if share >= goal else 'NOT met'}")
        fresh = min(min(r[f"{n}_push_mib_s"], r[f"{n}_pull_mib_s"]) / r["fresh_thp_mib_s"] for r in big for n in names)
        recv = max(r[f"{n}_{w}_recv_x"] for r in big for n in names for w in ("push", "pull"))
        send = max(r[f"{n}_{w}_send_x"] for r in big for n in names for w in ("push", "pull"))
        lines += [f"- for comparison, the worst column of raw TCP into the same fresh receive buffer (fresh THP): "
                  f"{fresh:.0%}",
                  f"- receiving side's peak RSS rise ≤ 1.1x payload: {recv:.2f}x: {'met' if recv <= 1.1 else 'NOT met'}",
                  f"- sending side's peak RSS rise ≤ 0.1x payload: {send:.2f}x: {'met' if send <= 0.1 else 'NOT met'}"]
    lines += ["", "![bulk transfers](transfer.png)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mib", type=int, default=1024, help="largest array in MiB (default 1024)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per size (default 5)")
    parser.add_argument("--streams", type=int, default=streams_for(0),
                        help=f"lanes of the many-lane columns (default {streams_for(0)}: one per core, at most 4)")
    parser.add_argument("--warm-up", action="store_true",
                        help="time each step right after an untimed run of its own and keep the best round "
                             "(default: cold, the worst round)")
    parser.add_argument("--big-repeats", type=int, default=1, help="rounds at 1024 MiB (default 1: it is slow)")
    parser.add_argument("--warm-gib", type=float, default=None,
                        help="GiB of memory to touch once before measuring (default: 8 x the largest array, at most "
                             "half of what is available); 0 for none")
    parser.add_argument("--out", type=Path, default=ROOT / "bench", help="where the JSON and PNG go")
    parser.add_argument("--no-report", action="store_true", help="do not rewrite bench/REPORT.md")
    parser.add_argument("--report-only", action="store_true", help="rewrite the section and PNG from OUT/transfer.json")
    args = parser.parse_args(argv)
    if args.report_only:
        results = json.loads((args.out / "transfer.json").read_text())
    else:
        results = run(args, argv)
    plot(results, args.out / "transfer.png")
    section = report(results)
    print(section)
    if not args.no_report:
        write_section(SECTION, section)
    return 0


def run(args, argv) -> dict:
    sizes = [s for s in (1, 16, 64, 256, 1024) if s <= args.max_mib]
    results: dict = {"machine": f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}", "cipher": default_cipher(),
                     "repeats": args.repeats, "big_repeats": args.big_repeats, "streams": args.streams,
                     "warm_up": args.warm_up,
                     "command": " ".join(["bench/transfer_bench.py", *(argv if argv is not None else sys.argv[1:])])}
    results["warmed_gib"], results["first_touch_mib_s"] = warm_memory(args.warm_gib, max(sizes))
    results["page_reporting"] = page_reporting()
    with tempfile.TemporaryDirectory(prefix="gpupool-transfer-bench-") as tmp:
        pools: dict[str, Pooled] = {}
        engine, results["ipp_note"] = ipp_engine()
        try:
            for mode in MODES:
                pools[mode] = Pooled(Path(tmp) / mode, mode)
            rows = measure(pools, engine, [s for s in sizes if s < 1024], args.repeats, args.streams, args.warm_up)
            if 1024 in sizes:
                rows += measure(pools, engine, [1024], args.big_repeats, args.streams, args.warm_up)
            results["rows"] = rows
        finally:
            for pooled in pools.values():
                pooled.stop()
            if engine is not None:
                engine[1].close()
                engine[0].stop_cluster_sync()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transfer.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(main())
