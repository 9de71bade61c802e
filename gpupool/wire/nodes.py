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
from typing import Any, ClassVar

from ..errors import bad_request
from ..schema import MAX_BYTES, MAX_CPUS, MAX_INT32, WorkerState, has_control_characters, is_unicode, number_field
from .fields import TEXT, WORDS, Body, Spec, wired
from .parking import PARK_TIERS, CheckpointerInfo

#: How an agent lists its GPUs: its ``inventory``.
INVENTORIES = ("simulated", "nvml")
#: The heartbeat interval an agent uses when the service's answer names none.
DEFAULT_HEARTBEAT_INTERVAL = 5.0
#: The optional ``inventory_error`` of a registration or heartbeat.
_INVENTORY_ERROR = Spec(
    "string", "why the agent cannot read its GPUs (NVML failed to start or stopped answering); null or absent: it "
    "can. While set the node is degraded: its GPUs are kept as last known, its leases go on, nothing new is placed "
    "there", nullable=True, min_length=1, max_length=500, pattern=WORDS,
    error="'inventory_error' must be null or words of 1 to 500 characters without control characters")
_GPU_TEXT = {"text": True, "min_length": 1, "max_length": 200}
_GPU_NAME = {"required": True, "missing": "each GPU needs 'uuid' and 'name'", **_GPU_TEXT}
#: A list an agent sends; null or absent: empty.
_LIST = {"nullable": True, "error": "'{key}' must be a list"}
_TIME = {"nullable": True, "format": "date-time", "lenient": True}
_ENV_TEXT = {"required": True, "error": "each environment needs 'name' and 'python' (strings)"}
_ENV_FLAG = "an environment's '{key}' must be true or false, got {value!r:.40}"
_STOP = Spec("array", "lease ids whose workers must stop", items={"type": "string"})
_READ_BYTES = {"nullable": True, "minimum": 0, "maximum": MAX_BYTES, "loose": False,
               "error": "'{key}' must be a whole number of bytes from 0 to 2**50"}


def _one_line(text: str) -> str:
    """``text`` with control characters as spaces and lone surrogates as U+FFFD: storable, one log line."""
    text = "".join(" " if ch < " " or ch == "\x7f" else ch for ch in text)
    return text if is_unicode(text) else text.encode("utf-8", "replace").decode("utf-8")


@dataclass(frozen=True)
class GPUInfo(Body):
    """One GPU as an agent reports it at registration.

    ``memory_total`` and ``memory_reserved`` (driver-reserved) in bytes;
    ``compute_capability`` like ``"8.0"`` or None when unknown.
    """

    #: Sent by the agent with the registration, kept by it (:attr:`NodeRegistration.unhealthy`).
    EXTRA: ClassVar[dict[str, Spec]] = {"healthy": Spec("boolean", "false: lost, or a critical Xid (absent: true)",
                                                        error="GPU {uuid}: 'healthy' must be true or false, got {value!r:.40}")}

    uuid: str = wired(Spec("string", "NVML UUID", **_GPU_NAME))
    name: str = wired(Spec("string", "e.g. NVIDIA A100-SXM4-80GB", **_GPU_NAME))
    index: int = wired(Spec("integer", required=True, minimum=0, maximum=1023,
                            error="GPU {uuid}: 'index' must be a whole number from 0 to 1023"))
    memory_total: int = wired(Spec("integer", "bytes", required=True, minimum=1, maximum=MAX_BYTES))
    memory_reserved: int = wired(Spec("integer", "bytes the driver keeps; less than memory_total", minimum=0,
                                      maximum=MAX_BYTES), 0)
    compute_capability: str | None = wired(Spec("string", "e.g. 8.0", nullable=True, **_GPU_TEXT), None)

    @classmethod
    def from_json(cls, body: Any) -> "GPUInfo":
        """Validate one GPU entry of a node registration (400 on bad input)."""
        if not isinstance(body, dict):
            raise bad_request("each GPU must be a JSON object")
        for key in ("uuid", "name"):  # a bad uuid or name is told before a missing one
            if body.get(key) is not None:
                cls.read(body, key)
        texts = cls.read(body, "uuid", "name")
        uuid = texts["uuid"]
        index = cls.read(body, "index", uuid=uuid)["index"]
        # Two limits in one sentence, the second relative to the first: code, not specs.
        total = number_field(body, "memory_total", required=True)
        reserved = number_field(body, "memory_reserved") or 0
        if not 0 < total <= MAX_BYTES or reserved < 0 or reserved >= total:
            raise bad_request(f"GPU {uuid}: memory_total must be bytes in (0, 2**50] and memory_reserved in "
                              "[0, memory_total)")
        for key in ("memory_total", "memory_reserved"):
            if isinstance(body.get(key), float) and not body[key].is_integer():
                raise bad_request(f"GPU {uuid}: '{key}' must be whole bytes, got {body[key]!r:.40}")
        if "healthy" in body:
            cls.EXTRA["healthy"].read(body, "healthy", {"uuid": uuid})
        return cls(uuid=uuid, name=texts["name"], index=index, memory_total=int(total),
                   memory_reserved=int(reserved), **cls.read(body, "compute_capability"))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


