"""Another user's request latency while one user floods the service.

    .venv/bin/python bench/flood_bench.py [--calls 400] [--flooders 8] [--queued 1000] [--no-report]

A real ``gpupool service`` (SQLite, its default settings but for the per-user
caps, raised so that one user may queue ``--queued`` requests) with one
registered node of two GPUs whose agent never answers, so leases placed there
stay ``starting`` and everything else queues. User ``ann`` holds one queued
request and makes ``--calls`` calls in turn, each timed alone from her side
(a new connection per call, as ``gpupool.api.ServiceClient`` does):
``GET /health``, ``GET /leases``, ``GET /leases/{id}``, ``POST
/leases/{id}/heartbeat``, ``GET /pool``, ``GET /quota``.

- ``idle``: nobody else calls;
- ``flood``: user ``flood``, in ``--flooders`` processes of their own (so they
  do not share ann's interpreter lock), posts lease requests with ``wait``
  as fast as the service answers until ``--queued`` are queued, then keeps
  listing its own leases (500 of them, each with its place in line) and
  asking for more (429 at its cap). Ann's calls start when the flood does
  and go on while it runs.

Prints p50/p99 per phase and writes the "Flood" section of bench/REPORT.md
unless ``--no-report``. Target: flood p99 within 2x idle p99.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from report import write_section  # noqa: E402  (bench/ is on the path when a bench runs)

ROOT = Path(__file__).resolve().parent.parent
GiB = 1024**3


def call(url: str, token: str | None, method: str, path: str, body=None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def flooder(url: str, token: str, queued: int, stop, counter) -> None:
    """One flooding process: lease requests until ``queued`` are queued in all, then listings and more requests."""
    while not stop.is_set():
        if counter.value < queued:
            status, _ = call(url, token, "POST", "/api/v1/leases", {"fraction": 1.0, "wait": 3000})
            if status == 201:
                with counter.get_lock():
                    counter.value += 1
        else:
            call(url, token, "GET", "/api/v1/leases")
            call(url, token, "POST", "/api/v1/leases", {"fraction": 1.0, "wait": 3000})


def victim(url: str, token: str, lease_id: str, calls: int) -> list[float]:
    """Seconds each of ann's ``calls`` took; fails on any answer but the expected one."""
    ops = [("GET", "/health", None), ("GET", "/api/v1/leases", None), ("GET", f"/api/v1/leases/{lease_id}", None),
           ("POST", f"/api/v1/leases/{lease_id}/heartbeat", {}), ("GET", "/api/v1/pool", None),
           ("GET", "/api/v1/quota", None)]
    took = []
    for i in range(calls):
        method, path, body = ops[i % len(ops)]
        start = time.perf_counter()
        status, reply = call(url, token, method, path, body)
        took.append(time.perf_counter() - start)
        if status != 200:
            raise SystemExit(f"ann's {method} {path} answered {status}: {reply[:200]!r}")
    return took


def quantiles(samples: list[float]) -> dict[str, float]:
    ms = sorted(1000 * s for s in samples)
    return {"n": len(ms), "p50": statistics.median(ms), "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
            "max": ms[-1]}


