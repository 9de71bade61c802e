"""What ``c.NodeAgent`` configures: the node's settings and its workers' settings.

:class:`~.agent.NodeAgent` inherits both, so every setting stays
``c.NodeAgent.NAME`` (and ``--name`` where an alias exists); nothing here
does I/O beyond a setting's own check.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import zmq
from traitlets import Bool, Dict, Enum, Float, Integer, List, TraitError, Unicode, default, validate
from traitlets.config import Application

from gpupool.traits import ByteSize, Duration

from . import checkpoint, enforcement, inventory
from .cgroups import MODES as CGROUP_MODES
from .workers import launchers


def _one_of(proposal: Any, choices: tuple[str, ...]) -> str:
    """A plugin setting's value (one of ``choices``, built-in names and
    entry points'), refused in the words of an ``Enum`` trait."""
    if proposal["value"] not in choices:
        raise TraitError(f"The '{proposal['trait'].name}' trait of a NodeAgent instance expected any of "
                         f"{list(choices)}, not {proposal['value']!r}")
    return proposal["value"]


def _auto_or_one_of(proposal: Any, available: tuple[str, ...]) -> str:
    """As :func:`_one_of`, ``auto`` or one of ``available``."""
    return _one_of(proposal, ("auto", *available))


class NodeSettings(Application):
    """How this node joins the pool: its name and address, the service and its
    tokens, TLS, its GPUs (NVML or simulated), their enforcement, its host."""

    service_url = Unicode(
        "", help="""Base URL of the pool service, e.g. ``http://pool:8765`` (standalone) or
        ``http://hub:8000/services/gpupool``. Required. ``c.NodeAgent.service_url = "http://pool:8765"``.""",
    ).tag(config=True)

    token_file = Unicode(
        "", help="""File holding the agent token (the service writes one to
        ``STATE_DIR/agent_token``). Without it the token is read from the
        GPUPOOL_AGENT_TOKEN environment variable. ``c.NodeAgent.token_file = "/etc/gpupool/agent_token"``.""",
    ).tag(config=True)

    simulate = Unicode(
        "", help="""Declare simulated GPUs instead of reading NVML, e.g. ``2xA100-80GB`` or
        ``1xH100-80GB,2xL4-24GB``. Empty (default): real GPUs through NVML.
        ``c.NodeAgent.simulate = "2xA100-80GB"``.""",
    ).tag(config=True)

    inventory_source = Unicode(
        "auto",
        help=f"""Where this node's GPUs are read from, one of auto,
        {", ".join(inventory.available())}: ``nvml`` (real GPUs, read by a helper
        process), ``simulated`` (the GPUs of ``simulate``), or an inventory of the
        ``gpupool.inventory`` entry point group. ``auto`` (default): ``simulated``
        when ``simulate`` is set, else ``nvml``.
        ``c.NodeAgent.inventory_source = "nvml"``.""",
    ).tag(config=True)

    @validate("inventory_source")
    def _inventory_source_valid(self, proposal: Any) -> str:
        return _auto_or_one_of(proposal, inventory.available())

    node_name = Unicode(
        help="""This node's name in the pool. Default: the host name. ``c.NodeAgent.node_name = "gpu-07"``.""",
    ).tag(config=True)

    @default("node_name")
    def _node_name_default(self) -> str:
        return socket.gethostname()

    ip = Unicode(
        "127.0.0.1", help="""Address the agent's HTTP server and its workers listen on, and that the
        service and notebook kernels connect to. Default: 127.0.0.1. ``c.NodeAgent.ip = "10.0.0.7"``.""",
    ).tag(config=True)

    port = Integer(
        8766, min=0, max=65535, help="""Port of the agent's HTTP server (0 to 65535); 0 picks a free one.
        Default: 8766. ``c.NodeAgent.port = 8766``.""",
    ).tag(config=True)

    state_dir = Unicode(
        help="""Directory for worker connection files and logs and ``agent.json``.
        Default: ``$XDG_STATE_HOME/gpupool/agent`` (``~/.local/state/gpupool/agent``).
        ``c.NodeAgent.state_dir = "/var/lib/gpupool/agent"``.""",
    ).tag(config=True)

    @default("state_dir")
    def _state_dir_default(self) -> str:
        base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        return os.path.join(base, "gpupool", "agent")

    @validate("state_dir")
    def _state_dir_absolute(self, proposal: Any) -> str:
        # Absolute, as workers start in folders of their own: a relative --state-dir would leave
        # their history file (and connection file) pointing nowhere.
        return os.path.abspath(os.path.expanduser(proposal["value"]))

    config_file = Unicode(
        "", help="""A config file (``gpupool_config.py``) setting ``c.NodeAgent.*``; the command line wins.""",
    ).tag(config=True)

    service_timeout = Duration(
        10.0, help="""Seconds per call to the service (registration, heartbeat). Default: 10.
        ``c.NodeAgent.service_timeout = 30``.""",
    ).tag(config=True)

    retry_max = Duration(
        30.0, help="""Longest wait between two registration attempts while the service is
        unreachable (the wait doubles from 0.5 s up to this). Default: 30 seconds.
        ``c.NodeAgent.retry_max = "1m"``.""",
    ).tag(config=True)

    nvml_retry_min = Duration(
        5.0, help="""Seconds before NVML is opened again after it failed to start (driver not
        loaded, driver/library version mismatch) or stopped answering; the node is ``degraded``
        meanwhile (its leases go on, nothing new is placed there), and the wait doubles after
        each failure up to ``nvml_retry_max``. Default: 5. ``c.NodeAgent.nvml_retry_min = 10``.""",
    ).tag(config=True)

    nvml_retry_max = Duration(
        300.0, help="""Longest wait between two attempts to open NVML again (see
        ``nvml_retry_min``). Default: 300 (5 minutes). ``c.NodeAgent.nvml_retry_max = "10m"``.""",
    ).tag(config=True)

    nvml_timeout = Duration(
        5.0, help="""Seconds one round of NVML readings (one heartbeat's) may take. NVML runs in
        a helper process; one that passes this (a call hung in the GPU driver) is killed, the
        node is ``degraded`` ("the GPU driver stopped answering"; its leases go on, nothing new
        is placed there) and a new helper starts on the ``nvml_retry_min``/``nvml_retry_max``
        schedule. Starting NVML in a helper may take 6 times this. Keep it well under the
        service's ``node_ttl``. Default: 5. ``c.NodeAgent.nvml_timeout = 10``.""",
    ).tag(config=True)

    @validate("nvml_timeout")
    def _nvml_timeout_valid(self, proposal: Any) -> float:
        if proposal["value"] <= 0:
            raise ValueError(f"nvml_timeout must be positive, got {proposal['value']}")
        return proposal["value"]

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
        ``c.NodeAgent.enforcement_mode = "mps"``.""",
    ).tag(config=True)

    @validate("enforcement_mode")
    def _enforcement_mode_valid(self, proposal: Any) -> str:
        return _auto_or_one_of(proposal, enforcement.available())

    ssl_cert = Unicode(
        "", help="""TLS certificate (PEM, with its chain) the agent's HTTP server serves; set with
        ``ssl_key``. The agent then registers an ``https://`` URL, which the service verifies
        (``c.GPUPool.ca_file`` for your own CA). Default: empty (plain HTTP).
        ``c.NodeAgent.ssl_cert = "/etc/gpupool/node.crt"``.""",
    ).tag(config=True)

    ssl_key = Unicode(
        "", help="""Private key (PEM, unencrypted) of ``ssl_cert``. Default: empty.
        ``c.NodeAgent.ssl_key = "/etc/gpupool/node.key"``.""",
    ).tag(config=True)

    ca_file = Unicode(
        "", help="""CA bundle (PEM) the agent trusts, besides the system's CAs, when the service
        URL is ``https://``. Default: empty, or ``$GPUPOOL_CA_FILE``.
        ``c.NodeAgent.ca_file = "/etc/gpupool/ca.crt"``.""",
    ).tag(config=True)

    host_cpus = Float(
        None, allow_none=True,
        help="""Host cores this node offers to leases (``%gpu acquire --cpus``, and the
        default share), reported at registration. Default: None, psutil's count of
        logical CPUs. ``c.NodeAgent.host_cpus = 48`` (keep some for the system).""",
    ).tag(config=True)

    host_memory = ByteSize(
        None, allow_none=True,
        help="""Host RAM this node offers to leases (``--host-memory``), reported at
        registration. Default: None, psutil's total. ``c.NodeAgent.host_memory = "384GiB"``.""",
    ).tag(config=True)

    metrics_token_file = Unicode(
        "", help="""File holding the token Prometheus sends to ``GET /metrics``
        (``Authorization: Bearer TOKEN``); the agent token is accepted there too.
        Default: empty (the agent token only). Read at start.
        ``c.NodeAgent.metrics_token_file = "/etc/gpupool/metrics_token"``.""",
    ).tag(config=True)

    host_proc = Unicode(
        "", help="""Where the host's /proc is mounted when the agent runs in a container
        without the host PID namespace (NVML reports host PIDs; this maps them
        to the agent's). Empty (default): the agent runs in the host PID
        namespace. ``c.NodeAgent.host_proc = "/host/proc"``.""",
    ).tag(config=True)

    @default("log_level")
    def _log_level_default(self) -> int:
        return logging.INFO

    @default("log_format")
    def _log_format_default(self) -> str:
        return "[%(name)s %(levelname)s %(asctime)s] %(message)s"

    def get_default_logging_config(self) -> dict[str, Any]:
        """Traitlets' logging setup, with the module loggers under ``gpupool``
        (``gpupool.agent``: NVML, attribution) writing through the agent's own
        handler, format and ``log_level`` instead of Python's bare fallback."""
        config = super().get_default_logging_config()
        if "loggers" in config:
            config["loggers"]["gpupool"] = {**config["loggers"][self.__class__.__name__], "propagate": False}
        return config