#: The most ended cells one worker report is read for.
MAX_CELLS = 64


def _cell_pairs(value: Any) -> tuple[tuple[str, str], ...]:
    """The ``[start, end]`` string pairs of a report's ``cells`` (the first :data:`MAX_CELLS`); others dropped."""
    pairs = value[:MAX_CELLS] if isinstance(value, list) else []
    return tuple((pair[0], pair[1]) for pair in pairs
                 if isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair))


@dataclass
class WorkerReport(Body):
    """One worker as the agent reports it in a node heartbeat.

    ``execution_state`` (:class:`~gpupool.schema.WorkerState`) is the kernel's
    last IOPub status (``starting``, ``idle``, ``busy``) or ``dead``; ``idle_since`` the ISO time the last
    cell ended (None while busy); ``exit_code`` once dead (negative: signal);
    ``reason`` the agent's words for a death it caused (e.g. it was stopped);
    ``cell_started`` the ISO time the last cell started (None: none yet; an agent
    before it sends none) and ``cells`` the ``[start, end]`` ISO times of the last
    cells that ended (oldest first; unreadable pairs are dropped), which the
    service records as the lease's cell activity. ``parked``: the tier of a
    parked worker (:data:`~.parking.PARK_TIERS`; None while it holds its GPU
    share), ``parked_host_bytes`` the host RAM it holds then, ``parked_disk_bytes`` the
    disk a spilled one takes, and ``parked_lost``
    what a spill the agent made on its own could not keep, in words.
    """

    lease_id: str = wired(Spec("string", required=True, text=True, min_length=1, max_length=40,
                               error="each worker report needs a 'lease_id' (at most 40 characters)"))
    pid: int | None = wired(Spec("integer", "ignored unless 0 to 2**31-1", nullable=True, minimum=0,
                                 maximum=MAX_INT32, loose=False, lenient=True))
    execution_state: WorkerState = wired(Spec("", required=True, enum=tuple(s.value for s in WorkerState),
                                      error="execution_state must be one of {choices}"))
    idle_since: str | None = wired(Spec("string", **_TIME), None)
    exit_code: int | None = wired(Spec("integer", "negative: killed by that signal", nullable=True,
                                       minimum=-MAX_INT32, maximum=MAX_INT32, loose=False, lenient=True), None)
    memory_used: int | None = wired(Spec("integer", "bytes; ignored unless 0 to 2**50", nullable=True, minimum=0,
                                         maximum=MAX_BYTES, loose=False, lenient=True), None)
    reason: str | None = wired(Spec("string", "cut to 200 characters, one line", nullable=True, lenient=True), None)
    cell_started: str | None = wired(Spec("string", **_TIME), None)
    cells: tuple[tuple[str, str], ...] = wired(Spec("array", "the last cells that ended: [start, end] times; "
                                                    f"at most {MAX_CELLS} read", nullable=True, lenient=True,
                                                    items={"type": "array", "items": {"type": "string"},
                                                           "minItems": 2, "maxItems": 2}), ())
    parked: str | None = wired(Spec("", "the tier of a parked worker (null: not parked)", nullable=True,
                                    enum=PARK_TIERS, lenient=True), None)
    parked_host_bytes: int | None = wired(Spec("integer", "host RAM a parked worker holds", nullable=True, minimum=0,
                                               maximum=MAX_BYTES, loose=False, lenient=True), None)
    parked_disk_bytes: int | None = wired(Spec("integer", "bytes a spilled worker's namespace takes on disk",
                                               nullable=True, minimum=0, maximum=MAX_BYTES, loose=False,
                                               lenient=True), None)
    parked_lost: tuple[str, ...] = wired(Spec("array", "what a spill could not keep, in words", nullable=True,
                                              lenient=True, items={"type": "string"}), ())

    @classmethod
    def from_json(cls, body: Any) -> "WorkerReport":
        """Validate one worker entry of a heartbeat (400 on bad input)."""
        values = cls.read(body if isinstance(body, dict) else {})
        reason = values["reason"]
        values["reason"] = _one_line(reason[:200]) if reason and reason.strip() else None
        values["cells"] = _cell_pairs(values["cells"])
        values["execution_state"] = WorkerState(values["execution_state"])
        lost = values["parked_lost"]
        values["parked_lost"] = tuple(_one_line(v[:300]) for v in lost if isinstance(v, str)) if lost else ()
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"parked_lost": list(self.parked_lost)}


