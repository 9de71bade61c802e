"""The node's host CPUs and memory: what the agent reports, what a lease's
worker may use, and the cgroup limits that hold it there.

The agent reports its host's logical cores and RAM (psutil, unless
``c.NodeAgent.host_cpus`` / ``host_memory`` say otherwise) when it
registers; the service places by them (``hub_plugin/hosts.py``) and sends
each lease's ``cpus`` and ``host_memory`` with ``POST /workers``. The agent
writes them to the worker's cgroup (:meth:`.cgroups.LeaseCgroup.set_limits`:
``cpu.max``/``memory.max`` in v2 where those controllers are, the v1
``cpu``/``memory`` hierarchies otherwise, :mod:`.cgroups.hybrid`) before the
worker is handed out. Without a cgroup (``cgroup_mode = 'none'``) or the
controllers, the agent says loudly that the limits are not enforced, and
the worker starts anyway: the capacity is still reserved, so other leases
are placed as if it were.
"""

from __future__ import annotations

import logging
from typing import Any

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


def parse_host_limits(body: dict[str, Any], totals: tuple[float, int]) -> tuple[float | None, int | None]:
    """The optional ``cpus`` (cores) and ``host_memory`` (bytes) of a
    ``POST /workers`` body, at most this host's ``totals``; None when absent.
    Raises a 400 GPUPoolError naming the field and the host's amount."""
    cpus, memory = body.get("cpus"), body.get("host_memory")
    if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, (int, float))
                             or not MIN_CPUS <= cpus <= min(MAX_CPUS, totals[0])):
        raise bad_request(f"'cpus' must be cores from {MIN_CPUS} to this node's {totals[0]:g}, got {cpus!r:.40}")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int)
                               or not MIN_MEMORY <= memory <= totals[1]):
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
