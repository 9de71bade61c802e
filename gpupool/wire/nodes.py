"""Agent -> service: node registration and heartbeat (docs/api.md, "Nodes").

The agent builds a :class:`NodeRegistration` or :class:`Heartbeat` and sends
its ``to_json()``; the service reads it with ``from_json`` (400 naming the
field, nothing changed). The service answers :class:`RegistrationReply` and
:class:`HeartbeatReply`, which the agent reads leniently (an answer it cannot
use is as if empty).
"""

from __future__ import annotations

import urllib.parse
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import bad_request
from ..schema import (MAX_BYTES, MAX_CPUS, MAX_INT32, has_control_characters, is_unicode, number_field,
                      text_field)

#: How an agent lists its GPUs: its ``inventory``.
INVENTORIES = ("simulated", "nvml")
#: What agents that send no ``whole_gpus`` (older than that field) meant by their mode's name.
LEGACY_WHOLE_GPU_MODES = ("mig", "exclusive")
#: The heartbeat interval an agent uses when the service's answer names none.
DEFAULT_HEARTBEAT_INTERVAL = 5.0


def _one_line(text: str) -> str:
    """``text`` with control characters as spaces and lone surrogates as U+FFFD: storable, one log line."""
    text = "".join(" " if ch < " " or ch == "\x7f" else ch for ch in text)
    return text if is_unicode(text) else text.encode("utf-8", "replace").decode("utf-8")