@dataclass(frozen=True)
class GPUReading(Body):
    """One GPU's readings in a heartbeat: ``memory_used`` bytes, ``utilization``
    percent (0-100), ``healthy`` (False: lost, or a critical Xid), and
    ``memory_unattributed`` bytes used by processes of no worker; None: unknown
    (``healthy`` and ``memory_unattributed`` are then left out of the body)."""

    uuid: str = wired(Spec("string", required=True, error="each GPU reading needs a 'uuid'"))
    memory_used: int | None = wired(Spec("integer", "bytes", **_READ_BYTES), None)
    utilization: float | None = wired(Spec("number", "percent", nullable=True, minimum=0, maximum=100, loose=False,
                                           error="'utilization' must be a percentage from 0 to 100"), None)
    healthy: bool | None = wired(Spec("boolean", "false: lost, or a critical Xid", nullable=True,
                                      error="'healthy' must be true or false"), None)
    memory_unattributed: int | None = wired(Spec("integer", "bytes used by processes of no worker",
                                                 **_READ_BYTES), None)

    @classmethod
    def from_json(cls, value: Any) -> "GPUReading":
        """Validate one GPU reading of a heartbeat (400 on bad input)."""
        values = cls.read(value if isinstance(value, dict) else {}, "uuid", "memory_used", "memory_unattributed",
                          "utilization", "healthy")
        util = values["utilization"]
        return cls(**values | {"utilization": None if util is None else float(util)})

    @classmethod
    def of(cls, reading: dict[str, Any]) -> "GPUReading":
        """The agent's own reading (:meth:`~gpupool.node.inventory.base.Inventory.metrics`), taken as it is."""
        return cls(**{key: reading[key] for key in cls.__dataclass_fields__ if key in reading})

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"uuid": self.uuid, "memory_used": self.memory_used, "utilization": self.utilization}
        if self.healthy is not None:
            body["healthy"] = self.healthy
        if self.memory_unattributed is not None:
            body["memory_unattributed"] = self.memory_unattributed
        return body


