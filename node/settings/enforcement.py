"""``c.AgentEnforcement``: how the node confines its workers: the GPU
enforcement mode, the workers' cgroups and task limits, and whether the agent
refuses to serve without them."""

from __future__ import annotations

from typing import Any

from traitlets import Bool, Enum, Integer, Unicode, validate
from traitlets.config import Configurable

from .. import enforcement
from ..cgroups import MODES as CGROUP_MODES
from .choices import auto_or_one_of


class AgentEnforcement(Configurable):
    """What holds each worker to its slice and its lease."""

    enforcement_mode = Unicode(
        "auto",
        help=f"""How this node confines workers to their slices (docs/enforcement.md), one of
        auto, {", ".join(enforcement.available())}:
        ``mps`` (the agent starts or joins the CUDA MPS control daemon; compute
        share and memory limit per worker), ``mig`` (whole MIG instances),
        ``timeslice`` (framework memory caps plus the agent's memory watchdog),
        ``exclusive`` (whole GPUs only), or a mode of the ``gpupool.enforcement``
        entry point group. ``auto`` (default): ``mig`` when the
        GPUs are MIG instances, ``mps`` when an MPS daemon runs, else
        ``timeslice``. Simulated nodes report ``none``.
        ``c.AgentEnforcement.enforcement_mode = "mps"``.""",
    ).tag(config=True)

    @validate("enforcement_mode")
    def _enforcement_mode_valid(self, proposal: Any) -> str:
        return auto_or_one_of(proposal, enforcement.available())

    cgroup_mode = Enum(
        list(CGROUP_MODES), "auto", help="""How the agent holds each worker's processes together, so
        that none outlives its lease (docs/security.md, "Containment"): ``v2`` (a cgroup per
        worker in the unified hierarchy, killed with ``cgroup.kill``), ``v1`` (the freezer,
        memory, pids and cpu hierarchies: freeze, kill, thaw), ``none`` (the worker's process
        group and process tree only: a double-forked daemon escapes; a loud warning), or
        ``auto`` (default: v2, else v1, else none with the reasons). ``v2`` and ``v1`` refuse to
        start the agent when they cannot be had. ``c.AgentEnforcement.cgroup_mode = "v2"``.""",
    ).tag(config=True)

    worker_pids_max = Integer(
        0, min=0, help="""Tasks (processes and threads together) each lease's worker may have: its
        cgroup's ``pids.max``. A fork or a new thread beyond it fails in that worker only
        (``BlockingIOError: Resource temporarily unavailable``), so a cell that forks without end
        stops there and other workers, new leases and the agent go on (docs/enforcement.md,
        "Processes"). 0 (default): sized per slice, the lease's share of the node's GPUs (GPUs x
        fraction / the node's GPUs) of what the workers may have together (see
        ``agent_pids_reserve``), at least 128. ``c.AgentEnforcement.worker_pids_max = 4096``.""",
    ).tag(config=True)

    agent_pids_reserve = Integer(
        1024, min=0, help="""Tasks (processes and threads) the workers never take from the agent and
        whatever shares its cgroup: all workers together are capped (``pids.max`` of the agent's
        cgroup subtree) at the node's task limit less this many. The node's limit is the lowest of
        ``kernel.pid_max``, ``kernel.threads-max``, the agent's RLIMIT_NPROC and the ``pids.max`` of
        its cgroup and each above it (systemd's ``TasksMax``, a container's pids limit); at most half
        of it is kept. Default 1024. ``c.AgentEnforcement.agent_pids_reserve = 2048``.""",
    ).tag(config=True)

    cgroup_root = Unicode(
        "", help="""The cgroup subtree the workers' cgroups are made in: a path from the
        hierarchy's root (``/system.slice/gpupool-agent.service/workers``) or relative to the
        agent's own cgroup (``/proc/self/cgroup``). It must be the agent's alone: a restarted
        agent kills every cgroup there that it does not re-adopt. Empty (default):
        ``gpupool/agent-HASH`` under the agent's own cgroup, HASH from the state directory,
        which under systemd is the subtree ``Delegate=yes`` gives the unit.
        ``c.AgentEnforcement.cgroup_root = "gpupool"``.""",
    ).tag(config=True)

    require_containment = Bool(
        False, help="""Refuse to serve, instead of falling back with a warning, when the containment
        this node is configured for cannot be had: ``cgroup_mode`` must give the workers cgroups
        (``auto`` ending at ``none``, as in an unprivileged pod's read-only cgroupfs, is refused, and
        so is ``none`` itself), and a named ``enforcement_mode`` must set up (``mps`` without its
        control daemon). A refusing agent registers with no service and starts no worker: it
        answers ``GET /health`` with 503 and the reason in words (what the Kubernetes readiness
        probe, ``gpupool health``, prints), logs it, and waits for SIGTERM. Default: False, so a
        bare ``gpupool agent`` (``make demo``, a laptop) runs with what the host has; the
        Kubernetes manifests and the systemd unit turn it on.
        ``c.AgentEnforcement.require_containment = True``.""",
    ).tag(config=True)
