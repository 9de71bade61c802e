"""Workloads for the trace-driven simulator: read the public traces, build sessions.

Pure data preparation, seeded, no I/O beyond reading the CSV files. Sources
(see ``../shared/data/README.md``):

- ``sensei_june_60sec.csv``: Adobe Sensei notebook cell executions, June 2021,
  as released with NotebookOS (Carver et al., arXiv 2503.20591). One row per
  cell; ``submit_time`` and ``duration`` in **minutes**; ``num_gpu`` is
  max(GPUs used, 1), so CPU-only cells appear as 1 GPU. No session or user ids.
- ``openb_pod_list_default.csv`` and ``openb_node_list_gpu_node.csv``: the
  Alibaba GPU-sharing trace (Weng et al., "Beware of Fragmentation", USENIX
  ATC '23). ``gpu_milli`` is the fraction (in thousandths) of one GPU for
  ``num_gpu == 1`` pods. No user ids.

Session rule for sensei (the trace has no session ids; this rule is ours and
is stated in bench/REPORT.md):

1. Cells are sorted by (submit time, job id).
2. ``users`` **synthetic** users; each cell is given to a user drawn from a
   Zipf law (weight of the user ranked r is ``r ** -zipf_s``), seeded; user
   r belongs to synthetic group ``r % groups``.
3. A session is one notebook of one user running cells of one size
   (``num_gpu`` 1, 4 or 8: the size a notebook trains at does not change).
   A cell goes to the earliest-opened session of its user and size that is
   open (opened less than ``workday_s`` ago) and not running a cell at the
   cell's trace submit time; if there is none, the user opens a new session.
   So trace arrival times are kept, and no session runs two cells at once.
4. A session opens at its first cell and its kernel shuts down ``workday_s``
   (default 8 hours, a working day) later, or when its last cell ends if
   that is later.

The GPU fraction a 1-GPU notebook needs is not in the sensei trace. Each
1-GPU session gets one fraction drawn (seeded) from openb's ``gpu_milli`` of
``num_gpu == 1`` pods (43.6 % of them are below 1000 milli). 4- and 8-GPU
sessions need whole GPUs.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Where ``bench/simulate_report.py`` looks for the public traces (relative to the
#: repository root). ``gpupool simulate`` has no default folder: without ``--data``
#: it generates traces (:mod:`.simulator_synthetic`).
DEFAULT_DATA = Path("../shared/data")
SENSEI = "sensei_june_60sec.csv"
OPENB_PODS = "openb_pod_list_default.csv"
OPENB_NODES = "openb_node_list_gpu_node.csv"

#: Memory of one GPU per openb model, in bytes (decimal GB, a multiple of 1000 so
#: ``int(milli / 1000 * memory)`` never rounds up). G1-G3 are undisclosed; 32 GB assumed.
#: Memory never limits placement here: a slice's memory is its fraction's share.
OPENB_MODEL_MEMORY = {"T4": 16, "P100": 16, "V100M16": 16, "V100M32": 32, "A10": 24,
                      "G1": 32, "G2": 32, "G3": 32}
GB = 10**9


@dataclass(frozen=True)
class Cell:
    """One cell execution: ``submit`` and ``duration`` in seconds (trace minutes x 60)."""

    job_id: int
    session: int
    submit: float
    duration: float


@dataclass(frozen=True)
class Session:
    """One notebook: ``gpus`` whole GPUs per cell (1, 4 or 8); ``milli`` the
    fraction of one GPU (thousandths) a 1-GPU cell needs (1000 for 4/8);
    ``opened``/``closes`` in seconds; ``cells`` indexes into the workload's cells."""

    id: int
    user: int
    group: int
    gpus: int
    milli: int
    opened: float
    closes: float
    cells: tuple[int, ...]


@dataclass(frozen=True)
class NotebookWorkload:
    """Cells sorted by submit time, and the sessions they belong to."""

    cells: tuple[Cell, ...]
    sessions: tuple[Session, ...]
    rule: str

    def busy_gpu_hours(self) -> float:
        """GPU-hours the cells need: slice fraction (1-GPU) or whole GPUs, times run time."""
        return sum(self.sessions[c.session].gpus * self.sessions[c.session].milli / 1000 * c.duration
                   for c in self.cells) / 3600


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


def zipf_weights(users: int, s: float) -> np.ndarray:
    """Probabilities of users ranked 1..users under Zipf(``s``)."""
    w = np.arange(1, users + 1, dtype=float) ** -s
    return w / w.sum()


