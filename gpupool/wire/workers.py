"""Service -> agent: start and stop a lease's worker (docs/api.md, "Agent").

The service sends a :class:`WorkerRequest` (``POST /workers``); the agent
reads it with ``from_json`` (its shape, 400 naming the field) and then checks
it against its node (its GPUs, their memory, its host, its environments). It
answers :class:`WorkerStarted` (201) or, for ``DELETE /workers/{lease_id}``,
:class:`WorkerStopped`, which the service reads with ``from_json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import bad_request
from .fields import Body, Spec, wired

_BOTH = "'lease_id' and 'owner' must be non-empty strings"
_WHOLE_BYTES = {"nullable": True, "loose": False, "error": "'{key}' must be whole bytes, got {value!r:.40}"}
#: An agent's base URL: http(s), a host, an optional path; no query, fragment, space or control character.
_AGENT_URL = "^https?://[^\\s/?#\\x00-\\x1f\\x7f]+(/[^\\s?#\\x00-\\x1f\\x7f]*)?$"


@dataclass(frozen=True)
class WorkerRequest(Body):
    """``POST /workers``: start the worker of ``lease_id`` for ``owner``.

    ``gpus``: UUIDs of the node's GPUs; ``fraction`` in (0, 1] of each;
    ``memory``: bytes on each (None: the fraction's share of the smallest
    GPU's usable memory, the agent's to work out); ``cpus`` cores and
    ``host_memory`` bytes for the worker's cgroup (None: not limited);
    ``env``: the worker environment (None: the node's default).
    ``spill_from``: a resume only, the base URL of the agent that holds the
    lease's spill (a move from another node through its disk, docs/parking.md);
    ``move_from``: a resume only, the base URL of the agent whose worker of the
    lease is parked in memory (a move worker to worker); None otherwise.
    """

    lease_id: str = wired(Spec("string", required=True, error=_BOTH))
    owner: str = wired(Spec("string", required=True, min_length=1, max_length=200, error=_BOTH))
    gpus: tuple[str, ...] = wired(Spec("array", "UUIDs of the node's GPUs", required=True,
                                       items={"type": "string"}, extra={"minItems": 1}))
    fraction: float = wired(Spec("number", "of each GPU", exclusive_minimum=0, maximum=1, default=1, loose=False,
                                 error="'fraction' must be a number in (0, 1], got {value!r}"), 1.0)
    memory: int | None = wired(Spec("integer", "bytes on each GPU (null: the fraction's share)", **_WHOLE_BYTES),
                               None)
    cpus: float | None = wired(Spec("number", "cores for the worker's cgroup (absent: not limited)", nullable=True,
                                    loose=False, error="'cpus' must be a number of cores, got {value!r:.40}"), None)
    host_memory: int | None = wired(Spec("integer", "bytes for the worker's cgroup (absent: not limited)",
                                         **_WHOLE_BYTES), None)
    env: str | None = wired(Spec("string", "the worker environment (absent: the node's default)", nullable=True,
                                 error="'env' must be the name of a worker environment, got {value!r}"), None)
    spill_from: str | None = wired(Spec(
        "string", "resume only: the base URL of the agent holding the lease's spill (a move from another "
        "node); absent otherwise", nullable=True, max_length=2048, pattern=_AGENT_URL, format="uri",
        error="'spill_from' must be the http:// or https:// base URL of a node agent, got {value!r:.80}"), None)
    move_from: str | None = wired(Spec(
        "string", "resume only: the base URL of the agent whose worker of the lease is parked in memory (a move "
        "worker to worker); absent otherwise", nullable=True, max_length=2048, pattern=_AGENT_URL, format="uri",
        error="'move_from' must be the http:// or https:// base URL of a node agent, got {value!r:.80}"), None)

    @classmethod
    def from_json(cls, body: Any) -> "WorkerRequest":
        """Validate the body's shape; 400 naming the field. Bounds that
        depend on the node are the agent's to check."""
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        values = cls.read(body, "lease_id", "owner")
        gpus = body.get("gpus")
        if not isinstance(gpus, list) or not gpus or not all(isinstance(u, str) for u in gpus):
            raise bad_request("'gpus' must be a non-empty list of GPU UUIDs")  # each item's type: code
        values |= cls.read(body, "fraction", "memory", "cpus", "host_memory", "env", "spill_from", "move_from")
        fraction = values.pop("fraction")
        return cls(**values, gpus=tuple(gpus), fraction=1.0 if fraction is None else float(fraction))

    def to_json(self) -> dict[str, Any]:
        """The body: ``memory`` always (null: the agent's default), the optional fields only when set."""
        body: dict[str, Any] = {"lease_id": self.lease_id, "owner": self.owner, "gpus": list(self.gpus),
                                "fraction": self.fraction, "memory": self.memory}
        for key in ("cpus", "host_memory", "env", "spill_from", "move_from"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        return body


@dataclass(frozen=True)
class WorkerStarted(Body):
    """The agent's 201 to ``POST /workers``: the worker's ``pid`` (None when
    the agent sent none usable) and its Jupyter ``connection`` info (``ip``,
    ``transport``, the five ports, ``signature_scheme``, ``key``; plus
    ``curve_publickey`` when the agent encrypts worker traffic)."""

    pid: int | None = wired(Spec("integer", "ignored unless an int", nullable=True, loose=False, lenient=True))
    connection: dict[str, Any] = wired(Spec("object", "Jupyter connection info", required=True))

    @classmethod
    def from_json(cls, body: Any) -> "WorkerStarted":
        """Raises ValueError without a ``connection`` object."""
        connection = body.get("connection") if isinstance(body, dict) else None
        if not isinstance(connection, dict):
            raise ValueError("the answer has no 'connection' object")
        return cls(cls.read(body, "pid")["pid"], connection)

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "connection": self.connection}


@dataclass(frozen=True)
class WorkerStopped(Body):
    """The agent's 200 to ``DELETE /workers/{lease_id}``: the worker's
    ``exit_code`` (negative: killed by that signal; None: unknown)."""

    lease_id: str = wired(Spec("string", "\"\" when not a string", lenient=True))
    exit_code: int | None = wired(Spec("integer", "negative: killed by that signal; null: unknown", nullable=True,
                                       loose=False, lenient=True))

    @classmethod
    def from_json(cls, body: Any) -> "WorkerStopped":
        """Lenient: what is not an int is an unknown exit code."""
        values = cls.read(body if isinstance(body, dict) else {})
        return cls(values["lease_id"] or "", values["exit_code"])

    def to_json(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "exit_code": self.exit_code}