def _whole(value: Any, lo: int, hi: int) -> int | None:
    """``value`` when it is an int (not a bool) within ``[lo, hi]``, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi else None


def _list(body: dict[str, Any], key: str, *, required: bool = False) -> list[Any]:
    value = body.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list):
        raise bad_request(f"'{key}' must be a list")
    return value


@dataclass(frozen=True)
class GPUInfo:
    """One GPU as an agent reports it at registration.

    ``memory_total`` and ``memory_reserved`` (driver-reserved) in bytes;
    ``compute_capability`` like ``"8.0"`` or None when unknown.
    """

    uuid: str
    name: str
    index: int
    memory_total: int
    memory_reserved: int = 0
    compute_capability: str | None = None

    @classmethod
    def from_json(cls, body: Any) -> "GPUInfo":
        """Validate one GPU entry of a node registration (400 on bad input)."""
        if not isinstance(body, dict):
            raise bad_request("each GPU must be a JSON object")
        uuid, name = text_field(body, "uuid"), text_field(body, "name")
        if not uuid or not name:
            raise bad_request("each GPU needs 'uuid' and 'name'")
        index = number_field(body, "index", required=True)
        if index != int(index) or not 0 <= index <= 1023:
            raise bad_request(f"GPU {uuid}: 'index' must be a whole number from 0 to 1023")
        total = number_field(body, "memory_total", required=True)
        reserved = number_field(body, "memory_reserved") or 0
        if not 0 < total <= MAX_BYTES or reserved < 0 or reserved >= total:
            raise bad_request(f"GPU {uuid}: memory_total must be bytes in (0, 2**50] and memory_reserved in "
                              "[0, memory_total)")
        return cls(uuid=uuid, name=name, index=int(index), memory_total=int(total),
                   memory_reserved=int(reserved), compute_capability=text_field(body, "compute_capability"))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class WorkerReport:
    """One worker as the agent reports it in a node heartbeat.

    ``execution_state`` is the kernel's last IOPub status (``starting``,
    ``idle``, ``busy``) or ``dead``; ``idle_since`` the ISO time the last
    cell ended (None while busy); ``exit_code`` once dead (negative: signal);
    ``reason`` the agent's words for a death it caused (e.g. it was stopped).
    """

    lease_id: str
    pid: int | None
    execution_state: str
    idle_since: str | None = None
    exit_code: int | None = None
    memory_used: int | None = None
    reason: str | None = None

    STATES = ("starting", "idle", "busy", "dead")

    @classmethod
    def from_json(cls, body: Any) -> "WorkerReport":
        """Validate one worker entry of a heartbeat (400 on bad input)."""
        lease_id = body.get("lease_id") if isinstance(body, dict) else None
        if (not isinstance(lease_id, str) or not 0 < len(lease_id) <= 40 or has_control_characters(lease_id)
                or not is_unicode(lease_id)):
            raise bad_request("each worker report needs a 'lease_id' (at most 40 characters)")
        state = body.get("execution_state")
        if state not in cls.STATES:
            raise bad_request(f"execution_state must be one of {', '.join(cls.STATES)}")
        idle_since = body.get("idle_since")
        reason = body.get("reason")
        return cls(lease_id=lease_id, pid=_whole(body.get("pid"), 0, MAX_INT32),
                   execution_state=state, idle_since=idle_since if isinstance(idle_since, str) else None,
                   exit_code=_whole(body.get("exit_code"), -MAX_INT32, MAX_INT32),
                   memory_used=_whole(body.get("memory_used"), 0, MAX_BYTES),
                   reason=_one_line(reason[:200]) if isinstance(reason, str) and reason.strip() else None)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GPUReading:
    """One GPU's readings in a heartbeat: ``memory_used`` bytes, ``utilization``
    percent (0-100), ``healthy`` (False: lost, or a critical Xid), and
    ``memory_unattributed`` bytes used by processes of no worker; None: unknown
    (``healthy`` and ``memory_unattributed`` are then left out of the body)."""

    uuid: str
    memory_used: int | None = None
    utilization: float | None = None
    healthy: bool | None = None
    memory_unattributed: int | None = None

    @classmethod
    def from_json(cls, value: Any) -> "GPUReading":
        """Validate one GPU reading of a heartbeat (400 on bad input)."""
        if not isinstance(value, dict) or not isinstance(value.get("uuid"), str):
            raise bad_request("each GPU reading needs a 'uuid'")
        used, util, healthy = value.get("memory_used"), value.get("utilization"), value.get("healthy")
        unattributed = value.get("memory_unattributed")
        for key, number in (("memory_used", used), ("memory_unattributed", unattributed)):
            if number is not None and (isinstance(number, bool) or not isinstance(number, int)
                                       or not 0 <= number <= MAX_BYTES):
                raise bad_request(f"'{key}' must be a whole number of bytes from 0 to 2**50")
        if util is not None and (isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 <= util <= 100):
            raise bad_request("'utilization' must be a percentage from 0 to 100")
        if healthy is not None and not isinstance(healthy, bool):
            raise bad_request("'healthy' must be true or false")
        return cls(value["uuid"], used, None if util is None else float(util), healthy, unattributed)

    @classmethod
    def of(cls, reading: dict[str, Any]) -> "GPUReading":
        """The agent's own reading (:meth:`~gpupool.provisioner.inventory.base.Inventory.metrics`), taken as it is."""
        return cls(**{key: reading[key] for key in cls.__dataclass_fields__ if key in reading})

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"uuid": self.uuid, "memory_used": self.memory_used, "utilization": self.utilization}
        if self.healthy is not None:
            body["healthy"] = self.healthy
        if self.memory_unattributed is not None:
            body["memory_unattributed"] = self.memory_unattributed
        return body


