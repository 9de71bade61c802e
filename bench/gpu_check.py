"""The GPU check: proves gpupool's GPU side on a host with an NVIDIA GPU.

    make gpu-check                       # or: python bench/gpu_check.py [--out DIR]

Writes ``gpu-check.json`` and ``gpu-check.md`` to ``--out`` (default:
``$OUT`` when set, else a new temporary directory; the path is printed).
Steps, each recorded with its result, seconds and any error:

1. NVML inventory as the agent sees it (GPUs, MIG instances, versions,
   readings, health, per-process usage).
2. Whether a CUDA MPS control daemon runs, and which enforcement mode the
   agent picks.
3. A pool on this host (``gpupool service`` + ``gpupool agent`` in NVML mode)
   with two 0.5 leases running a PyTorch matmul loop at the same time.
4. The memory cap of a 0.25 slice: an allocation beyond it must fail in that
   worker while the same allocation succeeds in its 0.5 neighbour; under MPS
   also whether the worker could widen its own limit from a child process.
5. The same training step timed in a slice and in a bare process: overhead in %.
6. Park in place with each checkpointer the host has (``framework``, and
   ``cuda-checkpoint`` when it is on PATH): a 2 GiB PyTorch model parks, NVML
   shows its memory freed, it resumes with identical outputs; park and resume
   GiB/s beside pinned host-to-device bandwidth (:mod:`gpu_check_park`).

Without a GPU (NVML does not start, or finds none) it writes a report saying
"no GPU found" with NVML's error and exits 0 within seconds. Steps that need
packages this host lacks (PyTorch; jupyter_client and the service's packages)
are reported as skipped with the import error. Exit code: 0 when every step
that ran passed, 1 otherwise. The whole run is bounded to ``--budget``
seconds (default 420, under the 8 minutes the issue allows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

GiB = 1024**3
MiB = 1024**2

# One training step of a small MLP, timed; prints "STEP <seconds per step>".
TRAIN = """
import time, torch
torch.manual_seed(0)
dev = torch.device("cuda")
model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(512, 4096, device=dev)
def step():
    opt.zero_grad(); loss = model(x).square().mean(); loss.backward(); opt.step()
for _ in range(10): step()
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(100): step()
torch.cuda.synchronize(); print("STEP", (time.perf_counter() - t) / 100, flush=True)
"""

MATMUL = """
import time, torch
a = torch.randn(4096, 4096, device="cuda"); b = torch.randn(4096, 4096, device="cuda")
torch.cuda.synchronize(); t = time.perf_counter(); n = 0
while time.perf_counter() - t < {seconds}:
    for _ in range(10): c = a @ b
    torch.cuda.synchronize(); n += 10
print("MATMUL", n / (time.perf_counter() - t), flush=True)
"""

ALLOCATE = """
import torch
try:
    x = torch.empty({nbytes} // 4, dtype=torch.float32, device="cuda"); torch.cuda.synchronize()
    print("ALLOC ok", flush=True)
except Exception as exc:  # torch.cuda.OutOfMemoryError, or the MPS limit's CUDA error
    print("ALLOC failed", type(exc).__name__, str(exc).splitlines()[0][:200], flush=True)
"""

# Run in the 0.25 worker: a child process that raises its own MPS limit to the
# whole GPU before CUDA starts, then allocates beyond the slice.
WIDEN = """
import os, subprocess, sys
env = dict(os.environ, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=1000000M", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="100",
           GPUPOOL_MEMORY_LIMIT="")
code = {code!r}
out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
print("WIDEN", (out.stdout.strip() or out.stderr.strip()[-200:]).replace(chr(10), " "), flush=True)
"""


class Report:
    """The steps so far, written as JSON and Markdown after each one."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                     "host": os.uname().nodename, "python": sys.version.split()[0],
                                     "gpu_found": None, "steps": []}

    def step(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; record ``{"name", "status", "seconds", "result"|"error"}``.
        ``fn`` returns the result or raises; ``Skip`` marks it skipped."""
        started = time.monotonic()
        entry: dict[str, Any] = {"name": name}
        try:
            entry["result"] = fn()
            entry["status"] = "passed"
        except Skip as exc:
            entry["status"], entry["error"] = "skipped", str(exc)
        except Exception as exc:  # noqa: BLE001 - a check reports every failure and goes on
            entry["status"], entry["error"] = "failed", f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc(limit=5)
        entry["seconds"] = round(time.monotonic() - started, 2)
        self.data["steps"].append(entry)
        print(f"[gpu-check] {name}: {entry['status']}" + (f" ({entry.get('error')})" if "error" in entry else ""),
              flush=True)
        self.write()
        return entry.get("result")

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu-check.json").write_text(json.dumps(self.data, indent=2, default=str))
        lines = ["# gpupool GPU check", "", f"- host: {self.data['host']}, started {self.data['started']}",
                 f"- GPU found: {self.data['gpu_found']}"]
        if self.data.get("no_gpu_reason"):
            lines.append(f"- no GPU found: {self.data['no_gpu_reason']}")
        lines += ["", "| step | status | seconds | result / error |", "| --- | --- | --- | --- |"]
        for entry in self.data["steps"]:
            detail = entry.get("error") or json.dumps(entry.get("result"), default=str)
            detail = detail.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {entry['name']} | {entry['status']} | {entry['seconds']} | {detail[:600]} |")
        (self.out / "gpu-check.md").write_text("\n".join(lines) + "\n")


class Skip(Exception):
    """A step that cannot run on this host (a package is missing)."""


def nvml_inventory() -> tuple[Any, dict[str, Any]]:
    """The agent's inventory and what it sees; raises InventoryError without a GPU."""
    from gpupool.node.inventory.nvml.inventory import NVMLInventory

    inventory = NVMLInventory()
    seen = {"gpus": [g.to_json() for g in inventory.discover()], "versions": inventory.versions(),
            "readings": inventory.metrics(), "health": inventory.health(),
            "processes": [p.__dict__ for p in inventory.process_usage()]}
    return inventory, seen


def python_run(code: str, env: dict[str, str], timeout: float = 180) -> str:
    """Run ``code`` in a fresh interpreter with ``env``; its stdout (raises on failure)."""
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[-800:]}")
    return done.stdout


