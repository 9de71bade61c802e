"""What Slurm says about a worker's job or step, read from ``scontrol``'s
one-line output (``Key=value`` pairs, values that may hold ``=`` and spaces),
and the words a lease ends with when Slurm ended its job, from slurmstepd's
line in the worker's log (pure: text in, values out). Why ``scontrol`` and
not ``squeue --json``, and when only that line is left: docs/launchers.md,
"Liveness, state and words".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A pair begins where whitespace is followed by KEY= (keys: letters, digits, '_', '/', ':').
_PAIR_START = re.compile(r"\s+(?=[A-Za-z][A-Za-z0-9_/:]*=)")
_IDX = re.compile(r"\(IDX:([^)]*)\)")
_END_LINE = re.compile(r"\*\*\* (JOB|STEP) (\S+) ON (\S+) CANCELLED AT (\S+)(?: DUE TO ([A-Z ]+?))?(?:,[^*]*)? \*\*\*")

#: Job states in which the job no longer runs (squeue(1), "JOB STATE CODES").
ENDED = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "TIMEOUT", "REVOKED", "SPECIAL_EXIT"})


def parse_pairs(text: str) -> dict[str, str]:
    """``scontrol --oneliner`` output as ``{key: value}`` (the first value
    wins for a key printed twice; empty values as '')."""
    pairs: dict[str, str] = {}
    for chunk in _PAIR_START.split(text.strip()):
        key, sep, value = chunk.partition("=")
        if sep and key not in pairs:
            pairs[key] = value.strip()
    return pairs


def gpu_indices(gres: str) -> tuple[int, ...]:
    """The device indices in a GRES allocation such as ``gpu:2(IDX:0-1)``
    or ``gpu:3(IDX:0,2-3)`` (empty when none is named)."""
    found: list[int] = []
    for match in _IDX.finditer(gres):
        for part in match.group(1).split(","):
            first, _, last = part.partition("-")
            if first.isdigit():
                found.extend(range(int(first), int(last or first) + 1))
    return tuple(found)


def _exit(value: str) -> tuple[int | None, int | None]:
    code, _, signal = value.partition(":")
    try:
        return int(code), int(signal or 0)
    except ValueError:
        return None, None


def _null(value: str) -> str:
    return "" if value in ("(null)", "N/A", "None") else value


@dataclass(frozen=True)
class SlurmJob:
    """One job as ``scontrol show job -d`` shows it: ``state`` (RUNNING,
    PENDING, SUSPENDED, CANCELLED, TIMEOUT, NODE_FAIL...), ``reason``
    (why it waits or ended: Resources, Priority, NodeDown...; '' for None),
    the GRES it was given (``gres``, e.g. ``gpu:1(IDX:0)``) and their device
    indices (``gpus``), ``exit_code``/``signal`` of its batch script."""

    job_id: int
    name: str
    comment: str
    state: str
    reason: str
    user: str
    node: str
    gres: str
    gpus: tuple[int, ...]
    time_limit: str
    exit_code: int | None
    signal: int | None

    @classmethod
    def parse(cls, text: str) -> "SlurmJob":
        """From ``scontrol --oneliner --details show job`` output; ValueError when it names no job."""
        pairs = parse_pairs(text)
        if "JobId" not in pairs:
            raise ValueError(f"not a Slurm job: {text[:120]!r}")
        gres = pairs.get("GRES", "")
        code, signal = _exit(pairs.get("ExitCode", ""))
        return cls(job_id=int(pairs["JobId"]), name=pairs.get("JobName", ""), comment=_null(pairs.get("Comment", "")),
                   state=pairs.get("JobState", ""), reason=_null(pairs.get("Reason", "")),
                   user=pairs.get("UserId", "").split("(")[0],
                   node=_null(pairs.get("BatchHost", pairs.get("NodeList", ""))),
                   gres=_null(gres) or _null(pairs.get("JOB_GRES", "")), gpus=gpu_indices(gres),
                   time_limit=pairs.get("TimeLimit", ""), exit_code=code, signal=signal)

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def running(self) -> bool:
        return self.state == "RUNNING"


@dataclass(frozen=True)
class SlurmStep:
    """One job step as ``scontrol show step`` shows it: ``step_id``
    (``JOB.STEP``), ``name``, ``state``, the GRES it asked for
    (``gres``, e.g. ``gres:gpu:1``) and the host and pid of its ``srun``."""

    step_id: str
    name: str
    state: str
    node: str
    gres: str
    srun_host: str
    srun_pid: int | None

    @classmethod
    def parse(cls, text: str) -> "SlurmStep":
        """From ``scontrol --oneliner show step`` output; ValueError when it names no step."""
        pairs = parse_pairs(text)
        if "StepId" not in pairs:
            raise ValueError(f"not a Slurm job step: {text[:120]!r}")
        host, _, pid = pairs.get("SrunHost:Pid", "").rpartition(":")
        return cls(step_id=pairs["StepId"], name=pairs.get("Name", ""), state=pairs.get("State", ""),
                   node=pairs.get("NodeList", ""), gres=_null(pairs.get("TresPerNode", "")), srun_host=host,
                   srun_pid=int(pid) if pid.isdigit() else None)


@dataclass(frozen=True)
class EndLine:
    """slurmstepd's line in a job's output when Slurm ended it: ``what``
    (JOB or STEP), its id, node, time and ``cause`` ('' for a plain
    ``scancel``; TIME LIMIT, NODE FAILURE, PREEMPTION...)."""

    what: str
    ident: str
    node: str
    at: str
    cause: str


def end_line(output: str) -> EndLine | None:
    """The last :class:`EndLine` in a job's ``output``; None when Slurm wrote none."""
    found = None
    for match in _END_LINE.finditer(output):
        found = EndLine(match.group(1), match.group(2), match.group(3), match.group(4), (match.group(5) or "").strip())
    return found


