"""The checkpointer contract: what moves a worker's GPU state to host memory at
a park and back at a resume (docs/parking.md, "The agent's part").

The agent holds one :class:`Checkpointer` (``c.AgentParking.checkpointer``,
:mod:`.factory`); the park logic (:mod:`..workers.parking`) calls it with a
:class:`ParkTarget`, what it needs to know of one worker whatever launcher
started it, and keeps the :class:`Moved` it answers in the worker's record,
so that an agent restarted while the worker is parked can resume it.

Who freezes when: a checkpointer with :attr:`Checkpointer.frozen` True moves
the state of a frozen process (the agent freezes the worker first and thaws
it after the resume: ``simulated``); one with False needs the process running
while its state moves (the agent freezes it after the park and thaws it
before the resume: ``framework``, which runs in the worker, and
``cuda-checkpoint``, whose driver threads run in it).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Mapping

from gpupool.wire.parking import CheckpointerInfo


class CheckpointError(Exception):
    """A park or resume that could not be done; the message says why in words
    for the service's answer and the log. A park that raises it has put
    everything back as it was (the worker runs on, on its GPU)."""


@dataclass(frozen=True)
class ParkTarget:
    """One worker as a checkpointer sees it: its ``lease_id``, main ``pid``
    and every process of it (``pids``: its cgroup, or its process tree),
    ``gpus`` (UUIDs in its device order, the ones it was started or last
    resumed on), ``memory`` (its limit per GPU, bytes), ``gpu_memory``
    (pid -> GPU bytes now, from the inventory: those of its processes on a
    GPU), its Jupyter ``connection`` (for a checkpointer that runs in the
    worker) and ``uid`` (its account's, None: the agent's)."""

    lease_id: str
    pid: int
    pids: tuple[int, ...]
    gpus: tuple[str, ...]
    memory: int
    gpu_memory: Mapping[int, int] = field(default_factory=dict)
    connection: Mapping[str, Any] = field(default_factory=dict)
    uid: int | None = None


@dataclass(frozen=True)
class Moved:
    """What a park moved: ``gpu_bytes_moved`` off the GPU, ``gpu_bytes_kept``
    still on it (a CUDA context the checkpointer cannot free), ``host_bytes``
    the moved state takes in host memory *outside* the worker's processes
    (a copy the agent holds; what lives in the worker is counted in its
    RSS), ``lost`` what could not be kept, in words, and ``state``, the
    checkpointer's own notes (JSON), given back at the resume."""

    gpu_bytes_moved: int = 0
    gpu_bytes_kept: int = 0
    host_bytes: int = 0
    lost: tuple[str, ...] = ()
    state: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"lost": list(self.lost)}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "Moved":
        """Inverse of :meth:`to_json`; ValueError for a body that is not one."""
        try:
            return cls(int(body.get("gpu_bytes_moved", 0)), int(body.get("gpu_bytes_kept", 0)),
                       int(body.get("host_bytes", 0)), tuple(str(w) for w in body.get("lost", ())),
                       dict(body.get("state") or {}))
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a checkpointer's record: {exc}") from None


@dataclass(frozen=True)
class NodeFacts:
    """What decides whether a checkpointer works on this node: the
    inventory's ``kind`` (``nvml``, ``simulated``) and the GPU driver's
    ``driver`` version string (None: unknown)."""

    inventory: str
    driver: str | None = None


class Checkpointer(ABC):
    """One way of moving a worker's GPU state; subclass it to add one.

    A subclass sets :attr:`name`, :attr:`mid_cell`, :attr:`remap` and
    :attr:`frozen`, implements :meth:`park` and :meth:`resume` (and
    :meth:`unusable`, :meth:`to_host`, :meth:`discard` where the defaults do
    not fit), and is found by name through the ``gpupool.checkpointers``
    entry point group (:mod:`.factory`). The agent makes one instance with
    its ``log``. Every method runs on the agent's event loop and must not
    block it (files and subprocesses in threads).
    """

    #: The name ``c.AgentParking.checkpointer`` takes, sent at registration.
    name: ClassVar[str] = ""
    #: It can park a worker while a cell runs (the whole device state moves, mid-kernel).
    mid_cell: ClassVar[bool] = False
    #: It can restore onto another GPU of the same model on the node.
    remap: ClassVar[bool] = False
    #: It moves the state of a frozen process (see the module's docstring).
    frozen: ClassVar[bool] = True

    def __init__(self, log: logging.Logger | None = None) -> None:
        self.log = log or logging.getLogger("gpupool.agent")

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if not isinstance(cls.name, str) or not 0 < len(cls.name) <= 50 or not cls.name.isprintable():
            raise TypeError(f"checkpointer {cls.__qualname__} needs a name of 1 to 50 printable characters")

    @classmethod
    def unusable(cls, node: NodeFacts) -> str | None:
        """Why this checkpointer cannot work on ``node``, in words naming
        what is missing; None when it can. ``auto`` skips one that cannot;
        one asked for by name refuses to start the agent with these words.
        The default: usable everywhere."""
        return None

    def info(self) -> CheckpointerInfo:
        """What the registration says of it."""
        return CheckpointerInfo(self.name, self.mid_cell, self.remap)

    @abstractmethod
    async def park(self, target: ParkTarget) -> Moved:
        """Move ``target``'s GPU state to host memory and free its GPU
        memory; returns what moved. CheckpointError, with everything put
        back, when it cannot."""

    @abstractmethod
    async def resume(self, target: ParkTarget, moved: Moved, gpus: tuple[str, ...], memory: int) -> None:
        """Put the state ``moved`` (what :meth:`park` answered for
        ``target``) back on ``gpus`` (UUIDs, the same count and order as
        ``target.gpus``; other ones only where :attr:`remap`), with a memory
        limit of ``memory`` bytes per GPU. CheckpointError when it cannot
        (the state stays in host memory then)."""

    async def to_host(self, target: ParkTarget, moved: Moved) -> None:
        """Before a spill of a worker parked in memory: make its GPU state
        readable by its own process in host memory (its namespace is then
        pickled there, and the process ends), without taking GPU memory
        where it can. The default: resume onto its own GPUs (the spill then
        reads the GPU, which must have room)."""
        await self.resume(target, moved, target.gpus, target.memory)

    async def discard(self, target: ParkTarget, moved: Moved) -> None:
        """Drop what the park holds outside the worker (its process is being
        ended while parked). The default holds nothing outside it."""
