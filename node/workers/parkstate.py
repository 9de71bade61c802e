"""What the agent remembers of a parked lease: :class:`ParkedInMemory` (its
worker frozen on the node, kept on the :class:`~.handle.Worker` and in its
record) and :class:`Spilled` (its worker ended, its namespace in the spill
folder, with a manifest there), both read back by a restarted agent
(:mod:`.recovery`)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gpupool.schema import WorkerState
from gpupool.wire.nodes import GPUInfo

from ..checkpoint import Moved

MANIFEST = "spill.json"
NAMESPACE = "namespace.bin"


@dataclass(frozen=True)
class ParkedInMemory:
    """A worker parked in memory: the ``checkpointer`` that moved its GPU
    state and what it ``moved``, ``since`` (epoch seconds), its
    ``execution_state`` when it was frozen (``busy``: frozen mid-cell),
    ``host_bytes`` it holds (its processes' RSS plus what the checkpointer
    holds outside them), whether a cell was ``interrupted`` to park it, and
    whether it is ``offered``: thawed, its GPU state in its host memory and
    its namespace offered on its data plane to the node it moves to
    (:mod:`.warmmove`), until that node has it (the worker is then ended)
    or the move is given up (it is then spilled to disk)."""

    checkpointer: str
    moved: Moved
    since: float
    execution_state: WorkerState = WorkerState.idle
    host_bytes: int = 0
    interrupted: bool = False
    offered: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"moved": self.moved.to_json()}

    @classmethod
    def from_json(cls, body: Any) -> "ParkedInMemory":
        """ValueError for a body that is not one."""
        if not isinstance(body, dict):
            raise ValueError("a parked worker's record must be an object")
        try:
            return cls(str(body["checkpointer"]), Moved.from_json(body["moved"]), float(body["since"]),
                       WorkerState(body.get("execution_state", WorkerState.idle)), int(body.get("host_bytes", 0)),
                       bool(body.get("interrupted", False)), bool(body.get("offered", False)))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a parked worker's record: {exc}") from None

    def but(self, **changes: Any) -> "ParkedInMemory":
        return replace(self, **changes)


@dataclass(frozen=True)
class Spilled:
    """A lease whose parked worker was spilled: ``folder`` (under the spill
    folder: its manifest and the namespace file), the slice it had (``owner``,
    ``gpus``, ``fraction``, ``memory``), ``since`` (epoch seconds),
    ``disk_bytes`` written, ``lost`` (what could not be saved, in words),
    ``idle_since`` (ISO: its last cell's end before the spill)."""

    lease_id: str
    owner: str
    folder: Path
    gpus: tuple[GPUInfo, ...]
    fraction: float
    memory: int
    since: float
    disk_bytes: int = 0
    lost: tuple[str, ...] = ()
    idle_since: str | None = None
    names: tuple[str, ...] = field(default=())

    @property
    def namespace(self) -> Path:
        return self.folder / NAMESPACE

    def write(self) -> None:
        """The manifest, atomically, readable by the agent's user only."""
        body = asdict(self) | {"folder": str(self.folder), "gpus": [g.to_json() for g in self.gpus],
                               "lost": list(self.lost), "names": list(self.names)}
        target = self.folder / MANIFEST
        tmp = target.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(body, out)
        tmp.replace(target)

    @classmethod
    def read(cls, folder: Path) -> "Spilled":
        """The manifest in ``folder``; ValueError (or OSError) when there is none or it is not one."""
        body = json.loads((folder / MANIFEST).read_text())
        try:
            return cls(str(body["lease_id"]), str(body["owner"]), folder,
                       tuple(GPUInfo.from_json(g) for g in body["gpus"]), float(body["fraction"]),
                       int(body["memory"]), float(body["since"]), int(body.get("disk_bytes", 0)),
                       tuple(str(w) for w in body.get("lost", ())), body.get("idle_since"),
                       tuple(str(n) for n in body.get("names", ())))
        except Exception as exc:  # KeyError, TypeError, GPUPoolError: not a manifest
            raise ValueError(f"{folder / MANIFEST} is not a spill manifest: {exc}") from None

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def read_spills(spill_dir: Path) -> tuple[list[Spilled], list[Path]]:
    """Every complete spill under ``spill_dir`` and the folders that hold
    none (a spill cut short by an agent's death): ``(spills, leftovers)``."""
    spills, leftovers = [], []
    try:
        folders = sorted(p for p in spill_dir.iterdir() if p.is_dir())
    except FileNotFoundError:
        return [], []
    for folder in folders:
        try:
            spill = Spilled.read(folder)
        except (OSError, ValueError):
            leftovers.append(folder)
            continue
        if spill.lease_id == folder.name:
            spills.append(spill)
        else:
            leftovers.append(folder)
    return spills, leftovers
