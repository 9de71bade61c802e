"""The public traces on disk: read them into what :mod:`.workload` describes.

The only file reading of the simulator's replay side; ``gpupool simulate
--data DIR`` and ``bench/simulate_report.py`` pass the folder (there is no
default: without ``--data`` the command generates traces, :mod:`.synthetic`).
File names and columns are described in :mod:`.workload`.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from .workload import NotebookWorkload, OpenbNode, OpenbTasks, build_sessions

SENSEI = "sensei_june_60sec.csv"
OPENB_PODS = "openb_pod_list_default.csv"
OPENB_NODES = "openb_node_list_gpu_node.csv"

#: Memory of one GPU per openb model, in bytes (decimal GB, a multiple of 1000 so
#: ``int(milli / 1000 * memory)`` never rounds up). G1-G3 are undisclosed; 32 GB assumed.
#: Memory never limits placement here: a slice's memory is its fraction's share.
OPENB_MODEL_MEMORY = {"T4": 16, "P100": 16, "V100M16": 16, "V100M32": 32, "A10": 24,
                      "G1": 32, "G2": 32, "G3": 32}
GB = 10**9


def read_sensei(data: Path) -> list[tuple[int, int, float, float]]:
    """Rows ``(job_id, num_gpu, submit_s, duration_s)`` sorted by (submit, job id)."""
    with open(Path(data) / SENSEI, newline="") as fh:
        rows = [(int(r["job_id"]), int(r["num_gpu"]), float(r["submit_time"]) * 60, float(r["duration"]) * 60)
                for r in csv.DictReader(fh)]
    rows.sort(key=lambda r: (r[2], r[0]))
    return rows


def openb_slice_millis(data: Path) -> np.ndarray:
    """``gpu_milli`` of every openb pod with ``num_gpu == 1`` (1..1000)."""
    with open(Path(data) / OPENB_PODS, newline="") as fh:
        return np.array([int(r["gpu_milli"]) for r in csv.DictReader(fh) if r["num_gpu"] == "1"], dtype=np.int64)


def sensei_workload(data: Path, *, seed: int = 0, **rule) -> NotebookWorkload:
    """The sensei month as sessions (:func:`build_sessions` with ``rule`` keywords)."""
    return build_sessions(read_sensei(data), openb_slice_millis(data), seed=seed, **rule)


def read_openb(data: Path) -> tuple[list[OpenbNode], np.ndarray, np.ndarray]:
    """``(nodes, num_gpu, gpu_milli)`` of openb: nodes in file order; for the GPU pods
    (``num_gpu >= 1``) their GPU count and their per-GPU milli (1000 for whole GPUs)."""
    nodes, tasks = read_openb_tasks(data)
    gpu = tasks.gpu_pods()
    return nodes, gpu.num, gpu.milli


def read_openb_tasks(data: Path) -> tuple[list[OpenbNode], OpenbTasks]:
    """openb's nodes (with cores and RAM) and all its pods (:class:`OpenbTasks`)."""
    with open(Path(data) / OPENB_NODES, newline="") as fh:
        nodes = [OpenbNode(r["sn"], int(r["gpu"]), r["model"], OPENB_MODEL_MEMORY.get(r["model"], 32) * GB,
                           int(r["cpu_milli"]), int(r["memory_mib"])) for r in csv.DictReader(fh)]
    with open(Path(data) / OPENB_PODS, newline="") as fh:
        pods = list(csv.DictReader(fh))
    num = np.array([int(r["num_gpu"]) for r in pods], dtype=np.int64)
    milli = np.array([int(r["gpu_milli"]) if n == 1 else (1000 if n > 1 else 0) for r, n in zip(pods, num)],
                     dtype=np.int64)
    life = np.array([max(1.0, float(r["deletion_time"] or 0) - float(r["scheduled_time"] or r["creation_time"] or 0))
                     for r in pods])
    return nodes, OpenbTasks(np.array([int(r["cpu_milli"]) for r in pods], dtype=np.int64),
                             np.array([int(r["memory_mib"]) for r in pods], dtype=np.int64), num, milli, life)