_CAUSES = {
    "TIME LIMIT": "it reached its time limit{limit} (c.SlurmLauncher.time_limit, or the partition's MaxTime)",
    "NODE FAILURE": "its node {node} failed",
    "PREEMPTION": "a job of higher priority preempted it",
}
_STATES = {
    "TIMEOUT": _CAUSES["TIME LIMIT"],
    "NODE_FAIL": _CAUSES["NODE FAILURE"],
    "PREEMPTED": _CAUSES["PREEMPTION"],
    "CANCELLED": "it was cancelled in Slurm (scancel, by an administrator or the job's owner)",
    "OUT_OF_MEMORY": "it ran out of its memory (the lease's host memory, --mem)",
    "BOOT_FAIL": "its node failed to boot",
    "DEADLINE": "it reached its deadline",
    "FAILED": "the worker exited with code {code}",
    "COMPLETED": "the worker exited",
}


#: What srun writes when slurmctld ends its step (scancel, a time limit, a node failure). slurmstepd's
#: end line, which says which, follows, except for a step ended before its task was launched (srun:
#: "aborted before step completely launched").
SRUN_STEP_ABORTED = "srun: Job step aborted"


#: What slurmstepd writes when the step's cgroup out-of-memory handler killed a task (``Detected 1
#: oom-kill event(s) in StepId=12.0``); srun then says ``task 0: Out Of Memory``. No end line follows.
OOM_KILL_EVENT = "oom-kill event(s) in StepId="


def out_of_memory(output: str) -> bool:
    """Whether ``output`` (a step's, its srun's) says Slurm's cgroup killed a task for memory."""
    return OOM_KILL_EVENT in output


def end_reason(job_id: str | int, job: SlurmJob | None, output: str = "") -> str:
    """Why Slurm ended the worker's job (or step) ``job_id``, in words for
    the lease's owner: from ``job`` (its state) while slurmctld still knows
    it, else from slurmstepd's :func:`end_line` or its oom-kill line in its ``output``, else from
    srun's word that Slurm aborted the step, else that Slurm no longer knows
    it. Call it only for a job the agent did not cancel itself."""
    line = end_line(output)
    if job is not None and job.ended:
        template = _STATES.get(job.state, f"Slurm says {job.state}" + (f" ({job.reason})" if job.reason else ""))
        if job.state == "CANCELLED" and line is not None and line.cause in _CAUSES:
            template = _CAUSES[line.cause]
        node, code = job.node or "of the job", job.exit_code
        limit = f" of {job.time_limit}" if job.time_limit and job.time_limit != "UNLIMITED" else ""
        return f"Slurm ended the worker's job {job_id}: " + template.format(node=node, code=code, limit=limit)
    if line is not None:
        template = _CAUSES.get(line.cause, _STATES["CANCELLED"] if not line.cause else f"Slurm says {line.cause}")
        return f"Slurm ended the worker's job {job_id}: " + template.format(node=line.node, code=None, limit="")
    if out_of_memory(output):
        return f"Slurm ended the worker's job {job_id}: " + _STATES["OUT_OF_MEMORY"]
    if SRUN_STEP_ABORTED in output:
        return (f"Slurm ended the worker's job {job_id}: it aborted the step (scancel, a time limit or a node "
                "failure; slurmstepd wrote no reason)")
    return f"the worker's Slurm job {job_id} ended and Slurm no longer knows it (its output says nothing of why)"
