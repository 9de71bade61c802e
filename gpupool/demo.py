"""``gpupool demo``: a whole pool on this machine, and a real notebook using it.

Steps: start the service (standalone, SQLite under the state directory,
token auth); start one agent (NVML when a GPU is present, else simulated
GPUs); install the ``gpupool`` kernelspec into this environment; execute
``examples/quickstart.ipynb`` headless with nbclient on that kernelspec;
print a summary; stop everything and check that no worker, process or lease
is left. Exits non-zero if any step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import demo_pool
from .errors import GPUPoolError, Reason
from .units import format_bytes

#: Where the quickstart notebook is: a clone's examples/, then an install's prefix (the wheel's data files).
NOTEBOOKS = (Path(__file__).resolve().parent.parent / "examples" / "quickstart.ipynb",
             Path(sys.prefix) / "share" / "gpupool" / "examples" / "quickstart.ipynb")
#: The demo's own kernelspec, so a user's ``gpupool`` kernelspec is never overwritten; removed at the end.
KERNEL_NAME = "gpupool-demo"


def _say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def gpu_present() -> bool:
    """True when NVML initialises and reports at least one GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library, no GPU: all mean "simulate"
        return False


def default_notebook() -> Path | None:
    """The first of :data:`NOTEBOOKS` that exists, or None (an install that lost its data files)."""
    return next((path for path in NOTEBOOKS if path.is_file()), None)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpupool demo", description=(
        "Start a pool on this machine (service, one agent with NVML or simulated GPUs), install the "
        "gpupool kernelspec, run a notebook on it headless, print a summary and stop everything."))
    parser.add_argument("--notebook", type=Path, default=default_notebook(),
                        help="notebook to run (default: the quickstart, %(default)s)")
    parser.add_argument("--output", type=Path, help="where to write the executed notebook "
                        "(default: NOTEBOOK with .executed.ipynb, in this folder where NOTEBOOK's is read-only)")
    parser.add_argument("--state-dir", type=Path, help="service and agent state (default: a new temporary folder)")
    parser.add_argument("--simulate", default="2xA100-80GB",
                        help="simulated GPUs when no GPU is present (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per notebook cell")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when every step worked."""
    args = _parser().parse_args(argv)
    if args.notebook is None:
        _say("FAILED: the quickstart notebook is neither in a source tree nor in this install "
             f"({' nor '.join(map(str, NOTEBOOKS))}): run 'make demo' in a clone of the repository, "
             "or pass --notebook PATH")
        return 1
    if not args.notebook.exists():
        _say(f"FAILED: no notebook at {args.notebook}; pass --notebook PATH (the quickstart is in the "
             "source tree's examples/)")
        return 1
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="gpupool-demo-"))
    output = args.output or args.notebook.with_suffix(".executed.ipynb")
    if args.output is None and not os.access(output.parent, os.W_OK):  # an install's share/ (root's)
        output = Path.cwd() / output.name
    started: list[Any] = []
    failed = False
    try:
        summary = _run(args, state, output, started)
        _print_summary(summary, output)
    except GPUPoolError as exc:
        failed = True
        _say(f"FAILED: {exc.message}")
    except Exception as exc:  # a cell failed or a tool broke: say which, then clean up
        failed = True
        _say(f"FAILED: {type(exc).__name__}: {exc}")
    finally:
        failed |= not _stop_all(started)
    _say(f"state and logs: {state}")
    return 1 if failed else 0


def _run(args, state: Path, output: Path, started: list[Any]) -> dict[str, Any]:
    phases: dict[str, float] = {}
    clock = time.monotonic()
    service = demo_pool.start_service(state / "service")
    started.append(service)
    _say(f"service up at {service.url} (SQLite {state / 'service' / 'gpupool.sqlite'})")
    simulate = None if gpu_present() else args.simulate
    agent = demo_pool.start_agent(state / "agent-node-1", service, simulate=simulate)
    started.insert(0, agent)
    _say(f"agent node-1 up with {'NVML' if simulate is None else 'simulated ' + simulate} GPUs")
    subprocess.run([*demo_pool.GPUPOOL, "kernelspec", "install", f"--name={KERNEL_NAME}",
                    "--display-name=Python 3 (gpupool demo)", f"--url={service.url}",
                    f"--token-file={service.state_dir / 'user_token'}"], check=True)
    started.append(_KernelSpec(KERNEL_NAME))
    phases["start pool"] = time.monotonic() - clock
    phases.update(_execute(args.notebook, output, args.timeout))
    client = service.client()
    leases = sorted(client.list_leases(active=False), key=lambda lease: lease.created_at or "")
    still_held = [lease.id for lease in client.list_leases(active=True)]
    if still_held:
        raise GPUPoolError(Reason.leak, f"leases still held after the notebook's kernel stopped: {still_held}", 500)
    if not leases:
        raise GPUPoolError(Reason.no_lease, "the notebook never acquired a lease", 500)
    return {"lease": leases[-1], "phases": phases, "result": _notebook_result(output),
            "inventory": "NVML" if simulate is None else f"simulated {simulate}"}


def _execute(notebook: Path, output: Path, timeout: float) -> dict[str, float]:
    """Run the notebook on the gpupool kernel; returns seconds per cell tag."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    phases: dict[str, float] = {}
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    starts: dict[int, float] = {}

    def on_start(cell, cell_index, **_):
        starts[cell_index] = time.monotonic()
        if cell.cell_type == "code":
            first = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
            _say(f"cell {code_cells.index(cell) + 1}/{len(code_cells)}: {first[:70]}")

    def on_done(cell, cell_index, **_):
        tag = (cell.metadata.get("tags") or ["other"])[0]
        phases[tag] = phases.get(tag, 0.0) + time.monotonic() - starts.get(cell_index, time.monotonic())

    client = NotebookClient(nb, timeout=timeout, kernel_name=KERNEL_NAME, resources={"metadata": {"path": str(notebook.parent)}},
                            on_cell_start=on_start, on_cell_executed=on_done)
    try:
        client.execute()
    finally:
        nbformat.write(nb, output)
    return phases


