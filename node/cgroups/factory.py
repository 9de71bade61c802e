"""Choosing the agent's containment from ``c.AgentEnforcement.cgroup_mode``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .contract import CgroupError, Containment
from .hybrid import v2_containment
from .mounts import MOUNTS, SELF_CGROUP, default_root, own_cgroups, read_mounts, v1_roots, v2_root
from .none import NoContainment
from .v1 import V1Containment

MODES = ("auto", "v2", "v1", "none")


def containment(mode: str, root: str, state_dir: str | os.PathLike, *, log: logging.Logger | None = None,
                mounts: Path = MOUNTS, self_cgroup: Path = SELF_CGROUP) -> Containment:
    """The agent's containment for ``mode`` (one of :data:`MODES`).

    ``root``: the agent's subtree: absolute (from the hierarchy's root, e.g.
    ``/system.slice/gpupool-agent.service/gpupool``) or relative to the
    agent's own cgroup; empty: :func:`default_root` of ``state_dir``.
    ``auto`` tries v2, then v1, then falls back to none (with the reasons in
    its warning); ``v2`` and ``v1`` raise CgroupError when they cannot be had.
    """
    if mode not in MODES:
        raise ValueError(f"cgroup mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        return NoContainment("c.AgentEnforcement.cgroup_mode = 'none'", log)
    relative = root or default_root(state_dir)
    found, own = read_mounts(mounts), own_cgroups(self_cgroup)
    reasons = []
    for kind in (("v2", "v1") if mode == "auto" else (mode,)):
        try:
            if kind == "v2":
                return v2_containment(v2_root(found, own, relative), found, own, relative)
            return V1Containment(v1_roots(found, own, relative))
        except (CgroupError, OSError) as exc:
            if mode != "auto":
                raise CgroupError(f"cgroup {kind} containment is not available: {exc} "
                                  f"(c.AgentEnforcement.cgroup_mode = 'auto' falls back to the others)") from None
            reasons.append(f"{kind}: {exc}")
    return NoContainment("; ".join(reasons), log)

