"""The wire schema shared by the service, the agent and the client: units,
field rules, and the client's bodies (lease request, lease).

Units on the wire: fractions as numbers, memory in bytes, durations in
seconds, times as ISO 8601 UTC strings. See ``docs/api.md`` for every
endpoint; this module holds the shapes and their validation, in one place so
the service and its clients cannot disagree. The bodies between the service
and its node agents (registration, heartbeat, worker start) are in
:mod:`gpupool.wire`, built on the field rules here.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from .errors import bad_request


#: The smallest slice: 1% of a GPU (CUDA MPS active-thread percentages are whole percents).
MIN_FRACTION = 0.01
#: The smallest memory limit a request may name (the agent works in whole MiB).
MIN_MEMORY = 1024**2
#: Host cores a request may name: the cgroup quota works in 1/100 of a core.
MIN_CPUS = 0.01
MAX_CPUS = 4096
#: The largest byte count on the wire (1 PiB): a GPU's memory, a limit, a reading.
MAX_BYTES = 2**50
#: The largest process id or exit code on the wire (they are C ints).
MAX_INT32 = 2**31 - 1
#: Lease classes, in queue order: interactive requests go before batch ones (docs/api.md, "Classes").
LEASE_CLASSES = ("interactive", "batch")


class LeaseState(str, enum.Enum):
    """Lease life cycle: ``queued -> starting -> active -> releasing -> released``,
    with ``failed`` and ``reclaimed`` as other ends (DESIGN.md, Contracts)."""

    queued = "queued"
    starting = "starting"
    active = "active"
    releasing = "releasing"
    released = "released"
    failed = "failed"
    reclaimed = "reclaimed"

    @property
    def ended(self) -> bool:
        """True for the three final states."""
        return self in (LeaseState.released, LeaseState.failed, LeaseState.reclaimed)

    @property
    def holds_capacity(self) -> bool:
        """True while the lease's slice is reserved on its GPU(s)."""
        return self in (LeaseState.starting, LeaseState.active, LeaseState.releasing)


def utcnow() -> datetime:
    """Timezone-aware now in UTC (the one clock of the wire format)."""
    return datetime.now(timezone.utc)


def isoformat(moment: datetime | None) -> str | None:
    """ISO 8601 UTC with a ``Z`` suffix, or None."""
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def parse_time(text: str | None) -> datetime | None:
    """Inverse of :func:`isoformat`: an aware UTC datetime (a time without an
    offset is taken as UTC, the wire format's zone). Raises ValueError for text
    that is not ISO 8601."""
    if text is None:
        return None
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def number_field(body: dict[str, Any], key: str, *, required: bool = False) -> float | None:
    """``body[key]`` as a finite float (None when absent); 400 naming ``key``
    otherwise, also for an integer too large for a float (``10**400``)."""
    value = body.get(key)
    if value is None:
        if required:
            raise bad_request(f"'{key}' is required")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{key}' must be a number, got {value!r:.80}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise bad_request(f"'{key}' must be a number, got {'inf' if isinstance(value, int) else value!r:.80}"
                          + (" (it is too large)" if isinstance(value, int) else ""))
    return number


