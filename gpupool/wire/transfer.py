"""The ``gpupool.transfer`` comm: notebook kernel (or agent) -> worker
(docs/api.md, "Worker comm target").

One comm per request: its open message is a request, ``{"op": OP, ...}``;
the worker answers one ``comm_msg``, ``{"ok": true, ...}`` or ``{"ok":
false, "message": words}``, and closes the comm. Each op's request is a
class here: the sender sends its ``to_json()``, the worker reads it with
:func:`read_request`. The values' header and buffers are
:mod:`gpupool.transfer`'s; a ``stream`` is a data-plane ticket
(:meth:`gpupool.dataplane.Ticket.wire`, with ``sizes`` on a push or a fetch).

Pure (the standard library and :mod:`gpupool.strenum`): the worker's extension imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..strenum import StrEnum

TARGET = "gpupool.transfer"


class Op(StrEnum):
    """The ops a worker answers: the notebook kernel's moves of variables
    (``push``, ``pull``, ``pull_all``, ``fetch``) and remoting (``have``,
    ``versions``, ``attach``, ``gpu_memory``); the agent's while it parks a
    worker (``forget_traceback``, ``park_gpu``, ``resume_gpu``, ``spill``,
    ``load_spill``)."""

    push = "push"
    pull = "pull"
    pull_all = "pull_all"
    fetch = "fetch"
    have = "have"
    versions = "versions"
    attach = "attach"
    gpu_memory = "gpu_memory"
    forget_traceback = "forget_traceback"
    park_gpu = "park_gpu"
    resume_gpu = "resume_gpu"
    spill = "spill"
    load_spill = "load_spill"


@dataclass(frozen=True, kw_only=True)
class Request:
    """One request of op :attr:`OP`. A field without a default must be
    sent; one that is None is not sent (the worker reads it as absent)."""

    OP: ClassVar[Op]

    def to_json(self) -> dict[str, Any]:
        """``{"op": OP, field: value, ...}``, None fields left out."""
        sent = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {"op": self.OP.value, **{key: value for key, value in sent.items() if value is not None}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Request":
        """The request in ``data``: an absent field takes its default;
        KeyError names a field that must be sent and is not."""
        values = {}
        for spec in dataclasses.fields(cls):
            if spec.name in data:
                values[spec.name] = data[spec.name]
            elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise KeyError(spec.name)
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class Push(Request):
    """Values into the worker's namespace: ``header`` (and the comm's
    buffers, or the ``stream`` of their ``sizes`` on the data plane);
    ``devices``: ``{name: "cuda:0"}``, where each goes. Answer: ``loaded``
    (names), ``errors`` (``{name: why}``)."""

    OP = Op.push
    header: dict[str, Any]
    devices: dict[str, str] | None = None
    stream: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class Pulling(Request):
    """Values out of the worker, within ``max_bytes``; with a ``stream``
    ticket big buffers wait on the data plane (all of them with
    ``stream_all``). Answer: ``header`` (and buffers, or ``header["stream"]``
    with their sizes)."""

    max_bytes: int | None = None
    stream: dict[str, Any] | None = None
    stream_all: bool | None = None


@dataclass(frozen=True, kw_only=True)
class Pull(Pulling):
    """:class:`Pulling` ``names``."""

    OP = Op.pull
    names: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class PullAll(Pulling):
    """:class:`Pulling` every user variable; the answer's ``header["modules"]``
    is ``{name: module}`` of the imports. With ``outputs``, the results the
    worker's cells showed too (``Out[n]``, as ``_n``): a spill's or a move's,
    whose new worker keeps them."""

    OP = Op.pull_all
    outputs: bool | None = None


@dataclass(frozen=True, kw_only=True)
class Fetch(Request):
    """A move: take another worker's ``pull_all`` (``header``) from its data
    plane at ``source`` (``{"ip", "transfer_port"}``) with the ``stream``
    ticket and ``sizes``, and restore it. Answer: ``loaded``, ``errors``."""

    OP = Op.fetch
    source: dict[str, Any]
    stream: dict[str, Any]
    header: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Have(Request):
    """Which of ``names`` the worker holds. Answer: ``have`` (names)."""

    OP = Op.have
    names: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Versions(Request):
    """The worker's Python and key packages. Answer: ``versions`` (``{"numpy": "2.4.6", ...}``)."""

    OP = Op.versions


@dataclass(frozen=True, kw_only=True)
class Attach(Request):
    """Sent once when the gpupool kernel attaches: its ``execution_count``,
    ``cwd``, ``home`` (its ``~``) and lease owner ``user``. Answer: ``cwd``
    (where the worker runs), ``notebook_dir`` (whether that is ``cwd``),
    ``home`` (the worker's ``~`` now)."""

    OP = Op.attach
    execution_count: int | None = None
    cwd: str | None = None
    home: str | None = None
    user: str | None = None


@dataclass(frozen=True, kw_only=True)
class GpuMemory(Request):
    """The ``top`` (default 10) names holding GPU memory. Answer: ``holders``,
    ``more``, ``complete``."""

    OP = Op.gpu_memory
    top: int = 10


@dataclass(frozen=True, kw_only=True)
class ForgetTraceback(Request):
    """The agent's, before a park: drop the last traceback. Answer: ``cleared``
    (its label, or None)."""

    OP = Op.forget_traceback


@dataclass(frozen=True, kw_only=True)
class ParkGpu(Request):
    """The agent's: GPU memory to host memory. Answer: ``moved``, ``kept``, ``lost``."""

    OP = Op.park_gpu


@dataclass(frozen=True, kw_only=True)
class ResumeGpu(Request):
    """The agent's: what :class:`ParkGpu` moved, back. Answer: ``moved``."""

    OP = Op.resume_gpu


@dataclass(frozen=True, kw_only=True)
class Spill(Request):
    """The agent's: the namespace into the new file ``path``. Answer:
    ``items``, ``types``, ``errors``, ``modules``, ``nbytes``."""

    OP = Op.spill
    path: str


@dataclass(frozen=True, kw_only=True)
class LoadSpill(Request):
    """The agent's: the namespace a :class:`Spill` wrote at ``path``, back. Answer: ``loaded``, ``errors``."""

    OP = Op.load_spill
    path: str


_REQUESTS: dict[str, type[Request]] = {kind.OP.value: kind for kind in (
    Push, Pull, PullAll, Fetch, Have, Versions, Attach, GpuMemory, ForgetTraceback, ParkGpu, ResumeGpu, Spill,
    LoadSpill)}


def read_request(data: dict[str, Any]) -> Request | None:
    """The request ``data`` is (None: its ``op`` is none of :class:`Op`);
    KeyError names a field it lacks."""
    kind = _REQUESTS.get(data.get("op")) if isinstance(data.get("op"), str) else None
    return kind.from_json(data) if kind is not None else None
