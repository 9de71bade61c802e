"""What the agent keeps of a worker that runs in Slurm: enough to find its job
again after an agent restart, as JSON (the launcher's own part of a worker's
record, docs/launchers.md, "The contract for phase 2", ``state(worker)``).

A lease job is found by its id and checked by its name: Slurm's job ids are
unique within a cluster for as long as slurmctld keeps its state, but a
cluster whose state was wiped counts from 1 again, so a job of the same id
and another name is not the lease's. A slice's step is found by its share
job and step id, and checked by its name likewise.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

#: The version of the JSON this module writes; :meth:`SlurmWorkerRecord.from_json` refuses others.
VERSION = 1


@dataclass(frozen=True)
class SlurmWorkerRecord:
    """A lease's worker in Slurm: ``job_id`` (its lease job, or the share
    job its step runs in), ``step_id`` (None: the worker is the job's batch
    script), ``name`` (the job's or step's name, the lease's), ``gpus``
    (device indices Slurm gave it), ``log_path`` (its output, where
    slurmstepd writes why it ended it), ``connection_file``."""

    lease_id: str
    job_id: int
    name: str
    log_path: str
    connection_file: str
    step_id: int | None = None
    gpus: tuple[int, ...] = ()

    @property
    def ident(self) -> str:
        """``JOB`` or ``JOB.STEP``, as Slurm's commands name it."""
        return f"{self.job_id}.{self.step_id}" if self.step_id is not None else str(self.job_id)

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, **asdict(self), "gpus": list(self.gpus)}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    @classmethod
    def from_json(cls, body: Any) -> "SlurmWorkerRecord":
        """From :meth:`to_json`'s dict; ValueError (naming what is wrong) for anything else."""
        if not isinstance(body, dict) or body.get("version") != VERSION:
            raise ValueError(f"not a Slurm worker record of version {VERSION}: {str(body)[:100]!r}")
        try:
            step = body.get("step_id")
            record = cls(lease_id=str(body["lease_id"]), job_id=int(body["job_id"]), name=str(body["name"]),
                         log_path=str(body["log_path"]), connection_file=str(body["connection_file"]),
                         step_id=None if step is None else int(step), gpus=tuple(int(g) for g in body.get("gpus", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a Slurm worker record: {type(exc).__name__}: {exc}") from None
        if record.job_id < 1 or (record.step_id is not None and record.step_id < 0):
            raise ValueError(f"not a Slurm worker record: job {record.ident}")
        return record

    @classmethod
    def loads(cls, text: str) -> "SlurmWorkerRecord":
        try:
            return cls.from_json(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a Slurm worker record: {exc}") from None
