"""The park section of ``make gpu-check`` (bench/gpu_check.py): park in place on
a real GPU, with each checkpointer this host has.

For each of ``framework`` (always) and ``cuda-checkpoint`` (when NVIDIA's
utility is on PATH): an agent of its own on this host (NVML, that
checkpointer, no service: it serves its API while it retries registering), a
worker holding a PyTorch model of about 2 GiB on the first GPU, then park,
NVML's reading of the worker's memory, resume, and the model's output again:

- the GPU memory is freed per NVML (``framework``: all but the CUDA context
  and what PyTorch keeps out of reach, reported as kept);
- the output after the resume is identical, bit for bit;
- park and resume seconds and GiB/s, beside pinned host-to-device bandwidth
  measured in a bare process (the issue's target: resume >= 50 % of it);
- the worker's ``gpu_memory`` op (what ``%gpu status`` lists) on CUDA
  tensors, a module and a list, views and shared parameters counted once, the
  last traceback's tensor listed, then freed by the park and said in ``lost``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

GiB = 1024**3

MODEL = """
import torch, hashlib, os
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(8)]).cuda()  # 8 x 256 MiB of weights
x = torch.randn(64, 8192, device="cuda")
def digest():
    with torch.no_grad():
        return hashlib.sha256(model(x).cpu().numpy().tobytes()).hexdigest()
print("PID", os.getpid()); print("DIGEST", digest())
"""

BANDWIDTH = """
import time, torch
host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory(); dev = torch.empty_like(host, device="cuda")
dev.copy_(host); torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(5): dev.copy_(host, non_blocking=True)
torch.cuda.synchronize(); print("H2D", 5 / (time.perf_counter() - t))
"""


MiB = 1024**2

HOLDERS = """
import torch
base = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
view = base[: 1 << 20]
net = torch.nn.Linear(1024, 1024).cuda()
weight = net.weight
batch = [base, torch.ones(16 << 20, dtype=torch.uint8, device="cuda")]
def fails():
    pinned = torch.zeros(32 << 20, dtype=torch.uint8, device="cuda")
    raise RuntimeError("on purpose")
"""


def checkpointers() -> list[str]:
    return ["framework", *(["cuda-checkpoint"] if shutil.which("cuda-checkpoint") else [])]


def park_steps(step: Callable[[str, Callable[[], Any]], Any], gpu: str, inventory: Any, python_run, value,
               environ: dict[str, str]) -> None:
    """Run the park section's steps through the check's ``step(name, fn)``."""
    from frontend import run
    from parkagent import ParkAgent

    bandwidth = step("pinned host-to-device bandwidth, bare process (GiB/s)",
                     lambda: float(value(python_run(BANDWIDTH, {**environ, "CUDA_VISIBLE_DEVICES": gpu}), "H2D")))
    for name in checkpointers():
        root = Path(tempfile.mkdtemp(prefix=f"gpupool-gpu-check-park-{name}-"))
        agent = step(f"park: agent with the {name} checkpointer",
                     lambda: ParkAgent(root, simulate="", args=(f"--checkpointer={name}",), gpus=[gpu]))
        if agent is None:
            continue
        try:
            step(f"park with {name}: a 2 GiB model parks, frees the GPU and resumes identical",
                 lambda: _cycle(agent, inventory, run, value, bandwidth))
            step(f"park with {name}: the names holding GPU memory, each tensor once; the last traceback dropped",
                 lambda: _holders(agent, run))
        finally:
            step(f"park: stop the {name} agent", agent.stop)
            shutil.rmtree(root, ignore_errors=True)


def _cycle(agent, inventory: Any, run, value, bandwidth: float | None) -> dict[str, Any]:
    kc = agent.client(agent.start_worker("L-gpu-park", memory=16 * GiB)["connection"])

    def cell(code: str) -> str:
        done = run(kc, code, timeout=300)
        if not done.ok:
            raise RuntimeError(done.text()[-600:])
        return done.stdout

    out = cell(MODEL)
    pid, before = int(value(out, "PID")), value(out, "DIGEST")
    held = inventory.process_memory().get(pid, 0)
    began = time.perf_counter()
    status, parked = agent.park("L-gpu-park")
    park_s = time.perf_counter() - began
    if status != 200 or parked["tier"] != "memory":
        raise RuntimeError(f"park: {status} {parked}")
    time.sleep(1.0)  # NVML's process list lags a little
    while_parked = inventory.process_memory().get(pid, 0)
    began = time.perf_counter()
    status, resumed = agent.resume("L-gpu-park")
    resume_s = time.perf_counter() - began
    if status != 200:
        raise RuntimeError(f"resume: {status} {resumed}")
    after = value(cell("print('DIGEST', digest())"), "DIGEST")
    moved = parked["gpu_bytes_moved"]
    result = {"nvml_before": held, "nvml_parked": while_parked, "moved": moved, "kept": parked["gpu_bytes_kept"],
              "lost": parked["lost"], "park_s": round(park_s, 3), "resume_s": round(resume_s, 3),
              "park_gib_s": round(moved / GiB / park_s, 2), "resume_gib_s": round(moved / GiB / resume_s, 2),
              "identical": after == before}
    if bandwidth:
        result["resume_share_of_h2d"] = round(result["resume_gib_s"] / bandwidth, 2)
    if not result["identical"]:
        raise AssertionError(f"the output changed across the park: {result}")
    if while_parked > held - moved // 2:
        raise AssertionError(f"NVML does not show the GPU memory freed: {result}")
    return result


def _holders(agent, run) -> dict[str, Any]:
    """The ``gpu_memory`` op on real CUDA tensors, before and after a park."""
    from gpupool.node.checkpoint.framework import ask
    from gpupool.wire.transfer import GpuMemory

    listing = GpuMemory(top=20)
    connection = agent.start_worker("L-gpu-holders", memory=4 * GiB)["connection"]
    kc = agent.client(connection)
    if not run(kc, HOLDERS, timeout=300).ok or "on purpose" not in run(kc, "fails()", timeout=60).text():
        raise RuntimeError("the cells did not run as they should")
    rows = {h["name"]: (h["bytes"], h["shares"]) for h in ask(connection, listing)["holders"]}
    label = next((name for name in rows if name.startswith("last traceback (RuntimeError")), None)
    want = {"base": (64 * MiB, []), "batch": (16 * MiB, ["base"]), "net": (1024 * 1024 * 4 + 1024 * 4, []),
            "view": (0, ["base"]), "weight": (0, ["net"]), label: (32 * MiB, [])}
    if label is None or rows != want:
        raise AssertionError(f"gpu_memory listed {rows}, not {want}")
    status, parked = agent.park("L-gpu-holders")
    if status != 200 or not any(words.startswith(f"the {label}, cleared") for words in parked["lost"]):
        raise AssertionError(f"the park did not say it dropped the traceback: {status} {parked}")
    if agent.resume("L-gpu-holders")[0] != 200:
        raise RuntimeError("resume failed")
    after = {h["name"] for h in ask(connection, listing)["holders"]}
    if after != {"base", "batch", "net", "view", "weight"}:
        raise AssertionError(f"after the park gpu_memory listed {sorted(after)}")
    return {"listed": {name: size for name, (size, _) in rows.items()}, "lost": parked["lost"]}