@dataclass(frozen=True)
class WorkerEnvironment(Body):
    """One worker environment as the agent checked it (``c.AgentWorkers.environments``):
    its ``name``, the ``python`` it runs, whether it is the node's ``default``,
    whether it is ``usable``, and the ``problem`` when it is not."""

    name: str = wired(Spec("string", "cut to 100 characters", **_ENV_TEXT))
    python: str = wired(Spec("string", "cut to 500 characters", **_ENV_TEXT))
    default: bool = wired(Spec("boolean", "absent: false", nullable=True, error=_ENV_FLAG), False)
    usable: bool = wired(Spec("boolean", "absent: false", nullable=True, error=_ENV_FLAG), False)
    problem: str | None = wired(Spec("string", "cut to 500 characters", nullable=True,
                                     error="an environment's 'problem' must be words or null"), None)

    @classmethod
    def from_json(cls, env: Any) -> "WorkerEnvironment":
        """One entry of a registration's ``environments``, cut to its bounds (400 without name or python, or with
        a flag that is not true, false or null)."""
        values = cls.read(env if isinstance(env, dict) else {})
        problem = values["problem"]
        return cls(values["name"][:100], values["python"][:500], values["default"] is True, values["usable"] is True,
                   None if problem is None else problem[:500])

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NodeRegistration(Body):
    """``POST /nodes``: the agent's node, at its start and after the service forgot it.

    ``name`` (1 to 200 characters, no ``/``), ``url`` the agent's http(s) API,
    ``inventory`` one of :data:`INVENTORIES`, ``enforcement`` the mode's name
    (shown, never placed by) and ``whole_gpus`` its capacity rule (placed by;
    absent: false, the GPUs are shared), its ``gpus`` (``unhealthy``:
    UUIDs of those sent with ``"healthy": false``), the lease ``workers`` it
    runs, ``inventory_error`` (why it cannot read its GPUs; None: it can),
    ``environments`` (None: not reported), and ``host_cpus`` cores and
    ``host_memory`` bytes leases may take (both or neither; None: not reported),
    the ``checkpointer`` it parks workers with (None: it cannot park in place,
    an agent from before parking) and ``parked_memory``, the bytes of host RAM
    its parked workers may hold before it spills the longest-parked to disk
    (``c.AgentParking.parked_memory``; None: not reported).
    """

    name: str = wired(Spec("string", "no '/', control characters or surrounding spaces", required=True,
                           min_length=1, max_length=200, pattern="^[^/\\x00-\\x1f\\x7f]+$"))
    url: str = wired(Spec("string", "the agent's http(s) API", required=True, max_length=500, format="uri"))
    inventory: str = wired(Spec("", required=True, enum=INVENTORIES))
    enforcement: str | None = wired(Spec("string", "the mode's name (shown)", nullable=True, min_length=1,
                                         max_length=50, pattern=f"^{TEXT}*$",
                                         error="'enforcement' must be a string of at most 50 characters"), None)
    whole_gpus: bool = wired(Spec("boolean", "whole GPUs only: the enforcement mode's capacity rule (absent: false)",
                                  nullable=True, error="'whole_gpus' must be true or false, got {value!r:.40}"),
                             False)
    gpus: tuple[GPUInfo, ...] = wired(Spec("array", required=True, items=GPUInfo, error="'{key}' must be a list"),
                                      ())
    workers: tuple[WorkerReport, ...] = wired(Spec("array", items=WorkerReport, **_LIST), ())
    inventory_error: str | None = wired(_INVENTORY_ERROR, None)
    environments: tuple[WorkerEnvironment, ...] | None = wired(Spec(
        "array", "null or absent: not reported", nullable=True, max_items=100, items=WorkerEnvironment,
        error="'environments' must be a list of at most 100 worker environments"), None)
    host_cpus: float | None = wired(Spec("number", "cores leases may take; with host_memory or neither",
                                         nullable=True, exclusive_minimum=0, maximum=MAX_CPUS), None)
    host_memory: int | None = wired(Spec("integer", "bytes leases may take; with host_cpus or neither",
                                         nullable=True, exclusive_minimum=0, maximum=MAX_BYTES), None)
    unhealthy: frozenset[str] = frozenset()
    checkpointer: CheckpointerInfo | None = wired(Spec(
        "object", "how the agent parks workers in place; null or absent: it cannot", nullable=True,
        extra={"$ref": "#/components/schemas/CheckpointerInfo"}), None)
    parked_memory: int | None = wired(Spec("integer", "host bytes parked workers may hold before spilling",
                                           nullable=True, minimum=0, maximum=MAX_BYTES, loose=False,
                                           error="'parked_memory' must be whole bytes from 0 to 2**50, "
                                                 "got {value!r:.40}"), None)

    @classmethod
    def from_json(cls, body: Any) -> "NodeRegistration":
        """Validate a registration body; 400 naming the field."""
        if not isinstance(body, dict):
            raise bad_request("the registration body must be a JSON object")
        name, url = _name(body.get("name")), _url(body.get("url"))
        values = cls.read(body, "inventory", "enforcement", "whole_gpus")
        whole = bool(values["whole_gpus"])
        entries = cls.read(body, "gpus")["gpus"]
        gpus = tuple(GPUInfo.from_json(g) for g in entries)
        if len({g.uuid for g in gpus}) != len(gpus):
            raise bad_request("each GPU 'uuid' must appear once")
        workers = tuple(WorkerReport.from_json(w) for w in cls.read(body, "workers")["workers"] or ())
        values |= cls.read(body, "inventory_error", "environments")
        environments = values["environments"]
        envs = None if environments is None else tuple(WorkerEnvironment.from_json(e) for e in environments)
        cpus, memory = _host(body)
        checkpointer = body.get("checkpointer")
        return cls(name, url, values["inventory"], values["enforcement"], whole, gpus, workers,
                   values["inventory_error"], envs, cpus, memory,
                   frozenset(g["uuid"] for g in entries if g.get("healthy") is False),
                   checkpointer=None if checkpointer is None else CheckpointerInfo.from_json(checkpointer),
                   parked_memory=cls.read(body, "parked_memory")["parked_memory"])

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
                "host_cpus": self.host_cpus, "host_memory": self.host_memory,
                "checkpointer": None if self.checkpointer is None else self.checkpointer.to_json(),
                "parked_memory": self.parked_memory}


