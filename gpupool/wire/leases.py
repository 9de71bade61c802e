"""The client's bodies: the lease request (``POST /api/v1/leases``) and the
lease (every answer about one), shared by the service, the magic and the CLI
(docs/api.md, "Leases"). Each field is declared once (:mod:`.fields`): its
checks and the JSON Schema of ``/api/v1/openapi.json`` come from it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from ..errors import bad_request
from ..leaseclasses import default as default_class
from ..schema import (ENV_NAME, LEASE_CLASSES, MAX_BYTES, MAX_CPUS, MAX_GPU_COUNT, MIN_CPUS, MIN_FRACTION, MIN_MEMORY,
                      ON_IDLE, LeaseState, number_field)
from .fields import Body, Spec, wired

#: The shortest idle timeout a request may name, seconds: a shorter one would park between two cells run
#: one after the other (and race the next one).
MIN_IDLE_TIMEOUT = 1.0
#: The longest wait and idle timeout any request may name, seconds (366 days).
MOST_SECONDS = 366 * 86400


def _fraction_words(value: Any) -> str:
    if 0 < value <= 1:  # in range, but less than the smallest share
        return (f"'fraction' must be at least {MIN_FRACTION} (1% of a GPU, the smallest CUDA MPS share), "
                f"got {value!r}")
    return f"'fraction' must be in (0, 1], got {value!r}; ask for whole GPUs with 'gpu_count'"


def _bytes(key: str, words: str, *, more_than_zero: str = "") -> Spec:
    """A byte count a request may name: whole, 1 MiB to 2**50. A whole number of bytes from 1 to
    just under 1 MiB is told it is below that minimum (the range's words read as if 1 were in it)."""
    ranged = f"'{key}' must be a whole number of bytes from {MIN_MEMORY} (1 MiB) to 2**50{more_than_zero}, got "

    def refusal(value: Any) -> str:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 1 <= value < MIN_MEMORY \
                and float(value).is_integer():
            return (f"'{key}' of {int(value)} byte{'s' if value != 1 else ''} is below the minimum of 1 MiB "
                    f"({MIN_MEMORY} bytes)")
        return ranged + repr(value)
    return Spec("integer", words, nullable=True, minimum=MIN_MEMORY, maximum=MAX_BYTES, error=refusal)


def _env(key: str, words: str) -> Spec:
    return Spec("string", words, nullable=True, pattern=f"^{ENV_NAME.pattern}$",
                error=f"'{key}' must name a worker environment (letters, digits, '.', '_', '-'; at most 100), "
                "got {value!r:.80}")


_NAME = {"nullable": True, "text": True, "min_length": 1, "max_length": 200}
#: The ``parked`` object of a lease: its tier and figures, as the agent reported them.
PARKED_PROPERTIES: dict[str, Any] = {
    "tier": {"type": ["string", "null"], "enum": ["memory", "disk", None],
             "description": "memory: frozen on its node, resumes in about a second; disk: spilled, resume loads "
                            "its namespace into a new worker; null while parking"},
    "since": {"type": "string", "format": "date-time"},
    "reason": {"type": "string", "description": "why it was parked, in words"},
    "checkpointer": {"type": ["string", "null"]},
    "host_bytes": {"type": "integer", "description": "host RAM held on the node"},
    "disk_bytes": {"type": "integer"},
    "gpu_bytes_moved": {"type": "integer"},
    "gpu_bytes_kept": {"type": "integer", "description": "GPU memory still taken while parked"},
    "lost": {"type": "array", "items": {"type": "string"}, "description": "what could not be kept, in words"},
    "resume_requested": {"type": "boolean", "description": "a resume is asked for and waits for room"},
    "resume_estimate_s": {"type": ["number", "null"], "description": "seconds a resume takes, roughly"},
    "moving_from": {"type": ["string", "null"], "description": "while it moves to another node to resume "
                                                             "(starting there): the node its state is on, "
                                                             "else null"},
    "may_move": {"type": "boolean", "description": "a resume its node has no room for may go to another node "
                                                   "with room (c.PoolLeases.resume_moves; never a cell frozen "
                                                   "mid-way)"},
}
_TIME = {"type": "string", "nullable": True, "format": "date-time"}


@dataclass(frozen=True)
class LeaseRequest(Body):
    """What a client asks for with ``POST /api/v1/leases``.

    ``fraction`` in (0, 1] of one GPU, or ``gpu_count`` N >= 2 whole GPUs on one
    node (then ``fraction`` is 1). ``memory`` in bytes (None: the fraction's
    share of the GPU's usable memory), ``model`` a substring of the GPU name
    (``"A100"``), ``idle_timeout`` seconds (None: the pool's default),
    ``kernel_id`` the notebook kernel that holds the lease (used to release
    its leases when the kernel stops). ``wait`` seconds: when nothing fits
    now, queue that long (None or 0: refuse at once with 409).
    ``server_name``: the JupyterHub single-user server the kernel runs in
    (its ``JUPYTERHUB_SERVER_NAME``; ``""`` is the default server, at most
    255 characters), so that stopping one server releases only its leases.
    ``env``: the worker environment on the node (``c.AgentWorkers.environments``,
    a name of letters, digits, ``.``, ``_``, ``-``; None: the node's default);
    the lease is placed only on a node that offers it, and refused at once
    (409 ``unknown_environment``) when no node does. ``prefer_env``: used when
    ``env`` is None, the environment to run in when some node offers it, else
    the node's default, never a refusal (the magic sends the notebook kernel's
    :func:`kernel_environment`).
    ``lease_class``: a class of the table (:mod:`gpupool.leaseclasses`; None: its
    first, ``"interactive"``, a person at a notebook), e.g. ``"batch"`` (queued
    behind every interactive request); any other name is refused (400);
    ``preemptible``: the lease may be parked while others wait, its running
    cell frozen where it is and resumed later (interrupted where the node
    cannot freeze it mid-cell) (refused where ``c.PoolPressure.allow_preemption`` is off).
    ``cpus`` (cores, may be fractional: 0.5) and ``host_memory`` (bytes) of
    the node's host, held for the lease and enforced on its worker's cgroup;
    None: the GPU share's part of the node's (``c.PoolNodes.host_share``).
    ``replaces``: a move (``%gpu acquire`` while attached), the id of the
    owner's own active or parked lease that the new one takes over from and
    that is released once the move is done: the quota check does not count
    it (409 ``invalid_state`` when it is not such a lease).
    """

    SCHEMA: ClassVar[dict[str, Any]] = {
        "additionalProperties": False, "description": "null: as if left out",
        # Several GPUs are whole GPUs.
        "if": {"required": ["gpu_count"], "properties": {"gpu_count": {"type": "integer", "minimum": 2}}},
        "then": {"properties": {"fraction": {"enum": [1, None]}}}}

    #: The order the fields are checked in after the GPU ask (``gpu_count``, ``fraction``, the rule between
    #: them): the order of before they were declared, so a body with several bad fields gets the same 400.
    CHECK_ORDER: ClassVar[tuple[str, ...]] = (
        "memory", "idle_timeout", "wait", "server_name", "lease_class", "preemptible", "cpus", "host_memory", "model",
        "kernel_id", "env", "prefer_env", "on_idle", "replaces")

    fraction: float = wired(Spec("number", "of one GPU; 1 (or left out) when gpu_count > 1", nullable=True,
                                 minimum=MIN_FRACTION, maximum=1, default=1, error=_fraction_words), 1.0)
    gpu_count: int = wired(Spec("integer", "whole GPUs, all on one node; 400 above the biggest node's count",
                                nullable=True, minimum=1, maximum=MAX_GPU_COUNT, default=1,
                                error=f"'gpu_count' must be a whole number from 1 to {MAX_GPU_COUNT}, "
                                      "got {value!r}"), 1)
    memory: int | None = wired(_bytes("memory", "bytes per GPU (default: the fraction's share)"), None)
    model: str | None = wired(Spec("string", "substring of the GPU name, e.g. A100", **_NAME), None)
    idle_timeout: float | None = wired(Spec(
        "number", "seconds, at least 1 (at most c.PoolLeases.max_idle_timeout, or max_idle_timeout of your quota: "
        "400 above it)", nullable=True, minimum=MIN_IDLE_TIMEOUT, maximum=MOST_SECONDS,
        error=f"'idle_timeout' must be seconds from {MIN_IDLE_TIMEOUT:g} to {MOST_SECONDS}, got {{value!r}}"), None)
    kernel_id: str | None = wired(Spec("string", **_NAME), None)
    wait: float | None = wired(Spec(
        "number", "seconds to queue when nothing fits (at most c.PoolLeases.max_wait); 0 or absent: 409 at once",
        nullable=True, minimum=0, maximum=MOST_SECONDS,
        error=f"'wait' must be seconds in [0, {MOST_SECONDS}], got {{value!r}}"), None)
    server_name: str | None = wired(Spec(
        "string", "the JupyterHub server the kernel runs in (JUPYTERHUB_SERVER_NAME, \"\" the default one): "
        "stopping that server releases the lease", nullable=True, max_length=255, text=True,
        error="'server_name' must be a JupyterHub server name (at most 255 characters, no control characters, "
        "\"\" for the default server), got {value!r:.80}"), None)
    env: str | None = wired(_env("env", "the worker environment on the node (c.AgentWorkers.environments): the "
                                 "lease goes only to a node that reports it usable; 409 unknown_environment when "
                                 "none does. Absent: the node's default"), None)
    prefer_env: str | None = wired(_env("prefer_env", "when env is absent: this environment if some node offers "
                                        "it, else the node's default (never refused); the magic sends the "
                                        "notebook kernel's name"), None)
    lease_class: str | None = wired(Spec("string", "the lease class (gpupool.leaseclasses): a class's "
                                         "requests queue behind every earlier class's", nullable=True,
                                         enum=LEASE_CLASSES, default=default_class().name), None)
    preemptible: bool | None = wired(Spec(
        "boolean", "the lease may be parked while others wait, its running cell frozen where it is and resumed "
        "later (interrupted where the node cannot freeze it mid-cell); 400 where "
        "c.PoolPressure.allow_preemption is off", nullable=True, default=False), None)
    cpus: float | None = wired(Spec(
        "number", "host cores for the worker (its cgroup's CPU limit); absent: the GPU share's part of the node's "
        "cores (c.PoolNodes.host_share); 400 above the biggest node's", nullable=True, minimum=MIN_CPUS,
        maximum=MAX_CPUS, error=f"'cpus' must be host cores from {MIN_CPUS} to {MAX_CPUS} (more than zero), "
        "got {value!r}"), None)
    host_memory: int | None = wired(_bytes(
        "host_memory", "bytes of host RAM for the worker (its cgroup's memory limit); absent: the GPU share's part "
        "of the node's RAM; 400 above the biggest node's", more_than_zero=" (more than zero)"), None)
    on_idle: str | None = wired(Spec("string", "what the idle timeout does: park the lease in place (its worker "
                                     "frozen on its node, resumed by the next cell) or release it", nullable=True,
                                     enum=ON_IDLE, default="park"), None)
    replaces: str | None = wired(Spec("string", "a move: the id of the caller's own active or parked lease this "
                                      "one takes over from (the notebook's %gpu acquire while attached); the quota "
                                      "does not count it, as it is released once the move is done; 409 when it is "
                                      "not one", nullable=True, text=True, min_length=1, max_length=40,
                                      error="'replaces' must be a lease id (at most 40 characters), "
                                            "got {value!r:.60}"), None)

    @classmethod
    def from_json(cls, body: Any) -> "LeaseRequest":
        """Validate a request body: each field as declared, then the rule
        between them. Raises a 400 GPUPoolError naming the field."""
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        unknown = sorted(set(body) - set(cls.KEYS))
        if unknown:
            raise bad_request(f"unknown field(s): {', '.join(unknown)}; known: {', '.join(cls.KEYS)}")
        number_field(body, "fraction")  # whether it is a number was checked first of all, its bounds after gpu_count
        values = cls.read(body, "gpu_count", "fraction")
        values["fraction"] = 1.0 if values["fraction"] is None else values["fraction"]
        values["gpu_count"] = values["gpu_count"] or 1
        if values["gpu_count"] > 1 and values["fraction"] != 1:
            raise bad_request("a request for several GPUs takes whole GPUs: leave 'fraction' out or set it to 1")
        values |= cls.read(body, *cls.CHECK_ORDER)
        values["wait"] = values["wait"] or None  # 0: refuse at once, as absent
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        """The request body, without unset fields."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(kw_only=True)
class Lease(Body):
    """A lease as its owner (or an admin) sees it: every answer about one
    (``GET /api/v1/leases/{id}``, the list, a heartbeat's, a release's).

    The service builds it (``hub_plugin/views.py``) and sends :meth:`to_json`;
    the client reads it with :meth:`from_json`, leniently (fields it does not
    know are dropped). The fields are declared in the order the JSON has them.
    ``connection`` (Jupyter connection info, with the HMAC ``key``) is present
    only for the owner and only while its worker lives: active, parking, or
    parked in memory (the notebook keeps its connection across a park).
    """

    id: str = wired(Spec("string", required=True))
    owner: str = wired(Spec("string", required=True))
    state: LeaseState = wired(Spec("", required=True, enum=tuple(s.value for s in LeaseState)))
    reason: str | None = wired(Spec("string", nullable=True), None)
    fraction: float = wired(Spec("number", required=True))
    gpu_count: int = wired(Spec("integer", required=True))
    memory: int = wired(Spec("integer", "bytes per GPU", required=True))
    cpus: float | None = wired(Spec("number", "host cores held (reserved) on the node (null: the node reports no "
                                    "host)", nullable=True), None)
    host_memory: int | None = wired(Spec("integer", "host bytes held (reserved) on the node", nullable=True), None)
    requested_cpus: float | None = wired(Spec("number", "cpus as requested (null: the default share)",
                                              nullable=True), None)
    requested_host_memory: int | None = wired(Spec("integer", "host_memory as requested (null: the default share)",
                                                   nullable=True), None)
    node: str | None = wired(Spec("string", nullable=True), None)
    gpus: list[dict[str, Any]] = wired(Spec("array", items={"type": "object", "properties": {
        "uuid": {"type": "string"}, "name": {"type": "string"}, "index": {"type": "integer"}}}), factory=list)
    env: str | None = wired(Spec("string", "the worker environment asked for; once placed, the one the worker runs "
                                 "in (the node's default when none was asked for)", nullable=True), None)
    idle_timeout: float | None = wired(Spec("number"), None)
    heartbeat_ttl: float | None = wired(Spec("number"), None)
    kernel_id: str | None = wired(Spec("string", nullable=True), None)
    server_name: str | None = wired(Spec("string", nullable=True), None)
    lease_class: str = wired(Spec("", enum=LEASE_CLASSES), default_class().name)
    preemptible: bool = wired(Spec("boolean", "whether the running cell may be preempted"), False)
    created_at: str | None = wired(Spec(**_TIME), None)
    started_at: str | None = wired(Spec(**_TIME), None)
    ended_at: str | None = wired(Spec(**_TIME), None)
    idle_since: str | None = wired(Spec(**_TIME), None)
    worker: dict[str, Any] | None = wired(Spec("object", nullable=True, extra={"properties": {
        "pid": {"type": ["integer", "null"]}, "execution_state": {"type": ["string", "null"]}}}), None)
    connection: dict[str, Any] | None = wired(Spec("object", "Jupyter connection info; owner only, while its worker "
                                                   "lives (active, and parking or parked in memory)", nullable=True),
                                              None)
    usage_gpu_seconds: float = wired(Spec("number", "GPU-seconds used: fraction x GPUs x seconds holding a GPU "
                                          "share (parked time is not counted)"), 0.0)
    parked_seconds: float = wired(Spec("number", "seconds spent parked so far (counted apart from usage)"), 0.0)
    events: list[dict[str, Any]] = wired(Spec("array", items={"type": "object", "properties": {
        "state": {"type": "string"}, "at": {"type": "string", "format": "date-time"},
        "reason": {"type": ["string", "null"]}}}), factory=list)
    queue_position: int | None = wired(Spec("integer", "while queued, or parked with a resume asked for: 1-based "
                                            "place in line", nullable=True), None)
    queue_estimate_s: float | None = wired(Spec("number", "while queued, or parked with a resume asked for: rough "
                                                "wait, seconds (null: unknown)", nullable=True), None)
    wait_until: str | None = wired(Spec(**_TIME, description="when the request gives up waiting in the queue "
                                        "(kept once placed: a start whose node's agent cannot be reached queues "
                                        "it again until then); null: it does not wait"), None)
    idle_deadline: str | None = wired(Spec(**_TIME, description="when the lease is reclaimed if its worker stays "
                                           "idle; null while a cell runs or when not active"), None)
    pressure: str | None = wired(Spec(
        "string", "why idle_deadline came early or a preemption is due, e.g. 'parked early: 3 people are waiting "
        "for a GPU'", nullable=True), None)
    preempt_at: str | None = wired(Spec(**_TIME, description="when a preemptible lease is parked with its running "
                                        "cell frozen (interrupted where the node cannot freeze it)"), None)
    idle_warning: float = wired(Spec("number", "seconds before idle_deadline that the notebook warns "
                                     "(c.PoolLeases.idle_warning); 0: no warning"), 0.0)
    node_state: str | None = wired(Spec(
        "string", "lost: no heartbeat from the node's agent for node_ttl; the worker is unreachable until it "
        "returns (the lease keeps its capacity). degraded: the agent cannot read its GPUs (NVML); the lease goes "
        "on, nothing new is placed there", nullable=True, enum=("up", "degraded", "lost")), None)
    cpu_limit: float | None = wired(Spec("number", "host cores the worker's cgroup is limited to: cpus, raised to 1 "
                                         "core (at most the node's) where the default share was taken",
                                         nullable=True), None)
    host_memory_limit: int | None = wired(Spec(
        "integer", "host bytes the worker's cgroup is limited to: host_memory, raised to 1 GiB (at most the "
        "node's) where the default share was taken", nullable=True), None)
    on_idle: str = wired(Spec("", "what the idle timeout does: park or release", enum=ON_IDLE), "park")
    parked: dict[str, Any] | None = wired(Spec(
        "object", "while parking or parked: where the worker's state is and what resuming costs "
        "(docs/parking.md); null otherwise", nullable=True, extra={"properties": PARKED_PROPERTIES}), None)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "Lease":
        """The lease of an answer's JSON; raises ValueError for an unknown ``state``."""
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in body.items() if k in known}
        values["state"] = LeaseState(values["state"])
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        """The lease's JSON: every field, in declaration order, null where unset."""
        return {key: getattr(self, key) for key in self.KEYS} | {"state": LeaseState(self.state).value}