@dataclass(frozen=True)
class WorkerEnvironment:
    """One worker environment as the agent checked it (``c.NodeAgent.environments``):
    its ``name``, the ``python`` it runs, whether it is the node's ``default``,
    whether it is ``usable``, and the ``problem`` when it is not."""

    name: str
    python: str
    default: bool = False
    usable: bool = False
    problem: str | None = None

    @classmethod
    def from_json(cls, env: Any) -> "WorkerEnvironment":
        """One entry of a registration's ``environments``, cut to its bounds (400 without name or python)."""
        if not isinstance(env, dict) or not isinstance(env.get("name"), str) or not isinstance(env.get("python"), str):
            raise bad_request("each environment needs 'name' and 'python' (strings)")
        problem = env.get("problem")
        if problem is not None and not isinstance(problem, str):
            raise bad_request("an environment's 'problem' must be words or null")
        return cls(env["name"][:100], env["python"][:500], env.get("default") is True, env.get("usable") is True,
                   None if problem is None else problem[:500])

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NodeRegistration:
    """``POST /nodes``: the agent's node, at its start and after the service forgot it.

    ``name`` (1 to 200 characters, no ``/``), ``url`` the agent's http(s) API,
    ``inventory`` one of :data:`INVENTORIES`, ``enforcement`` the mode's name
    (shown) and ``whole_gpus`` its capacity rule (placed by; absent from older
    agents: true for :data:`LEGACY_WHOLE_GPU_MODES`), its ``gpus`` (``unhealthy``:
    UUIDs of those sent with ``"healthy": false``), the lease ``workers`` it
    runs, ``inventory_error`` (why it cannot read its GPUs; None: it can),
    ``environments`` (None: not reported), and ``host_cpus`` cores and
    ``host_memory`` bytes leases may take (both or neither; None: not reported).
    """

    name: str
    url: str
    inventory: str
    enforcement: str | None = None
    whole_gpus: bool = False
    gpus: tuple[GPUInfo, ...] = ()
    workers: tuple[WorkerReport, ...] = ()
    inventory_error: str | None = None
    environments: tuple[WorkerEnvironment, ...] | None = None
    host_cpus: float | None = None
    host_memory: int | None = None
    unhealthy: frozenset[str] = frozenset()

    @classmethod
    def from_json(cls, body: Any) -> "NodeRegistration":
        """Validate a registration body; 400 naming the field."""
        if not isinstance(body, dict):
            raise bad_request("the registration body must be a JSON object")
        name, url = _name(body.get("name")), _url(body.get("url"))
        inventory = body.get("inventory")
        if inventory not in INVENTORIES:
            raise bad_request(f"'inventory' must be one of {', '.join(INVENTORIES)}, got {inventory!r:.80}")
        enforcement, whole = _enforcement(body)
        entries = _list(body, "gpus", required=True)
        gpus = tuple(GPUInfo.from_json(g) for g in entries)
        if len({g.uuid for g in gpus}) != len(gpus):
            raise bad_request("each GPU 'uuid' must appear once")
        workers = tuple(WorkerReport.from_json(w) for w in _list(body, "workers"))
        error = inventory_error(body)
        environments = body.get("environments")
        if environments is not None and (not isinstance(environments, list) or len(environments) > 100):
            raise bad_request("'environments' must be a list of at most 100 worker environments")
        envs = None if environments is None else tuple(WorkerEnvironment.from_json(e) for e in environments)
        cpus, memory = _host(body)
        return cls(name, url, inventory, enforcement, whole, gpus, workers, error, envs, cpus, memory,
                   frozenset(g["uuid"] for g in entries if g.get("healthy") is False))

    @property
    def healthy(self) -> dict[str, bool]:
        """GPU UUID -> whether the agent did not call it unhealthy."""
        return {gpu.uuid: gpu.uuid not in self.unhealthy for gpu in self.gpus}

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "inventory": self.inventory, "enforcement": self.enforcement,
                "whole_gpus": self.whole_gpus,
                "gpus": [gpu.to_json() | ({"healthy": False} if gpu.uuid in self.unhealthy else {})
                         for gpu in self.gpus],
                "workers": [w.to_json() for w in self.workers], "inventory_error": self.inventory_error,
                "environments": None if self.environments is None else [e.to_json() for e in self.environments],
                "host_cpus": self.host_cpus, "host_memory": self.host_memory}


@dataclass(frozen=True)
class Heartbeat:
    """``POST /nodes/{name}/heartbeat``: the agent's lease ``workers``, its
    ``gpus``' readings and its ``inventory_error`` (None: it reads its GPUs)."""

    workers: tuple[WorkerReport, ...] = ()
    gpus: tuple[GPUReading, ...] = ()
    inventory_error: str | None = None

    @classmethod
    def from_json(cls, body: Any) -> "Heartbeat":
        """Validate a heartbeat body; 400 naming the field."""
        if not isinstance(body, dict):
            raise bad_request("the heartbeat body must be a JSON object")
        return cls(tuple(WorkerReport.from_json(w) for w in _list(body, "workers")),
                   tuple(GPUReading.from_json(g) for g in _list(body, "gpus")), inventory_error(body))

    def to_json(self) -> dict[str, Any]:
        return {"workers": [w.to_json() for w in self.workers], "gpus": [g.to_json() for g in self.gpus],
                "inventory_error": self.inventory_error}