def _notebook_result(output: Path) -> dict[str, Any]:
    """The ``application/json`` the notebook's last cell displays."""
    import nbformat

    nb = nbformat.read(output, as_version=4)
    for cell in reversed(nb.cells):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "application/json" in data:
                value = data["application/json"]
                return json.loads(value) if isinstance(value, str) else dict(value)
    return {}


def _print_summary(summary: dict[str, Any], output: Path) -> None:
    lease, result = summary["lease"], summary["result"]
    gpu = lease.gpus[0] if lease.gpus else {}
    lines = [
        "gpupool demo summary",
        f"  executed notebook  {output}",
        f"  GPUs               {summary['inventory']}",
        f"  lease              {lease.id} ({lease.state.value}: {lease.reason})",
        f"  node / GPU         {lease.node} / GPU {gpu.get('index')} {gpu.get('name')} ({gpu.get('uuid')})",
        f"  fraction           {lease.fraction:.2f}",
        f"  memory limit       {format_bytes(lease.memory)}",
        f"  trained on         {result.get('device')} in worker pid {result.get('worker_pid')}",
        f"  test accuracy      {result.get('accuracy', float('nan')):.3f} "
        f"(recomputed locally: {result.get('local_accuracy', float('nan')):.3f})",
        f"  usage              {lease.usage_gpu_seconds:.1f} GPU-seconds",
        "  seconds per phase  " + ", ".join(f"{k} {v:.1f}" for k, v in summary["phases"].items()),
    ]
    print("\n".join(lines), flush=True)


class _KernelSpec:
    """The demo's kernelspec, as something :func:`_stop_all` removes."""

    def __init__(self, name: str) -> None:
        self.name = name

    def stop(self) -> str:
        from jupyter_client.kernelspec import KernelSpecManager

        KernelSpecManager().remove_kernel_spec(self.name)
        return "removed"


def _stop_all(started: list[Any]) -> bool:
    """Stop agents, then the service; True when nothing was left behind."""
    clean = True
    for process in started:
        try:
            code = process.stop()
            _say(f"stopped {type(process).__name__.strip('_').replace('Process', '').lower()} ({code})")
        except GPUPoolError as exc:
            _say(f"FAILED: {exc.message}")
            clean = False
    return clean


if __name__ == "__main__":
    sys.exit(main())