@dataclass(frozen=True)
class Heartbeat(Body):
    """``POST /nodes/{name}/heartbeat``: the agent's lease ``workers``, its
    ``gpus``' readings and its ``inventory_error`` (None: it reads its GPUs);
    ``leaving``: True in the last heartbeat of an agent that is stopping
    cleanly, so the service places nothing more there at once."""

    workers: tuple[WorkerReport, ...] = wired(Spec("array", items=WorkerReport, **_LIST), ())
    gpus: tuple[GPUReading, ...] = wired(Spec("array", items=GPUReading, **_LIST), ())
    inventory_error: str | None = wired(_INVENTORY_ERROR, None)
    leaving: bool = wired(Spec("boolean", "true: the agent is stopping; the node is lost at once (absent: false)",
                               nullable=True, error="'leaving' must be true or false, got {value!r:.40}"), False)

    @classmethod
    def from_json(cls, body: Any) -> "Heartbeat":
        """Validate a heartbeat body; 400 naming the field."""
        if not isinstance(body, dict):
            raise bad_request("the heartbeat body must be a JSON object")
        workers = tuple(WorkerReport.from_json(w) for w in cls.read(body, "workers")["workers"] or ())
        gpus = tuple(GPUReading.from_json(g) for g in cls.read(body, "gpus")["gpus"] or ())
        values = cls.read(body, "inventory_error", "leaving")
        return cls(workers, gpus, values["inventory_error"], values["leaving"] is True)

    def to_json(self) -> dict[str, Any]:
        body = {"workers": [w.to_json() for w in self.workers], "gpus": [g.to_json() for g in self.gpus],
                "inventory_error": self.inventory_error}
        return body | {"leaving": True} if self.leaving else body


@dataclass(frozen=True)
class HeartbeatReply(Body):
    """The service's answer to a heartbeat: ``stop``, the lease ids whose
    workers no lease holds (the agent stops them)."""

    stop: tuple[str, ...] = wired(_STOP, ())

    @classmethod
    def from_json(cls, body: Any) -> "HeartbeatReply":
        """Lenient, for the agent: what is not a list of strings stops nothing."""
        return cls(_lease_ids(body.get("stop") if isinstance(body, dict) else None))

    def to_json(self) -> dict[str, Any]:
        return {"stop": list(self.stop)}


@dataclass(frozen=True)
class RegistrationReply(Body):
    """The service's answer to a registration: the node's ``name``, the
    ``heartbeat_interval`` seconds the agent beats at, and ``stop`` (as in
    :class:`HeartbeatReply`)."""

    name: str = wired(Spec("string"))
    heartbeat_interval: float = wired(Spec("number", "seconds"), DEFAULT_HEARTBEAT_INTERVAL)
    stop: tuple[str, ...] = wired(_STOP, ())

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