@dataclass(frozen=True)
class HeartbeatReply:
    """The service's answer to a heartbeat: ``stop``, the lease ids whose
    workers no lease holds (the agent stops them)."""

    stop: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, body: Any) -> "HeartbeatReply":
        """Lenient, for the agent: what is not a list of strings stops nothing."""
        return cls(_lease_ids(body.get("stop") if isinstance(body, dict) else None))

    def to_json(self) -> dict[str, Any]:
        return {"stop": list(self.stop)}


@dataclass(frozen=True)
class RegistrationReply:
    """The service's answer to a registration: the node's ``name``, the
    ``heartbeat_interval`` seconds the agent beats at, and ``stop`` (as in
    :class:`HeartbeatReply`)."""

    name: str
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    stop: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, body: Any) -> "RegistrationReply":
        """Lenient, for the agent: a missing or non-positive interval is
        :data:`DEFAULT_HEARTBEAT_INTERVAL`."""
        body = body if isinstance(body, dict) else {}
        interval = body.get("heartbeat_interval")
        interval = float(interval) if isinstance(interval, (int, float)) and interval > 0 else DEFAULT_HEARTBEAT_INTERVAL
        name = body.get("name")
        return cls(name if isinstance(name, str) else "", interval, _lease_ids(body.get("stop")))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "heartbeat_interval": self.heartbeat_interval, "stop": list(self.stop)}


def _lease_ids(value: Any) -> tuple[str, ...]:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


def is_node_name(value: Any) -> bool:
    """Whether ``value`` can name a node: 1 to 200 characters, no ``/``,
    control characters or surrounding spaces."""
    return (isinstance(value, str) and 0 < len(value) <= 200 and "/" not in value and value == value.strip()
            and not has_control_characters(value) and is_unicode(value))


def _name(value: Any) -> str:
    if not is_node_name(value):
        raise bad_request("'name' must be a node name of 1 to 200 characters without '/', control characters "
                          "or surrounding spaces")
    return value


def _url(value: Any) -> str:
    try:
        parsed = urllib.parse.urlparse(value) if isinstance(value, str) and not has_control_characters(value) else None
    except ValueError:  # e.g. "http://[::1" (an unclosed IPv6 address)
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc or len(value) > 500:
        raise bad_request(f"'url' must be the agent's http(s) URL, like http://10.0.0.5:8766, got {value!r:.80}")
    return value.rstrip("/")


def _enforcement(body: dict[str, Any]) -> tuple[str | None, bool]:
    """``(mode name, whole GPUs only)`` of a registration: the agent's
    ``enforcement`` (the name, shown) and ``whole_gpus`` (its capacity rule,
    placed by; absent from older agents, whose built-in names say it)."""
    name, whole = body.get("enforcement"), body.get("whole_gpus")
    if name is not None and (not isinstance(name, str) or not 0 < len(name) <= 50 or has_control_characters(name)):
        raise bad_request("'enforcement' must be a string of at most 50 characters")
    if whole is None:
        return name, name in LEGACY_WHOLE_GPU_MODES
    if not isinstance(whole, bool):
        raise bad_request(f"'whole_gpus' must be true or false, got {whole!r:.40}")
    return name, whole


def inventory_error(body: dict[str, Any]) -> str | None:
    """The optional ``inventory_error`` of a registration or heartbeat: why the
    agent cannot read its GPUs (null: it can)."""
    value = body.get("inventory_error")
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 500 or not value.strip()
                              or has_control_characters(value)):
        raise bad_request("'inventory_error' must be null or words of 1 to 500 characters without control characters")
    return value


def _host(body: dict[str, Any]) -> tuple[float | None, int | None]:
    """The optional ``host_cpus`` (cores) and ``host_memory`` (bytes) of a
    registration, both or neither ((None, None): not reported)."""
    cpus, memory = body.get("host_cpus"), body.get("host_memory")
    if cpus is None and memory is None:
        return None, None
    if (isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not 0 < cpus <= MAX_CPUS
            or isinstance(memory, bool) or not isinstance(memory, int) or not 0 < memory <= MAX_BYTES):
        raise bad_request(f"'host_cpus' (cores in (0, {MAX_CPUS}]) and 'host_memory' (bytes in (0, 2**50]) go "
                          f"together, got {cpus!r:.40} and {memory!r:.40}")
    return float(cpus), memory
