"""The wire's units and field rules, shared by the service, the agent and the
client: limits, lease states and classes, the one clock and its ISO 8601 form,
and the checks of one field (numbers, one-line text, environment names).

Units on the wire: fractions as numbers, memory in bytes, durations in
seconds, times as ISO 8601 UTC strings. See ``docs/api.md`` for every
endpoint; the bodies themselves (lease request, lease, node registration,
heartbeat, worker start) are in :mod:`gpupool.wire`, built on the rules here.
"""

from __future__ import annotations

import enum
import math
import re
from datetime import datetime, timezone
from typing import Any

from .errors import bad_request
from .leaseclasses import CLASS_NAMES
from .strenum import StrEnum


#: The smallest slice: 1% of a GPU (CUDA MPS active-thread percentages are whole percents).
MIN_FRACTION = 0.01
#: The most whole GPUs one lease may ask for (a node's; no node has more).
MAX_GPU_COUNT = 64
#: The smallest memory limit a request may name (the agent works in whole MiB).
MIN_MEMORY = 1024**2
#: Host cores a request may name: the cgroup quota works in 1/100 of a core.
MIN_CPUS = 0.01
MAX_CPUS = 4096
#: The largest byte count on the wire (1 PiB): a GPU's memory, a limit, a reading.
MAX_BYTES = 2**50
#: The largest process id or exit code on the wire (they are C ints).
MAX_INT32 = 2**31 - 1
#: Lease class names, in queue order (a live view of the table, :mod:`gpupool.leaseclasses`).
LEASE_CLASSES = CLASS_NAMES
#: What the idle timeout does to a lease: ``park`` it in place (the default: the
#: next cell resumes it where it was) or ``release`` it (the worker ends).
ON_IDLE = ("park", "release")


class LeaseState(str, enum.Enum):
    """Lease life cycle (docs/api.md, "Leases"): ``queued -> starting ->
    active -> releasing -> released``, with ``failed`` and ``reclaimed`` as
    other ends, and park in place: ``active -> parking -> parked`` (the worker
    frozen on its node, its GPU share back in the pool) and ``parked ->
    starting -> active`` when it resumes (docs/parking.md)."""

    queued = "queued"
    starting = "starting"
    active = "active"
    parking = "parking"
    parked = "parked"
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
        """True while the lease's slice is reserved on its GPU(s); a parked
        lease holds host memory on its node, not a GPU share."""
        return self in (LeaseState.starting, LeaseState.active, LeaseState.parking, LeaseState.releasing)


class WorkerState(StrEnum):
    """A worker's execution state, as its agent reports it (the heartbeat's
    ``execution_state``, the lease's ``worker_state``): ``starting`` until its
    kernel answers, then the kernel's last IOPub status, ``busy`` while a
    request runs and else ``idle``, or ``dead``. A ``str``: a member equals
    its value and is written to JSON as it."""

    starting = "starting"
    idle = "idle"
    busy = "busy"
    dead = "dead"


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


#: What a worker environment's name may hold (``c.AgentWorkers.environments`` keys a lease can name).
ENV_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")
#: The prefix :func:`kernel_environment` drops from a kernel's name.
KERNEL_PREFIX = "gpupool-"
#: Set by the kernel provisioner to the notebook kernel's kernelspec name.
ENV_KERNEL_NAME = "GPUPOOL_KERNEL_NAME"


def kernel_environment(kernel_name: str | None) -> str | None:
    """The worker environment a notebook kernel prefers when ``%gpu acquire`` names
    none: its kernelspec name without a leading ``gpupool-`` (``torch`` ->
    ``torch``, ``gpupool-torch`` -> ``torch``); None for no name, or one that
    cannot name an environment. Pure."""
    name = (kernel_name or "").strip()
    if name.startswith(KERNEL_PREFIX):
        name = name[len(KERNEL_PREFIX):]
    return name if ENV_NAME.fullmatch(name) else None
