"""The node's host CPUs and memory: what the agent reports, what a lease's
worker may use, and the cgroup limits that hold it there, written before
the worker is handed out; a worker the OOM killer ended is reported in words
that name the limit (:func:`out_of_memory`). How the service places by them
and what each cgroup kind enforces: docs/enforcement.md, "Host CPU and memory".
"""

from __future__ import annotations

import logging
import signal

import psutil

from gpupool.errors import bad_request
from gpupool.schema import MAX_CPUS, MIN_CPUS, MIN_MEMORY
from gpupool.units import format_bytes

from .cgroups import CgroupError, LeaseCgroup


def host_totals(cpus: float | None, memory: int | None) -> tuple[float, int]:
    """``(cores, bytes)`` of this host: ``cpus``/``memory`` when set (the
    traits), else psutil's logical CPU count and total RAM."""
    return (float(cpus) if cpus else float(psutil.cpu_count() or 1),
            int(memory) if memory else int(psutil.virtual_memory().total))


def check_host_limits(cpus: float | None, memory: int | None,
                      totals: tuple[float, int]) -> tuple[float | None, int | None]:
    """The optional ``cpus`` (cores) and ``host_memory`` (bytes) of a
    :class:`~gpupool.wire.workers.WorkerRequest`, at most this host's
    ``totals``; None when absent. Raises a 400 GPUPoolError naming the field
    and the host's amount."""
    if cpus is not None and not MIN_CPUS <= cpus <= min(MAX_CPUS, totals[0]):
        raise bad_request(f"'cpus' must be cores from {MIN_CPUS} to this node's {totals[0]:g}, got {cpus!r:.40}")
    if memory is not None and not MIN_MEMORY <= memory <= totals[1]:
        raise bad_request(f"'host_memory' must be bytes from 1 MiB to this node's {totals[1]} "
                          f"({format_bytes(totals[1])}), got {memory!r:.40}")
    return (None if cpus is None else float(cpus)), memory


def enforce(cgroup: LeaseCgroup, lease_id: str, cpus: float | None, memory: int | None,
            log: logging.Logger) -> bool:
    """Write ``cpus``/``memory`` to the worker's ``cgroup``; True when they
    hold (or none was asked). Logs a loud warning and returns False when
    this agent cannot enforce them (no cgroup, no controller)."""
    if cpus is None and memory is None:
        return True
    try:
        cgroup.set_limits(cpu=cpus, memory=memory)
    except (CgroupError, OSError) as exc:
        log.warning("HOST LIMITS NOT ENFORCED for lease %s (%s CPUs, %s): %s", lease_id,
                    "-" if cpus is None else f"{cpus:g}", format_bytes(memory) if memory is not None else "-", exc)
        return False
    log.info("lease %s limited to %s CPUs and %s of host memory", lease_id,
             "any" if cpus is None else f"{cpus:g}", "any" if memory is None else format_bytes(memory))
    return True


def out_of_memory(cgroup: LeaseCgroup, memory: int | None, exit_code: int | None) -> str | None:
    """The reason the user is told when the kernel's OOM killer ended the
    worker whose process left with ``exit_code`` (None: unknown, as for a
    re-adopted worker) in ``cgroup``, limited to ``memory`` bytes (None: no
    limit); None when it was no OOM kill (another signal or exit, or the
    cgroup cannot tell: :meth:`.cgroups.LeaseCgroup.oom_kills`). Read it
    before the cgroup is removed."""
    if exit_code not in (None, -signal.SIGKILL) or not cgroup.oom_kills():
        return None
    if memory is None:
        return "the worker was killed: the node ran out of host memory (the kernel's OOM killer ended it)"
    return (f"the worker was killed: it ran out of its {format_bytes(memory)} of host memory (--host-memory); "
            "acquire again with a larger --host-memory")
