"""Workloads for the trace-driven simulator: what a replay is given, and the
session rule that builds sessions from trace rows.

Pure data preparation, seeded, no I/O (the CSV readers are :mod:`.traces`). Sources
(see docs/simulate.md, "Traces"):

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

import math
from dataclasses import dataclass

import numpy as np

from gpupool.leaseclasses import default as default_class

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
    ``opened``/``closes`` in seconds; ``cells`` indexes into the workload's cells;
    ``klass`` its lease class (``interactive`` or ``batch``: a batch session gives its
    lease back when each cell ends) and ``preemptible`` whether pressure may interrupt it."""

    id: int
    user: int
    group: int
    gpus: int
    milli: int
    opened: float
    closes: float
    cells: tuple[int, ...]
    klass: str = default_class().name
    preemptible: bool = False


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


def period_seconds(last_arrival: float) -> float:
    """The seconds a replay's utilization is measured over: the workload's whole days, or, for
    one shorter than a day (a young pool's store), its whole hours (at least one)."""
    if last_arrival < 86400:
        return max(3600.0, math.ceil(last_arrival / 3600) * 3600)
    return math.ceil(last_arrival / 86400) * 86400


def zipf_weights(users: int, s: float) -> np.ndarray:
    """Probabilities of users ranked 1..users under Zipf(``s``)."""
    w = np.arange(1, users + 1, dtype=float) ** -s
    return w / w.sum()


def build_sessions(rows: list[tuple[int, int, float, float]], millis: np.ndarray, *, users: int = 100,
                   groups: int = 4, zipf_s: float = 1.0, workday_s: float = 8 * 3600.0,
                   seed: int = 0) -> NotebookWorkload:
    """Group cell ``rows`` (from :func:`.traces.read_sensei`, sorted) into sessions; see the module docstring."""
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