def silent_node(url: str, agent_token: str) -> socket.socket:
    """Register node-flood (two A100s) whose agent address accepts and never answers."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1024)
    body = {"name": "node-flood", "url": "http://127.0.0.1:%d" % silent.getsockname()[1], "inventory": "simulated",
            "gpus": [{"uuid": f"GPU-flood-{i}", "name": "NVIDIA A100-SXM4-80GB", "index": i,
                      "memory_total": 80 * GiB} for i in range(2)], "workers": []}
    status, reply = call(url, agent_token, "POST", "/api/v1/nodes", body)
    assert status == 200, reply
    return silent


def run(args) -> dict:
    from gpupool import demo_pool

    state = Path(tempfile.mkdtemp(prefix="flood-bench-")) / "service"
    state.mkdir(parents=True)
    tokens = {"ann": "ann-" + os.urandom(8).hex(), "flood": "flood-" + os.urandom(8).hex()}
    config = state / "gpupool_config.py"
    config.write_text(f"c.GPUPool.api_tokens = {({t: u for u, t in tokens.items()})!r}\n"
                      f"c.PoolQuotas.max_queued_per_user = {args.queued}\n"
                      "c.PoolNodes.node_ttl = 3600\nc.PoolNodes.worker_start_timeout = '1h'\n")
    service = demo_pool.start_service(state, config_file=config)
    try:
        url = service.url
        silent = silent_node(url, service.agent_token_file.read_text().strip())
        for _ in range(2):  # the flooder holds both GPUs: from now on everything queues
            call(url, tokens["flood"], "POST", "/api/v1/leases", {"fraction": 1.0})
        status, reply = call(url, tokens["ann"], "POST", "/api/v1/leases", {"fraction": 1.0, "wait": 3000})
        assert status == 201, reply
        lease_id = json.loads(reply)["id"]
        victim(url, tokens["ann"], lease_id, 30)  # warm up
        idle = victim(url, tokens["ann"], lease_id, args.calls)
        stop = multiprocessing.Event()
        counter = multiprocessing.Value("i", 0)
        procs = [multiprocessing.Process(target=flooder, args=(url, tokens["flood"], args.queued, stop, counter))
                 for _ in range(args.flooders)]
        for proc in procs:
            proc.start()
        started = time.monotonic()
        flood = victim(url, tokens["ann"], lease_id, args.calls)
        while counter.value < args.queued and time.monotonic() - started < 600:  # the flood must have been a flood
            flood += victim(url, tokens["ann"], lease_id, 60)
        queued_at_end = counter.value
        flood_s = time.monotonic() - started
        stop.set()
        for proc in procs:
            proc.join(150)
        status, reply = call(url, tokens["ann"], "GET", f"/api/v1/leases/{lease_id}")
        place = json.loads(reply)["queue_position"]
        silent.close()
    finally:
        service.stop()
    return {"idle": quantiles(idle), "flood": quantiles(flood), "queued_by_flooder": queued_at_end,
            "flood_seconds": round(flood_s, 1), "ann_queue_position": place, "flooders": args.flooders,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
                       f"Python {platform.python_version()}"}


def report(result: dict, command: str) -> str:
    idle, flood = result["idle"], result["flood"]
    ratio = flood["p99"] / idle["p99"]
    lines = ["## Flood", "",
             f"`{command}` ({result['machine']}). Another user's calls (`GET /health`, `GET /leases`, "
             "`GET /leases/{id}`, `POST .../heartbeat`, `GET /pool`, `GET /quota`, in turn, each on a new "
             "connection) with nobody else calling, and while one user, in "
             f"{result['flooders']} processes, posts lease requests until {result['queued_by_flooder']} of "
             f"theirs are queued and then lists its 500 newest leases and asks for more "
             f"({result['flood_seconds']} s). Store work runs on threads of its own, taking turns between "
             "users (`hub_plugin/storework.py`).", "",
             "| phase | calls | p50 ms | p99 ms | max ms |", "| --- | --- | --- | --- | --- |"]
    for name in ("idle", "flood"):
        q = result[name]
        lines.append(f"| {name} | {q['n']} | {q['p50']:.1f} | {q['p99']:.1f} | {q['max']:.1f} |")
    verdict = "within" if ratio <= 2 else "above"
    lines += ["", f"Flood p99 / idle p99 = {ratio:.2f} ({verdict} the 2x target). The other user's queued "
                  f"request stayed first in line (place {result['ann_queue_position']}): she never used the "
                  "pool, the flooder holds it.", "",
              "What bounds it: the flood no longer queues ahead of her calls (each user runs on one store "
              "reader at a time and takes turns on the writer), and `/health` never waits for SQL; but the "
              "store threads and the event loop share one interpreter lock, and here the service, the "
              f"{result['flooders']} flooding processes and her client share {os.cpu_count()} CPUs, so the "
              "flood's own work (each listing builds 500 leases' JSON in Python) slows each of "
              "her calls by a few slices of that lock. A per-user request rate, or the listing moved out of "
              "the service process, would be the next step where the 2x target matters. Before this change "
              "(issue 12's probe) the same flood made that user's listing take 34.5 s and `/health` time out "
              "for everyone.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400, help="calls of the other user per phase (at least)")
    parser.add_argument("--flooders", type=int, default=8, help="processes of the flooding user")
    parser.add_argument("--queued", type=int, default=1000, help="requests the flooding user queues")
    parser.add_argument("--no-report", action="store_true", help="print only; leave bench/REPORT.md alone")
    args = parser.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=1))
    text = report(result, " ".join(["bench/flood_bench.py", *(argv if argv is not None else sys.argv[1:])]))
    print(text)
    if not args.no_report:
        write_section("## Flood", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
