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


@dataclass(frozen=True)
class WorkerRequest:
    """``POST /workers``: start the worker of ``lease_id`` for ``owner``.

    ``gpus``: UUIDs of the node's GPUs; ``fraction`` in (0, 1] of each;
    ``memory``: bytes on each (None: the fraction's share of the smallest
    GPU's usable memory, the agent's to work out); ``cpus`` cores and
    ``host_memory`` bytes for the worker's cgroup (None: not limited);
    ``env``: the worker environment (None: the node's default).
    """

    lease_id: str
    owner: str
    gpus: tuple[str, ...]
    fraction: float = 1.0
    memory: int | None = None
    cpus: float | None = None
    host_memory: int | None = None
    env: str | None = None

    @classmethod
    def from_json(cls, body: Any) -> "WorkerRequest":
        """Validate the body's shape; 400 naming the field. Bounds that
        depend on the node are the agent's to check."""
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        lease_id, owner = body.get("lease_id"), body.get("owner")
        if not isinstance(lease_id, str) or not isinstance(owner, str) or not owner or len(owner) > 200:
            raise bad_request("'lease_id' and 'owner' must be non-empty strings")
        gpus = body.get("gpus")
        if not isinstance(gpus, list) or not gpus or not all(isinstance(u, str) for u in gpus):
            raise bad_request("'gpus' must be a non-empty list of GPU UUIDs")
        fraction = body.get("fraction", 1.0)
        if not _is_number(fraction) or not 0 < fraction <= 1:
            raise bad_request(f"'fraction' must be a number in (0, 1], got {fraction!r}")
        memory, cpus, host_memory = body.get("memory"), body.get("cpus"), body.get("host_memory")
        if memory is not None and not _is_whole(memory):
            raise bad_request(f"'memory' must be whole bytes, got {memory!r:.40}")
        if cpus is not None and not _is_number(cpus):
            raise bad_request(f"'cpus' must be a number of cores, got {cpus!r:.40}")
        if host_memory is not None and not _is_whole(host_memory):
            raise bad_request(f"'host_memory' must be whole bytes, got {host_memory!r:.40}")
        env = body.get("env")
        if env is not None and not isinstance(env, str):
            raise bad_request(f"'env' must be the name of a worker environment, got {env!r}")
        return cls(lease_id, owner, tuple(gpus), float(fraction), memory, cpus, host_memory, env)

    def to_json(self) -> dict[str, Any]:
        """The body: ``memory`` always (null: the agent's default), the optional fields only when set."""
        body: dict[str, Any] = {"lease_id": self.lease_id, "owner": self.owner, "gpus": list(self.gpus),
                                "fraction": self.fraction, "memory": self.memory}
        for key in ("cpus", "host_memory", "env"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        return body


@dataclass(frozen=True)
class WorkerStarted:
    """The agent's 201 to ``POST /workers``: the worker's ``pid`` (None when
    the agent sent none usable) and its Jupyter ``connection`` info (``ip``,
    ``transport``, the five ports, ``signature_scheme``, ``key``; plus
    ``curve_publickey`` when the agent encrypts worker traffic)."""

    pid: int | None
    connection: dict[str, Any]

    @classmethod
    def from_json(cls, body: Any) -> "WorkerStarted":
        """Raises ValueError without a ``connection`` object."""
        connection = body.get("connection") if isinstance(body, dict) else None
        if not isinstance(connection, dict):
            raise ValueError("the answer has no 'connection' object")
        pid = body.get("pid")
        return cls(pid if _is_whole(pid) else None, connection)

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "connection": self.connection}


@dataclass(frozen=True)
class WorkerStopped:
    """The agent's 200 to ``DELETE /workers/{lease_id}``: the worker's
    ``exit_code`` (negative: killed by that signal; None: unknown)."""

    lease_id: str
    exit_code: int | None

    @classmethod
    def from_json(cls, body: Any) -> "WorkerStopped":
        """Lenient: what is not an int is an unknown exit code."""
        body = body if isinstance(body, dict) else {}
        lease_id, code = body.get("lease_id"), body.get("exit_code")
        return cls(lease_id if isinstance(lease_id, str) else "", code if _is_whole(code) else None)

    def to_json(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "exit_code": self.exit_code}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