def value(text: str, tag: str) -> str:
    """The rest of the first line of ``text`` that starts with ``tag``."""
    for line in text.splitlines():
        if line.startswith(tag):
            return line[len(tag):].strip()
    raise RuntimeError(f"no {tag} line in the output: {text[-400:]!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="report directory (default: $OUT, else a new temporary directory)")
    parser.add_argument("--budget", type=float, default=420, help="seconds for the whole check (default 420)")
    args = parser.parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpupool-gpu-check-"))
    report = Report(out)
    deadline = time.monotonic() + args.budget

    try:
        import gpupool.node.inventory.nvml.inventory  # noqa: F401
    except ImportError as exc:
        report.data.update(gpu_found=False, no_gpu_reason=f"gpupool cannot be imported here: {exc}")
        report.write()
        print(f"[gpu-check] no GPU check possible: {exc}; report in {out}")
        return 0
    holder: dict[str, Any] = {}

    def inventory_step() -> dict[str, Any]:
        from gpupool.node.inventory import InventoryError

        try:
            holder["inventory"], seen = nvml_inventory()
        except InventoryError as exc:
            raise Skip(f"no GPU found: {exc.message}") from None
        return seen

    inventory_step_result = report.step("NVML inventory", inventory_step)
    if "inventory" not in holder:
        error = report.data["steps"][-1].get("error", "")
        report.data.update(gpu_found=False, no_gpu_reason=error.removeprefix("no GPU found: "))
        report.write()
        print(f"[gpu-check] no GPU found: {report.data['no_gpu_reason']}")
        print(f"[gpu-check] report: {out / 'gpu-check.md'} and {out / 'gpu-check.json'}")
        return 0
    report.data["gpu_found"] = True
    inventory = holder["inventory"]
    gpus = inventory_step_result["gpus"]
    first = gpus[0]

    from gpupool.node.enforcement import mps_daemon_running, resolve

    report.step("MPS and enforcement", lambda: {
        "mps_daemon_running": mps_daemon_running(),
        "enforcement_mode": resolve("auto", "nvml", [g["uuid"] for g in gpus]).name})

    def need_torch() -> None:
        try:
            python_run("import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'", dict(os.environ), 60)
        except Exception as exc:
            raise Skip(f"PyTorch with CUDA is not usable here: {exc}") from None

    torch_ok = report.step("PyTorch sees the GPU", need_torch) is None and report.data["steps"][-1]["status"] == "passed"

    def bare_step() -> float:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": first["uuid"]}
        return float(value(python_run(TRAIN, env), "STEP"))

    bare = report.step("training step, bare process (s/step)", bare_step) if torch_ok else None

    def pool_steps() -> None:
        try:
            import jupyter_client  # noqa: F401

            from gpupool.api import ServiceClient  # noqa: F401
            from gpupool.demo_pool import start_agent, start_service  # noqa: F401
            import sqlalchemy  # noqa: F401
        except ImportError as exc:
            raise Skip(f"the pool's packages are not installed here ({exc}); pip install -e '.[all]'") from None

    report.step("pool packages", pool_steps)
    if not torch_ok or report.data["steps"][-1]["status"] != "passed":
        inventory.close()
        return finish(report, out)

    from gpupool.demo_pool import start_agent, start_service
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # tests/support/workercell.py
    from workercell import run_worker_cell
    from gpupool.wire.leases import LeaseRequest

    state = Path(tempfile.mkdtemp(prefix="gpupool-gpu-check-state-"))
    service = agent = None
    leases: list[Any] = []
    try:
        service = report.step("start service", lambda: start_service(state / "service"))
        if service is None:
            return finish(report, out)
        agent = report.step("start agent (NVML)", lambda: start_agent(state / "agent", service, simulate=None,
                                                                       timeout=60))
        if agent is None:
            return finish(report, out)
        client = service.client()
        report.step("pool as the service sees it", lambda: client.pool()["nodes"])

        def acquire(fraction: float) -> Any:
            lease = client.create_lease(LeaseRequest(fraction=fraction))
            leases.append(lease)
            while lease.state.value in ("queued", "starting") and time.monotonic() < deadline:
                lease = client.get_lease(lease.id, wait=10, state=lease.state.value)
            if lease.state.value != "active":
                raise RuntimeError(f"lease {lease.id} is {lease.state.value}: {lease.reason}")
            return lease

        halves = report.step("two 0.5 leases", lambda: [acquire(0.5), acquire(0.5)])
        if halves:
            async def both() -> list[float]:
                cells = [run_worker_cell(lease.connection, MATMUL.format(seconds=15), 120) for lease in halves]
                return [float(value(text, "MATMUL")) for text in await asyncio.gather(*cells)]

            report.step("matmul loop in both 0.5 leases at once (matmuls/s each)", lambda: asyncio.run(both()))
            if bare is not None:
                def slice_time() -> dict[str, float]:
                    seconds = float(value(asyncio.run(run_worker_cell(halves[0].connection, TRAIN, 180)), "STEP"))
                    return {"slice_s_per_step": seconds, "bare_s_per_step": bare,
                            "overhead_percent": round(100 * (seconds - bare) / bare, 2)}

                report.step("training step in a 0.5 slice vs bare: overhead", slice_time)
            for lease in halves:
                client.release(lease.id)
        quarter = report.step("a 0.25 lease next to a 0.5 lease", lambda: [acquire(0.25), acquire(0.5)])
        if quarter:
            small, neighbour = quarter
            beyond = small.memory + 2 * GiB

            def cap() -> dict[str, Any]:
                mine = value(asyncio.run(run_worker_cell(small.connection, ALLOCATE.format(nbytes=beyond), 120)), "ALLOC")
                theirs = value(asyncio.run(run_worker_cell(neighbour.connection, ALLOCATE.format(nbytes=beyond), 120)),
                               "ALLOC")
                result = {"slice_memory": small.memory, "allocation": beyond, "in_0.25_slice": mine,
                          "in_0.5_neighbour": theirs}
                if not mine.startswith("failed") or not theirs.startswith("ok"):
                    raise AssertionError(f"memory cap not enforced as expected: {result}")
                return result

            report.step("memory cap of the 0.25 slice", cap)
            report.step("widening the limit from a child of the 0.25 worker (MPS: should fail)", lambda: value(
                asyncio.run(run_worker_cell(small.connection, WIDEN.format(code=ALLOCATE.format(nbytes=beyond)), 180)),
                "WIDEN"))
            report.step("node readings after the checks", lambda: client.pool()["nodes"])
        if time.monotonic() < deadline - 90:
            from gpu_check_park import park_steps

            park_steps(report.step, first["uuid"], inventory, python_run, value, dict(os.environ))
    finally:
        for lease in leases:
            try:
                service.client().release(lease.id)
            except Exception:  # noqa: BLE001 - released already, or the service is gone
                pass
        if agent is not None:
            report.step("stop agent (no worker left)", agent.stop)
        if service is not None:
            report.step("stop service", service.stop)
        inventory.close()
    return finish(report, out)



def finish(report: Report, out: Path) -> int:
    failed = [s["name"] for s in report.data["steps"] if s["status"] == "failed"]
    report.data["failed"] = failed
    report.write()
    print(f"[gpu-check] {'FAILED: ' + ', '.join(failed) if failed else 'all steps that ran passed'}")
    print(f"[gpu-check] report: {out / 'gpu-check.md'} and {out / 'gpu-check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