class WorkerSettings(NodeSettings):
    """How this node's workers run: their start and stop, the warm pool, their
    accounts, environments and cgroups, and their transport encryption."""

    worker_launcher = Unicode(
        "local",
        help=f"""How this node starts its workers; installed here: {", ".join(launchers.available())}.
        ``local`` (the default) starts an ipykernel process on this host, in a cgroup of its own;
        another name is a launcher of the ``gpupool.worker_launchers`` entry point group (a subclass of
        ``gpupool.node.workers.launchers.WorkerLauncher``, e.g. one that starts each
        worker in a container). A worker an earlier run of the agent left running is
        re-adopted from its record, whichever launcher started it.
        ``c.NodeAgent.worker_launcher = "local"``.""",
    ).tag(config=True)

    @validate("worker_launcher")
    def _worker_launcher_valid(self, proposal: Any) -> str:
        return _one_of(proposal, launchers.available())

    worker_start_timeout = Duration(
        60.0, help="""Seconds a worker may take to answer its first ``kernel_info`` before its
        start fails. Default: 60. ``c.NodeAgent.worker_start_timeout = "2m"``.""",
    ).tag(config=True)

    worker_stop_timeout = Duration(
        10.0, help="""Seconds a worker gets to shut down cleanly before SIGTERM, then SIGKILL.
        Default: 10. ``c.NodeAgent.worker_stop_timeout = 20``.""",
    ).tag(config=True)

    warm_workers = Integer(
        1, help="""Workers kept started ahead of any lease, bound to a lease's GPUs when one
        takes them: a lease then attaches in milliseconds instead of waiting for a kernel
        to start (docs/enforcement.md, "Binding a worker to its GPUs"). Each is handed out
        once; 0 starts every worker when its lease asks. Default: 1. ``c.NodeAgent.warm_workers = 2``.""",
    ).tag(config=True)

    @validate("warm_workers")
    def _warm_workers_valid(self, proposal: Any) -> int:
        if proposal["value"] < 0:
            raise ValueError(f"warm_workers must be 0 or more, got {proposal['value']}")
        return proposal["value"]

    preload_modules = List(
        Unicode(), help="""Modules each warm worker imports before a lease takes it, so the
        user's first ``import`` is instant, e.g. ``["torch"]``. They must not initialise
        CUDA (importing ``torch`` does not): a worker where CUDA is initialised cannot be
        bound and is replaced by a cold start. Default: none.
        ``c.NodeAgent.preload_modules = ["torch", "numpy"]``.""",
    ).tag(config=True)

    worker_templates = Bool(
        True, help="""Whether a cold worker is forked from a template of its interpreter (a process
        that has imported ipykernel, the worker extension and ``preload_modules`` once) instead of
        booting a new interpreter: a cold attach then skips those imports. The forked worker joins
        its cgroup and takes its account, environment and folder before it runs a line of its own.
        A worker whose PYTHONPATH or LD_LIBRARY_PATH differs from the template's boots. Default:
        True. ``c.NodeAgent.worker_templates = False``.""",
    ).tag(config=True)

    warm_worker_max_age = Duration(
        1800.0, help="""Seconds a warm worker may wait for a lease before it is stopped and
        replaced by a fresh one. Default: 30 minutes. ``c.NodeAgent.warm_worker_max_age = "1h"``.""",
    ).tag(config=True)

    @validate("warm_worker_max_age")
    def _warm_worker_max_age_valid(self, proposal: Any) -> float:
        if proposal["value"] <= 0:
            raise ValueError(f"warm_worker_max_age must be positive, got {proposal['value']}")
        return proposal["value"]

    transport_encryption = Enum(
        ["curve", "none"],
        help="""Whether the traffic between notebook kernels and this node's workers is
        encrypted. ``curve``: every worker binds its ZeroMQ sockets as CurveZMQ servers with a
        key pair of its own (jupyter_client's ``transport_encryption``); its owner gets the
        public key, and the secret key never leaves the node. ``none``: plain ZeroMQ, signed
        but readable by anyone on the network path. Default: ``curve`` when libzmq has CURVE
        (``zmq.has("curve")``), else ``none``. ``c.NodeAgent.transport_encryption = "curve"``.""",
    ).tag(config=True)

    @default("transport_encryption")
    def _transport_encryption_default(self) -> str:
        return "curve" if zmq.has("curve") else "none"

    @validate("transport_encryption")
    def _transport_encryption_valid(self, proposal: Any) -> str:
        if proposal["value"] == "curve" and not zmq.has("curve"):
            raise TraitError("transport_encryption='curve' needs a libzmq built with CURVE (libsodium); this "
                             "pyzmq's has none: install the pyzmq wheel, or set --transport-encryption=none")
        return proposal["value"]

    worker_user = Unicode(
        None, allow_none=True, help="""Linux user every worker (and so every user's code) runs
        as, instead of the agent's own user: it can then read neither the agent's token file
        nor its state. The agent must run as root for this; the state directory must be
        reachable (``x``) by that user, who gets its own connection file there and works in
        its home directory (or ``STATE_DIR/worker-home`` when it has none). None (default):
        workers run as the agent's user. ``c.NodeAgent.worker_user = "gpupool-worker"``
        (create it with ``useradd --system --no-create-home gpupool-worker``).
        A template with ``{username}`` names an account per lease from its owner:
        ``"{username}"`` runs each worker as the notebook user's own account, where
        the node knows the users (LDAP/NSS) and shares their homes; a lease whose
        owner has no account here is refused.""",
    ).tag(config=True)

    environments = Dict(
        key_trait=Unicode(), value_trait=Unicode(),
        help="""Worker environments a lease may name: name -> a Python interpreter, or a
        conda/venv prefix (``PREFIX/bin/python``). Each needs ipykernel and gpupool's
        worker part (``pip install 'gpupool[worker]'`` in it); the agent checks each
        at start and reports which are usable (``gpupool pool``). The agent's own
        Python is there too, as ``default``. Default: none besides it.
        ``c.NodeAgent.environments = {"torch": "/opt/conda/envs/torch", "py311": "/usr/bin/python3.11"}``.""",
    ).tag(config=True)

    default_environment = Unicode(
        "", help="""The environment of a lease that names none. Default: empty, meaning
        ``default`` (the agent's own Python). ``c.NodeAgent.default_environment = "torch"``.""",
    ).tag(config=True)

    worker_users = List(
        Unicode(), help="""A pool of Linux users for workers, instead of one ``worker_user``:
        every worker (warm ones included) runs as an account that no other live worker has,
        so two users' workers on one node cannot read each other's files, environment or
        memory; an account is used again only once no process runs as it, after its files in
        /tmp, /var/tmp, /dev/shm and its work directory are removed (docs/security.md,
        "Containment"). Needs root and accounts of their own (never a person's): as many as
        leases may run on the node at once, plus ``warm_workers``; a start fails, naming this
        setting, when all are in use. Default: empty.
        ``c.NodeAgent.worker_users = [f"gpupool-w{i}" for i in range(8)]``.""",
    ).tag(config=True)

    cgroup_mode = Enum(
        list(CGROUP_MODES), "auto", help="""How the agent holds each worker's processes together, so
        that none outlives its lease (docs/security.md, "Containment"): ``v2`` (a cgroup per
        worker in the unified hierarchy, killed with ``cgroup.kill``), ``v1`` (the freezer,
        memory, pids and cpu hierarchies: freeze, kill, thaw), ``none`` (the worker's process
        group and process tree only: a double-forked daemon escapes; a loud warning), or
        ``auto`` (default: v2, else v1, else none with the reasons). ``v2`` and ``v1`` refuse to
        start the agent when they cannot be had. ``c.NodeAgent.cgroup_mode = "v2"``.""",
    ).tag(config=True)

    worker_pids_max = Integer(
        0, min=0, help="""Tasks (processes and threads together) each lease's worker may have: its
        cgroup's ``pids.max``. A fork or a new thread beyond it fails in that worker only
        (``BlockingIOError: Resource temporarily unavailable``), so a cell that forks without end
        stops there and other workers, new leases and the agent go on (docs/enforcement.md,
        "Processes"). 0 (default): sized per slice, the lease's share of the node's GPUs (GPUs x
        fraction / the node's GPUs) of what the workers may have together (see
        ``agent_pids_reserve``), at least 128. ``c.NodeAgent.worker_pids_max = 4096``.""",
    ).tag(config=True)

    agent_pids_reserve = Integer(
        1024, min=0, help="""Tasks (processes and threads) the workers never take from the agent and
        whatever shares its cgroup: all workers together are capped (``pids.max`` of the agent's
        cgroup subtree) at the node's task limit less this many. The node's limit is the lowest of
        ``kernel.pid_max``, ``kernel.threads-max``, the agent's RLIMIT_NPROC and the ``pids.max`` of
        its cgroup and each above it (systemd's ``TasksMax``, a container's pids limit); at most half
        of it is kept. Default 1024. ``c.NodeAgent.agent_pids_reserve = 2048``.""",
    ).tag(config=True)

    cgroup_root = Unicode(
        "", help="""The cgroup subtree the workers' cgroups are made in: a path from the
        hierarchy's root (``/system.slice/gpupool-agent.service/workers``) or relative to the
        agent's own cgroup (``/proc/self/cgroup``). It must be the agent's alone: a restarted
        agent kills every cgroup there that it does not re-adopt. Empty (default):
        ``gpupool/agent-HASH`` under the agent's own cgroup, HASH from the state directory,
        which under systemd is the subtree ``Delegate=yes`` gives the unit.
        ``c.NodeAgent.cgroup_root = "gpupool"``.""",
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
        Kubernetes manifests and the systemd unit turn it on. ``c.NodeAgent.require_containment = True``.""",
    ).tag(config=True)

    checkpointer = Unicode(
        "auto",
        help=f"""How this node moves a parked worker's GPU state to host memory and back
        (docs/parking.md), one of auto, {", ".join(checkpoint.available())}: ``cuda-checkpoint``
        (NVIDIA's utility on PATH, driver r550+: the whole CUDA state of any framework, even
        while a cell runs; onto another GPU of the same model where its ``--help`` offers
        ``--device-map``), ``framework`` (the worker moves its PyTorch tensors to pinned host
        memory in place between cells: a running cell is interrupted to park; CuPy and JAX
        arrays and the CUDA context stay on the GPU, said in words), ``simulated`` (the
        simulated GPUs' memory of a ``--simulate`` node), or a checkpointer of the
        ``gpupool.checkpointers`` entry point group. ``auto`` (default): ``cuda-checkpoint``
        where it works, ``simulated`` on simulated GPUs, else ``framework``. Reported at
        registration. ``c.NodeAgent.checkpointer = "framework"``.""",
    ).tag(config=True)

    @validate("checkpointer")
    def _checkpointer_valid(self, proposal: Any) -> str:
        return _auto_or_one_of(proposal, checkpoint.available())

    parked_memory = ByteSize(
        None, allow_none=True,
        help="""Host RAM this node's parked workers may hold together (their processes and the
        GPU state moved out of the GPU), bytes or units (``"256GiB"``); reported at
        registration. When a park would take them past it, the longest-parked workers are
        spilled to ``spill_dir`` (their namespace saved, their process ended; what cannot be
        saved is listed in words), and a worker that alone would not fit spills at once.
        Default: None, a quarter of the host's RAM (``host_memory`` when set, else psutil's
        total): parked workers share the host with the active leases, whose own host memory
        the service places by, so most of it stays theirs. ``c.NodeAgent.parked_memory = "512GiB"``.""",
    ).tag(config=True)

    spill_dir = Unicode(
        "", help="""Folder for the namespaces of spilled workers (one folder per lease, the
        agent's only, removed when the lease resumes or ends); fast local disk, with room for
        ``parked_memory`` at least. Default: empty, ``STATE_DIR/spill``.
        ``c.NodeAgent.spill_dir = "/scratch/gpupool-spill"``.""",
    ).tag(config=True)

    park_headroom = ByteSize(
        None, allow_none=True,
        help="""Host memory a park must leave available (``MemAvailable`` of /proc/meminfo) after
        it moves a worker's GPU state to host RAM, bytes or units; a park that would leave less
        spills the worker to disk instead, so a host short of memory never has the kernel's
        OOM killer end a parked worker. Default: None, 5 % of the host's RAM, at least 1 GiB.
        ``c.NodeAgent.park_headroom = "8GiB"``.""",
    ).tag(config=True)