def is_unicode(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8: no lone surrogate (``"\\ud800"``,
    which JSON can spell and neither SQLite nor PostgreSQL can store)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def has_control_characters(text: str) -> bool:
    """Whether ``text`` holds an ASCII control character (``\\x00``-``\\x1f``, ``\\x7f``):
    no name or reason needs one, NUL is refused by PostgreSQL, and newlines would forge log lines."""
    return any(ch < " " or ch == "\x7f" for ch in text)


def text_field(body: dict[str, Any], key: str, max_len: int = 200) -> str | None:
    """``body[key]``: None when absent, else a non-empty one-line string of at most
    ``max_len`` characters; 400 naming ``key`` otherwise."""
    value = body.get(key)
    if value is None:
        return None
    if (not isinstance(value, str) or not value or len(value) > max_len or has_control_characters(value)
            or not is_unicode(value)):
        raise bad_request(f"'{key}' must be a non-empty string of at most {max_len} characters, "
                          "without control characters")
    return value


#: What a worker environment's name may hold (``c.NodeAgent.environments`` keys a lease can name).
ENV_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")
#: The prefix :func:`kernel_environment` drops from a kernel's name.
KERNEL_PREFIX = "gpupool-"
#: Set by the kernel provisioner to the notebook kernel's kernelspec name.
ENV_KERNEL_NAME = "GPUPOOL_KERNEL_NAME"


def _env_name(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and (not isinstance(value, str) or not ENV_NAME.fullmatch(value)):
        raise bad_request(f"'{key}' must name a worker environment (letters, digits, '.', '_', '-'; "
                          f"at most 100), got {value!r:.80}")
    return value


def kernel_environment(kernel_name: str | None) -> str | None:
    """The worker environment a notebook kernel prefers when ``%gpu acquire`` names
    none: its kernelspec name without a leading ``gpupool-`` (``torch`` ->
    ``torch``, ``gpupool-torch`` -> ``torch``); None for no name, or one that
    cannot name an environment. Pure."""
    name = (kernel_name or "").strip()
    if name.startswith(KERNEL_PREFIX):
        name = name[len(KERNEL_PREFIX):]
    return name if ENV_NAME.fullmatch(name) else None


def _host_ask(body: dict[str, Any]) -> tuple[float | None, int | None]:
    """``cpus`` (cores, 0.01 to :data:`MAX_CPUS`) and ``host_memory`` (whole
    bytes, 1 MiB to 2**50) of a request, None when absent; 400 naming the field."""
    cpus = number_field(body, "cpus")
    if cpus is not None and not MIN_CPUS <= cpus <= MAX_CPUS:
        raise bad_request(f"'cpus' must be host cores from {MIN_CPUS} to {MAX_CPUS} (more than zero), "
                          f"got {body['cpus']!r}")
    memory = number_field(body, "host_memory")
    if memory is not None and (memory < MIN_MEMORY or memory != int(memory) or memory > 2**50):
        raise bad_request(f"'host_memory' must be a whole number of bytes from {MIN_MEMORY} (1 MiB) to 2**50 "
                          f"(more than zero), got {body['host_memory']!r}")
    return cpus, None if memory is None else int(memory)


@dataclass(frozen=True)
class LeaseRequest:
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
    ``env``: the worker environment on the node (``c.NodeAgent.environments``,
    a name of letters, digits, ``.``, ``_``, ``-``; None: the node's default);
    the lease is placed only on a node that offers it, and refused at once
    (409 ``unknown_environment``) when no node does. ``prefer_env``: used when
    ``env`` is None, the environment to run in when some node offers it, else
    the node's default, never a refusal (the magic sends the notebook kernel's
    :func:`kernel_environment`).
    ``lease_class``: ``"interactive"`` (None: the default, a person at a
    notebook) or ``"batch"`` (queued behind every interactive request);
    ``preemptible``: the lease's running cell may be interrupted and the lease
    parked while others wait (refused where ``c.GPUPool.allow_preemption`` is off).
    ``cpus`` (cores, may be fractional: 0.5) and ``host_memory`` (bytes) of
    the node's host, held for the lease and enforced on its worker's cgroup;
    None: the GPU share's part of the node's (``c.GPUPool.host_share``).
    """

    fraction: float = 1.0
    gpu_count: int = 1
    memory: int | None = None
    model: str | None = None
    idle_timeout: float | None = None
    kernel_id: str | None = None
    wait: float | None = None
    server_name: str | None = None
    env: str | None = None
    prefer_env: str | None = None
    lease_class: str | None = None
    preemptible: bool | None = None
    cpus: float | None = None
    host_memory: int | None = None

    KEYS = ("fraction", "gpu_count", "memory", "model", "idle_timeout", "kernel_id", "wait", "server_name", "env",
            "prefer_env", "lease_class", "preemptible", "cpus", "host_memory")

    @classmethod
    def from_json(cls, body: Any) -> "LeaseRequest":
        """Validate a request body. Raises a 400 GPUPoolError naming the field."""
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        unknown = sorted(set(body) - set(cls.KEYS))
        if unknown:
            raise bad_request(f"unknown field(s): {', '.join(unknown)}; known: {', '.join(cls.KEYS)}")
        fraction = number_field(body, "fraction")
        count = number_field(body, "gpu_count")
        if count is not None and (count != int(count) or count < 1 or count > 64):
            raise bad_request(f"'gpu_count' must be a whole number from 1 to 64, got {body['gpu_count']!r}")
        count = int(count or 1)
        if fraction is None:
            fraction = 1.0
        if not 0 < fraction <= 1:
            raise bad_request(f"'fraction' must be in (0, 1], got {body['fraction']!r}; ask for whole GPUs with 'gpu_count'")
        if fraction < MIN_FRACTION:
            raise bad_request(f"'fraction' must be at least {MIN_FRACTION} (1% of a GPU, the smallest CUDA MPS "
                              f"share), got {body['fraction']!r}")
        if count > 1 and fraction != 1:
            raise bad_request("a request for several GPUs takes whole GPUs: leave 'fraction' out or set it to 1")
        memory = number_field(body, "memory")
        if memory is not None and (memory < MIN_MEMORY or memory != int(memory) or memory > 2**50):
            raise bad_request(f"'memory' must be a whole number of bytes from {MIN_MEMORY} (1 MiB) to 2**50, "
                              f"got {body['memory']!r}")
        idle = number_field(body, "idle_timeout")
        if idle is not None and not 0 < idle <= 366 * 86400:
            raise bad_request(f"'idle_timeout' must be seconds in (0, 31622400], got {body['idle_timeout']!r}")
        wait = number_field(body, "wait")
        if wait is not None and not 0 <= wait <= 366 * 86400:
            raise bad_request(f"'wait' must be seconds in [0, 31622400], got {body['wait']!r}")
        server = body.get("server_name")
        if server is not None and (not isinstance(server, str) or len(server) > 255
                                   or has_control_characters(server) or not is_unicode(server)):
            raise bad_request(f"'server_name' must be a JupyterHub server name (at most 255 characters, no "
                              f"control characters, \"\" for the default server), got {server!r:.80}")
        lease_class = body.get("lease_class")
        if lease_class is not None and lease_class not in LEASE_CLASSES:
            raise bad_request(f"'lease_class' must be one of {', '.join(LEASE_CLASSES)}, got {lease_class!r:.80}")
        preemptible = body.get("preemptible")
        if preemptible is not None and not isinstance(preemptible, bool):
            raise bad_request(f"'preemptible' must be true or false, got {preemptible!r:.80}")
        cpus, host_memory = _host_ask(body)
        return cls(fraction=fraction, gpu_count=count, memory=None if memory is None else int(memory),
                   model=text_field(body, "model"), idle_timeout=idle, kernel_id=text_field(body, "kernel_id"),
                   wait=wait or None, server_name=server, env=_env_name(body, "env"),
                   prefer_env=_env_name(body, "prefer_env"), lease_class=lease_class, preemptible=preemptible,
                   cpus=cpus, host_memory=host_memory)

    def to_json(self) -> dict[str, Any]:
        """The request body, without unset fields."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class Lease:
    """A lease as the client sees it (``GET /api/v1/leases/{id}``).

    Read-only view over the JSON; ``connection`` (Jupyter connection info,
    with the HMAC ``key``) is present only for the owner and only while active.
    """

    id: str
    owner: str
    state: LeaseState
    fraction: float
    gpu_count: int
    memory: int
    node: str | None = None
    gpus: list[dict[str, Any]] = field(default_factory=list)
    #: The worker environment: the one asked for, and once placed the one the
    #: worker runs in (the node's default when none was asked for; None when
    #: the node reports no environments).
    env: str | None = None
    #: Host cores and bytes held (reserved) on the node (None: the node reports no host).
    cpus: float | None = None
    host_memory: int | None = None
    #: What the worker's cgroup is limited to: ``cpus``/``host_memory``, raised to the
    #: agent's floor (1 core, 1 GiB, at most the node's) where the lease took the
    #: default share; None without a host (or from an older service).
    cpu_limit: float | None = None
    host_memory_limit: int | None = None
    #: What the request asked for (None: the default share), so that a resume asks the same.
    requested_cpus: float | None = None
    requested_host_memory: int | None = None
    reason: str | None = None
    idle_timeout: float | None = None
    heartbeat_ttl: float | None = None
    kernel_id: str | None = None
    created_at: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    idle_since: str | None = None
    #: When the service reclaims the lease if it stays idle (ISO UTC; None while
    #: a cell runs or when not active), and how many seconds before that the
    #: notebook warns (``c.GPUPool.idle_warning``; 0: no warning).
    idle_deadline: str | None = None
    idle_warning: float = 0.0
    #: ``"up"``, ``"degraded"`` (its agent cannot read its GPUs: the lease goes on, nothing
    #: new is placed there) or ``"lost"`` (no heartbeat from its agent for ``c.GPUPool.node_ttl``:
    #: the worker is unreachable until the node returns); None without a node.
    node_state: str | None = None
    worker: dict[str, Any] | None = None
    connection: dict[str, Any] | None = None
    usage_gpu_seconds: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)
    #: While ``queued``: 1-based place in the queue, a rough wait in seconds
    #: (None when unknown), and when the request gives up (ISO UTC).
    queue_position: int | None = None
    queue_estimate_s: float | None = None
    wait_until: str | None = None
    #: ``"interactive"`` or ``"batch"``, and whether its running cell may be preempted.
    lease_class: str = "interactive"
    preemptible: bool = False
    #: Words for why ``idle_deadline`` came early or a preemption is due, e.g.
    #: ``"parked early: 3 people are waiting for a GPU"``; None without pressure.
    pressure: str | None = None
    #: When the running cell of a preemptible lease is interrupted (ISO UTC), then the lease parked.
    preempt_at: str | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "Lease":
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in body.items() if k in known}
        values["state"] = LeaseState(values["state"])
        return cls(**values)