def build_sessions(rows: list[tuple[int, int, float, float]], millis: np.ndarray, *, users: int = 100,
                   groups: int = 4, zipf_s: float = 1.0, workday_s: float = 8 * 3600.0,
                   seed: int = 0) -> NotebookWorkload:
    """Group cell ``rows`` (from :func:`read_sensei`, sorted) into sessions; see the module docstring."""
    rng = np.random.default_rng(seed)
    owner = rng.choice(users, size=len(rows), p=zipf_weights(users, zipf_s))
    open_by_key: dict[tuple[int, int], list[list]] = {}  # (user, gpus) -> [[id, opened, busy_until, cells]]
    sessions: list[list] = []  # [id, user, gpus, opened, last_end, cells]
    cells: list[Cell] = []
    for i, (job, gpus, submit, duration) in enumerate(rows):
        user = int(owner[i])
        live = [s for s in open_by_key.get((user, gpus), []) if submit < s[1] + workday_s]
        open_by_key[(user, gpus)] = live
        free = [s for s in live if s[2] <= submit]
        if free:
            entry = free[0]
        else:
            entry = [len(sessions), submit, 0.0, []]
            live.append(entry)
            sessions.append([entry[0], user, gpus, submit, 0.0, entry[3]])
        entry[2] = submit + duration
        sessions[entry[0]][4] = max(sessions[entry[0]][4], submit + duration)
        entry[3].append(len(cells))
        cells.append(Cell(job, entry[0], submit, duration))
    fractions = rng.choice(millis, size=len(sessions))
    built = tuple(Session(sid, user, user % groups, gpus, int(fractions[sid]) if gpus == 1 else 1000,
                          opened, max(opened + workday_s, last_end), tuple(members))
                  for sid, user, gpus, opened, last_end, members in sessions)
    rule = (f"{users} synthetic users (Zipf s={zipf_s}, {groups} synthetic groups), one session per user and "
            f"cell size, open {workday_s / 3600:g} h (a working day) from its first cell, a cell joins the "
            f"earliest open idle session of its user and size; 1-GPU sessions need a slice drawn from openb's "
            f"gpu_milli; seed {seed}")
    return NotebookWorkload(tuple(cells), built, rule)


def sensei_workload(data: Path = DEFAULT_DATA, *, seed: int = 0, **rule) -> NotebookWorkload:
    """The sensei month as sessions (:func:`build_sessions` with ``rule`` keywords)."""
    return build_sessions(read_sensei(data), openb_slice_millis(data), seed=seed, **rule)


@dataclass(frozen=True)
class OpenbNode:
    """One openb GPU node: ``name`` (sn), ``gpus`` count, ``model``, ``memory``
    bytes per GPU, ``cpu_milli`` cores x 1000 and ``memory_mib`` host RAM (0: not modelled)."""

    name: str
    gpus: int
    model: str
    memory: int
    cpu_milli: int = 0
    memory_mib: int = 0


@dataclass(frozen=True)
class OpenbTasks:
    """Every openb pod (CPU-only ones too), as arrays of one length: CPU ask
    (milli-cores), host memory ask (MiB), ``num`` GPUs (0-8), per-GPU ``milli``
    (the fraction for ``num == 1``, 1000 for several, 0 for none) and
    ``lifetime`` seconds (deletion - scheduled, at least 1)."""

    cpu: np.ndarray
    memory: np.ndarray
    num: np.ndarray
    milli: np.ndarray
    lifetime: np.ndarray

    def gpu_pods(self) -> "OpenbTasks":
        """Only the pods that ask for a GPU."""
        keep = self.num >= 1
        return OpenbTasks(self.cpu[keep], self.memory[keep], self.num[keep], self.milli[keep], self.lifetime[keep])


def read_openb(data: Path = DEFAULT_DATA) -> tuple[list[OpenbNode], np.ndarray, np.ndarray]:
    """``(nodes, num_gpu, gpu_milli)`` of openb: nodes in file order; for the GPU pods
    (``num_gpu >= 1``) their GPU count and their per-GPU milli (1000 for whole GPUs)."""
    nodes, tasks = read_openb_tasks(data)
    gpu = tasks.gpu_pods()
    return nodes, gpu.num, gpu.milli


def read_openb_tasks(data: Path = DEFAULT_DATA) -> tuple[list[OpenbNode], OpenbTasks]:
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
