"""Park in place on the wire: what the service asks an agent to do with a
lease's worker when its GPU share goes back to the pool, and what the agent
answers (docs/parking.md).

- ``POST /workers/{lease_id}/park`` takes a :class:`ParkRequest`; the agent
  freezes the worker where it is, moves its GPU state to host memory with its
  checkpointer and answers :class:`WorkerParked` (200). 409 ``worker_busy``
  when a cell runs and the request says ``refuse``.
- ``POST /workers/{lease_id}/resume`` takes a
  :class:`~.workers.WorkerRequest` (the GPUs and limits it is granted now);
  the agent restores the GPU state onto them and thaws the worker (or, for a
  spilled one, starts a new worker and loads what was saved) and answers
  :class:`WorkerResumed` (200).
- An agent says at registration which checkpointer it uses
  (:class:`CheckpointerInfo`) and its budget of host memory for parked
  workers (``parked_memory``); its heartbeat reports each parked worker's tier
  (:class:`~.nodes.WorkerReport` ``parked``), so the service learns of spills
  the agent made on its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import bad_request
from ..schema import MAX_BYTES
from .fields import WORDS, Body, Spec, wired

#: Where a parked worker's state is: ``memory`` (the process frozen on its node,
#: its GPU state in host RAM: resumes in about a second) or ``disk`` (spilled:
#: the process ended, its namespace saved in the node's spill folder: resume
#: starts a new worker and loads it).
PARK_TIERS = ("memory", "disk")
#: What a park does with a running cell: ``freeze`` it where it is (where the
#: checkpointer can, else ``interrupt``), ``interrupt`` it (KeyboardInterrupt)
#: and park once the worker is idle, or ``refuse`` (409 ``worker_busy``): an idle
#: park never touches a running cell.
RUNNING_CELL = ("freeze", "interrupt", "refuse")

_FLAG = "'checkpointer.{key}' must be true or false, got {value!r:.40}"
_BYTES = {"minimum": 0, "maximum": MAX_BYTES, "loose": False, "lenient": True}
_LOST = Spec("array", "what could not be kept, each in words (e.g. \"the running cell was interrupted\", "
             "\"generator gen: cannot be saved to disk\"); empty: everything was kept",
             items={"type": "string"}, nullable=True, lenient=True)


def _words(value: Any) -> tuple[str, ...]:
    """The strings of a ``lost`` list, each cut to 300 characters; others dropped."""
    return tuple(v[:300] for v in value if isinstance(v, str)) if isinstance(value, list) else ()


@dataclass(frozen=True)
class CheckpointerInfo(Body):
    """The checkpointer an agent parks with (``c.AgentParking.checkpointer``),
    sent in its registration: its ``name`` (``cuda-checkpoint``,
    ``framework``, ``simulated`` or a plugin's), whether it can freeze a
    running cell (``mid_cell``: the whole device state moves, even mid-kernel)
    and whether it can restore onto another GPU of the same model on the node
    (``remap``)."""

    name: str = wired(Spec("string", "the checkpointer's name", required=True, min_length=1, max_length=50,
                           pattern=WORDS, error="'checkpointer.name' must be a name of 1 to 50 characters"))
    mid_cell: bool = wired(Spec("boolean", "it can freeze a running cell (its state moves even mid-kernel)",
                                nullable=True, error=_FLAG), False)
    remap: bool = wired(Spec("boolean", "it can restore onto another GPU of the same model on this node",
                             nullable=True, error=_FLAG), False)

    @classmethod
    def from_json(cls, body: Any) -> "CheckpointerInfo":
        """400 without a name, or with a flag that is not true, false or null (null, absent: false)."""
        if not isinstance(body, dict):
            raise bad_request("'checkpointer' must be an object with 'name', 'mid_cell' and 'remap'")
        values = cls.read(body)
        return cls(values["name"], values["mid_cell"] is True, values["remap"] is True)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ParkRequest(Body):
    """``POST /workers/{lease_id}/park``: give the worker's GPU share back,
    keeping the worker.

    ``reason``: the service's words (logged by the agent, e.g. "idle for
    30m"); ``tier``: ``memory`` (the default) or ``disk`` (spill at once: the
    owner's parked-memory quota is full, or the node's budget); ``running_cell``:
    one of :data:`RUNNING_CELL` (default ``refuse``); ``max_host_bytes``: the
    most host RAM the worker may hold parked in memory (what the owner's
    ``max_parked_memory`` leaves; None: no cap), beyond which the agent spills
    it: only the agent knows its process's resident memory.
    """

    reason: str = wired(Spec("string", "why, in words (logged)", nullable=True, max_length=300, text=True), "")
    tier: str = wired(Spec("", "where the state goes", enum=PARK_TIERS, default="memory", nullable=True), "memory")
    running_cell: str = wired(Spec("", "what to do with a running cell", enum=RUNNING_CELL, default="refuse",
                                   nullable=True), "refuse")
    max_host_bytes: int | None = wired(Spec("integer", "host RAM the parked worker may hold in memory (null: any)",
                                            nullable=True, minimum=0, maximum=MAX_BYTES, loose=False), None)

    @classmethod
    def from_json(cls, body: Any) -> "ParkRequest":
        """400 naming the field; absent fields take their defaults."""
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        values = cls.read(body)
        return cls(values["reason"] or "", values["tier"] or "memory", values["running_cell"] or "refuse",
                   values["max_host_bytes"])

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class WorkerParked(Body):
    """The agent's 200 to a park: where the state went and what it costs.

    ``tier`` (:data:`PARK_TIERS`); ``checkpointer`` the name of the one that
    moved the GPU state; ``host_bytes`` host RAM the parked worker holds now
    (its process and its GPU state; 0 on disk); ``disk_bytes`` what a spill
    wrote; ``gpu_bytes_moved`` GPU memory moved off the GPU;
    ``gpu_bytes_kept`` GPU memory the checkpointer could not free (a CUDA
    context with ``framework``), still taken on the GPU while parked;
    ``interrupted``: a running cell was interrupted to park; ``lost``: what
    could not be kept, in words; ``seconds`` the park took; ``reason`` why the
    agent spilled a worker asked to park in memory (words; empty otherwise).
    """

    tier: str = wired(Spec("", enum=PARK_TIERS, required=True, error="'tier' must be one of {choices}"))
    checkpointer: str = wired(Spec("string", "the checkpointer that moved the GPU state", lenient=True), "")
    host_bytes: int = wired(Spec("integer", "host RAM the parked worker holds", **_BYTES), 0)
    disk_bytes: int = wired(Spec("integer", "bytes a spill wrote to the node's spill folder", **_BYTES), 0)
    gpu_bytes_moved: int = wired(Spec("integer", "GPU memory moved to host memory (or disk)", **_BYTES), 0)
    gpu_bytes_kept: int = wired(Spec("integer", "GPU memory left on the GPU while parked", **_BYTES), 0)
    interrupted: bool = wired(Spec("boolean", "a running cell was interrupted", lenient=True), False)
    lost: tuple[str, ...] = wired(_LOST, ())
    seconds: float = wired(Spec("number", "how long the park took", minimum=0, loose=False, lenient=True), 0.0)
    reason: str = wired(Spec("string", "why a park asked in memory went to disk", lenient=True), "")

    @classmethod
    def from_json(cls, body: Any) -> "WorkerParked":
        """Lenient but for ``tier``: a figure that is not one reads as 0 (ValueError without a tier)."""
        body = body if isinstance(body, dict) else {}
        if body.get("tier") not in PARK_TIERS:
            raise ValueError(f"the answer has no 'tier' of {PARK_TIERS}")
        values = cls.read(body)
        return cls(**{k: v for k, v in values.items() if v is not None}
                   | {"interrupted": values["interrupted"] is True, "lost": _words(body.get("lost"))})

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"lost": list(self.lost)}


@dataclass(frozen=True)
class WorkerResumed(Body):
    """The agent's 200 to a resume: the worker's ``pid`` and Jupyter
    ``connection`` (the same as before a park in memory; a new worker's after
    a spill), ``tier`` it came back from, ``seconds`` the resume took, and
    ``lost``: what did not come back, in words (after a spill: what could not
    be saved)."""

    pid: int | None = wired(Spec("integer", "ignored unless an int", nullable=True, loose=False, lenient=True))
    connection: dict[str, Any] = wired(Spec("object", "Jupyter connection info", required=True))
    tier: str = wired(Spec("", enum=PARK_TIERS, lenient=True), "memory")
    seconds: float = wired(Spec("number", "how long the resume took", minimum=0, loose=False, lenient=True), 0.0)
    lost: tuple[str, ...] = wired(_LOST, ())

    @classmethod
    def from_json(cls, body: Any) -> "WorkerResumed":
        """Raises ValueError without a ``connection`` object; the rest is lenient."""
        body = body if isinstance(body, dict) else {}
        if not isinstance(body.get("connection"), dict):
            raise ValueError("the answer has no 'connection' object")
        values = cls.read(body, "pid", "tier", "seconds")
        return cls(values["pid"], body["connection"], values["tier"] or "memory", values["seconds"] or 0.0,
                   _words(body.get("lost")))

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"lost": list(self.lost)}
