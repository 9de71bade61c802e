"""The node agent: ``gpupool agent``.

One per GPU node. It discovers the node's GPUs (NVML, or ``--simulate``),
registers them with the pool service, serves the service's calls to start and
stop workers (docs/api.md, "Agent"), and heartbeats worker states and GPU
metrics. On SIGTERM or SIGINT it saves each lease's worker to its spill folder
(``c.AgentParking.park_on_stop``: the leases stay parked on disk for the next
agent here), stops every worker, verifies they are gone, and exits 0. Killed
or crashed instead, it leaves the workers running; when it starts again it
re-adopts the lease workers that still run and stops every other process it
had started (:mod:`.workers.recovery`).

Beside it: the settings other than its own ``c.NodeAgent``, a class per
concern (:mod:`.settings`: ``c.AgentInventory``, ``c.AgentEnforcement``,
``c.AgentWorkers``, ``c.AgentParking``), HTTP API and server (:mod:`.agent_http`),
calls to the service (:mod:`.agent_service`), tokens (:mod:`.agent_tokens`),
worker accounts (:mod:`.agent_accounts`), metrics (:mod:`.agent_metrics`) and
enforcement (:mod:`.enforcement`). The agent builds these parts and hands each
only what it uses (:meth:`NodeAgent.api`, :meth:`NodeAgent.service_link`), so
none of them imports it back.

    gpupool agent --service-url=http://pool:8765 --token-file=/etc/gpupool/agent_token
    gpupool agent --service-url=http://127.0.0.1:8765 --simulate=2xA100-80GB --port=0
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from traitlets import Integer, Unicode, default, validate
from traitlets.config import Application, Config, catch_config_error

from gpupool.config_files import load_config_file
from gpupool.errors import GPUPoolError, Reason
from gpupool.leaseargs import join_negative_values
from gpupool.moved_settings import carry_moved, new_homes
from gpupool.tls import client_context, server_context
from gpupool.statedir import lock_state_dir
from gpupool.traits import Duration
from gpupool.wire.nodes import (GPUReading, Heartbeat, NodeRegistration, WorkerEnvironment, WorkerReport,
                                is_node_name)

from . import checkpoint, enforcement, process_limits
from . import environments as worker_envs
from .agent_accounts import WorkerAccountSettings
from .agent_http import AgentAPI, WorkerAdmission, advertised_ip, listen, serve_api
from .agent_metrics import AgentMetrics, workers_by_gpu
from .agent_service import LinkSettings, NodeSide, ServiceLink
from .agent_tokens import AgentTokens
from .attribution import add_unattributed, attribute, memory_by_pid, read_parents
from .cgroups import CgroupError, Containment, containment
from .node_gpus import NodeGPUs
from .host_limits import host_totals
from .inventory import Inventory, select_inventory
from .settings import AgentEnforcement, AgentInventory, AgentParking, AgentWorkers
from .workers import WarmSettings, WorkerLaunch, WorkerManager
from .workers import launchers
from .workers.launchers.kubernetes import KubernetesLauncher
from .workers.launchers.slurm import SlurmLauncher
from .workers.parking import ParkSettings
from .workers.spillmove import SpillSource

#: The agent's settings besides its own (``c.NodeAgent``), one class per concern.
SETTINGS_PARTS = (AgentInventory, AgentEnforcement, AgentWorkers, AgentParking)


class NodeAgent(Application):
    """``gpupool agent``: the per-node daemon. Its own settings (``c.NodeAgent``)
    say who it is, where the service is and how it listens; the rest are its
    parts' (:data:`SETTINGS_PARTS`, built by :meth:`read_settings`)."""

    name = "gpupool-agent"
    #: What the launcher says the node has for leases (cores, bytes), asked once (:meth:`host_totals`).
    _launcher_host: tuple[float | None, int | None] | None = None
    description = """The gpupool node agent: registers this node's GPUs with the pool service,
    starts and stops one Jupyter kernel (worker) per lease, and reports worker
    activity and GPU metrics."""

    # The cluster launchers' settings are read by worker_launcher = "slurm" or "kubernetes".
    classes = [*SETTINGS_PARTS, SlurmLauncher, KubernetesLauncher]
    # A config file that fails to run stops the agent (one line: gpupool.config_files) instead of
    # traitlets' logged traceback and a start with the defaults.
    raise_config_file_errors = True

    aliases = {
        "service-url": "NodeAgent.service_url",
        "token-file": "NodeAgent.token_file",
        "simulate": "AgentInventory.simulate",
        "inventory": "AgentInventory.inventory_source",
        "name": "NodeAgent.node_name",
        "ip": "NodeAgent.ip",
        "port": "NodeAgent.port",
        "state-dir": "NodeAgent.state_dir",
        "config": "NodeAgent.config_file",
        "enforcement": "AgentEnforcement.enforcement_mode",
        "warm-workers": "AgentWorkers.warm_workers",
        "worker-launcher": "AgentWorkers.worker_launcher",
        "worker-user": "AgentWorkers.worker_user",
        "cgroup-mode": "AgentEnforcement.cgroup_mode",
        "checkpointer": "AgentParking.checkpointer",
        "parked-memory": "AgentParking.parked_memory",
        "spill-dir": "AgentParking.spill_dir",
        "transport-encryption": "AgentWorkers.transport_encryption",
        "ssl-cert": "NodeAgent.ssl_cert",
        "ssl-key": "NodeAgent.ssl_key",
        "ca-file": "NodeAgent.ca_file",
        "metrics-token-file": "NodeAgent.metrics_token_file",
        "log-level": "Application.log_level",
    }
    flags = {**Application.flags, "require-containment": (
        {"AgentEnforcement": {"require_containment": True}},
        "Refuse to serve when the configured cgroup or enforcement mode cannot be had "
        "(c.AgentEnforcement.require_containment).")}

    service_url = Unicode(
        "", help="""Base URL of the pool service, e.g. ``http://pool:8765`` (standalone) or
        ``http://hub:8000/services/gpupool``. Required. ``c.NodeAgent.service_url = "http://pool:8765"``.""",
    ).tag(config=True)

    token_file = Unicode(
        "", help="""File holding the agent token (the service writes one to
        ``STATE_DIR/agent_token``). Without it the token is read from the
        GPUPOOL_AGENT_TOKEN environment variable. ``c.NodeAgent.token_file = "/etc/gpupool/agent_token"``.""",
    ).tag(config=True)

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
        "", help="""A config file (``gpupool_config.py``) setting ``c.NodeAgent.*`` and its parts'
        (``c.AgentInventory.*``, ``c.AgentEnforcement.*``, ``c.AgentWorkers.*``, ``c.AgentParking.*``,
        ``c.SlurmLauncher.*``, ``c.KubernetesLauncher.*``); the command line wins.""",
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

    metrics_token_file = Unicode(
        "", help="""File holding the token Prometheus sends to ``GET /metrics``
        (``Authorization: Bearer TOKEN``); the agent token is accepted there too.
        Default: empty (the agent token only). Read at start.
        ``c.NodeAgent.metrics_token_file = "/etc/gpupool/metrics_token"``.""",
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

    def update_config(self, config: Config) -> None:
        """Traitlets' merge of a command line or config file, after carrying each
        setting written with its old class, ``c.NodeAgent.warm_workers``, to its
        part's, ``c.AgentWorkers.warm_workers`` (:mod:`gpupool.moved_settings`;
        the log names the new spelling)."""
        carry_moved(config, "NodeAgent", new_homes(SETTINGS_PARTS), self.log.warning)
        super().update_config(config)

    # -- setup ------------------------------------------------------------------------------------------------

    def parse_command_line(self, argv: list[str] | None = None) -> None:
        """traitlets' parse, with ``--simulate -1xA100-80GB`` read as ``--simulate=-1xA100-80GB``
        for every alias: argparse takes a value that starts with '-' and a digit for an option and
        says ``expected one argument``, where the value's own check says what is wrong with it."""
        argv = sys.argv[1:] if argv is None else argv
        super().parse_command_line(join_negative_values(argv, {f"--{alias}" for alias in self.aliases}))

    def initialize(self, argv: list[str] | None = None) -> None:
        """Read the command line and config file, the token and the GPUs.
        Raises GPUPoolError (printed by ``gpupool``) for a bad setup."""
        self.parse_command_line(argv)
        if self.config_file:
            load_config_file(self, Path(self.config_file).expanduser().resolve())
        self.read_settings()
        if not self.service_url:
            raise GPUPoolError(Reason.not_configured,
                               "no service URL: pass --service-url=http://HOST:PORT of the pool service")
        self.service_url = self.service_url.rstrip("/")
        self.check_start_settings()
        self.tls = server_context(self.ssl_cert, self.ssl_key, "--ssl-cert / --ssl-key")
        self.service_tls = client_context(self.ca_file)
        self.tokens = AgentTokens(self.token_file, self.metrics_token_file)
        self.metrics = AgentMetrics(self.node_name)
        workers, gpus = self.agent_workers, self.agent_inventory
        try:
            self.launcher = launchers.launcher_class(workers.worker_launcher)
        except (ValueError, TypeError) as exc:  # a plugin gone since the setting was checked, or a broken one
            raise GPUPoolError(Reason.not_configured, f"{exc} (c.AgentWorkers.worker_launcher)") from None
        # Before the worker accounts' own checks: with a launcher that cannot use them, those are moot.
        self.launcher.check_settings(self.config, bool(workers.worker_user or workers.worker_users), self.log)
        self.worker_environments = self.check_environments()
        self.account_settings = WorkerAccountSettings(workers.worker_user, workers.worker_users, self.state_dir,
                                                      self.node_name, self.log)
        self.inventory: Inventory = select_inventory(gpus.simulate or None, self.node_name, gpus.host_proc or None,
                                                     retry=(gpus.nvml_retry_min, gpus.nvml_retry_max),
                                                     timeout=gpus.nvml_timeout, source=gpus.inventory_source)
        found = {gpu.uuid: gpu for gpu in self.inventory.discover()}
        self.metrics.update(found.values(), [], {}, None)  # the GPUs, before the first heartbeat's readings
        #: Why this agent refuses to serve (c.AgentEnforcement.require_containment), in words; None: it serves.
        self.refusal: str | None = None
        mode = self.agent_enforcement.enforcement_mode
        try:
            self.node_gpus = NodeGPUs(found, enforcement.resolve(mode, self.inventory.kind, found))
            if mode not in ("auto", self.node_gpus.enforcement.name):
                self.log.warning("enforcement mode %r does not run on %s GPUs: slices are enforced with %r here "
                                 "(c.AgentEnforcement.enforcement_mode)", mode, self.inventory.kind,
                                 self.node_gpus.enforcement.name)
            self.node_gpus.enforcement.setup(self.state_dir, self.log)
        except RuntimeError as exc:  # the mode cannot be had here (no MPS daemon)
            if not self.agent_enforcement.require_containment:
                raise GPUPoolError(Reason.not_configured, str(exc)) from None
            self.node_gpus = NodeGPUs(found, enforcement.NoEnforcement())
            self.refusal = f"enforcement mode {mode!r} cannot be had: {exc}"
        except (ValueError, TypeError) as exc:  # an unknown or broken plugin
            raise GPUPoolError(Reason.not_configured, str(exc)) from None
        try:
            self.gpu_checkpointer = checkpoint.resolve(self.agent_parking.checkpointer, checkpoint.NodeFacts(
                self.inventory.kind, self.inventory.versions().get("driver")), self.log)
        except (ValueError, TypeError) as exc:  # cannot work here; a broken plugin
            raise GPUPoolError(Reason.not_configured, str(exc)) from None
        self.url = ""
        self._background: set[asyncio.Task] = set()
        self._stopping: set[str] = set()

    @catch_config_error
    def read_settings(self) -> None:
        """Build the agent's parts (:data:`SETTINGS_PARTS`) from its config, once
        the command line and the config file are read: ``agent_inventory``,
        ``agent_enforcement``, ``agent_workers``, ``agent_parking``. A bad value
        is said in one line and exits 1, as one of ``c.NodeAgent`` is."""
        self.agent_inventory = AgentInventory(parent=self)
        self.agent_enforcement = AgentEnforcement(parent=self)
        self.agent_workers = AgentWorkers(parent=self)
        self.agent_parking = AgentParking(parent=self)

    def check_start_settings(self) -> None:
        """Settings that can never work, refused in one line before the agent makes anything
        (state folder, cgroups) or registers: a node name the service refuses, a service URL
        that is not ``http(s)://HOST``, an ``--ip`` that names no address, a ``spill_dir`` that
        cannot be made. GPUPoolError ``not_configured``."""
        if not is_node_name(self.node_name):
            raise GPUPoolError(Reason.not_configured,
                               f"--name={self.node_name!r} cannot name a node: 1 to 200 characters without '/', "
                               "control characters or surrounding spaces (c.NodeAgent.node_name)")
        parts = urlsplit(self.service_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise GPUPoolError(Reason.not_configured, f"--service-url={self.service_url!r} is not an http:// or "
                               "https:// URL of the pool service (c.NodeAgent.service_url)")
        try:
            socket.getaddrinfo(self.ip or None, None, flags=socket.AI_PASSIVE)
        except (OSError, UnicodeError) as exc:
            raise GPUPoolError(Reason.not_configured, f"--ip={self.ip} names no address of this host "
                               f"({getattr(exc, 'strerror', None) or exc}; c.NodeAgent.ip)") from None
        spill_dir = self.agent_parking.spill_dir
        if spill_dir:  # the admin's own folder, made now: a bad one stops the start before the state folder is
            try:
                Path(spill_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as exc:
                raise GPUPoolError(Reason.not_configured, f"--spill-dir={spill_dir} cannot be made: "
                                   f"{exc.strerror or exc} (c.AgentParking.spill_dir)") from None

    def containment(self, state_dir: Path) -> Containment:
        """The workers' cgroups (``cgroup_mode``, ``cgroup_root`` of ``c.AgentEnforcement``);
        GPUPoolError ``not_configured`` when the mode asked for cannot be had."""
        settings = self.agent_enforcement
        try:
            return containment(settings.cgroup_mode, settings.cgroup_root, state_dir, log=self.log)
        except CgroupError as exc:
            raise GPUPoolError(Reason.not_configured, str(exc)) from None

    def check_environments(self) -> list[WorkerEnvironment]:
        """Check every worker environment once (:func:`.environments.check_all`);
        unusable ones are logged and reported, not fatal."""
        try:
            found = worker_envs.check_all(self.agent_workers.environments, self.agent_workers.default_environment)
        except ValueError as exc:
            raise GPUPoolError(Reason.not_configured, str(exc)) from None
        for env in found:
            if not env.usable:
                self.log.warning("worker environment %r is not usable: %s", env.name, env.problem)
        if not any(env.default and env.usable for env in found):
            raise GPUPoolError(Reason.not_configured, "the default worker environment cannot run workers: "
                               f"{next(e.problem for e in found if e.default)} (c.AgentWorkers.default_environment)")
        return found

    def worker_reports(self) -> list[WorkerReport]:
        return self.workers.reports(self.inventory.process_memory())

    # -- run --------------------------------------------------------------------------------------------------

    def start(self) -> None:
        asyncio.run(self.run())

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT, then save the workers to disk and stop them."""
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopping.set)
        sockets = listen(self.ip, self.port)  # a port taken stops the start before the state folder is made
        try:
            await self._start_workers()
            server, self.url = serve_api(self.api(), sockets, self.ip, self.tls)
        except BaseException:  # undo what the start made, then say why
            for sock in sockets:
                sock.close()
            self._undo_start()
            raise
        if self.refusal is not None:
            await self._refuse(server, stopping)
            return
        service = self.service_link()
        where = self.workers.launcher.where()
        launcher = self.agent_workers.worker_launcher + (f" on {where}" if where else "")
        self.log.info("agent %s serving on %s with %d %s GPU(s) (enforcement: %s, checkpointer: %s, "
                      "worker launcher: %s); service %s", self.node_name, self.url, len(self.node_gpus.gpus),
                      self.inventory.kind, self.node_gpus.enforcement.name, self.gpu_checkpointer.name, launcher,
                      self.service_url)
        service_task = asyncio.create_task(service.run())
        self.workers.start_warm_pool()
        await stopping.wait()
        self.log.info("stopping: shutting down %d worker(s)", len(self.workers.lease_ids()))
        service_task.cancel()
        await asyncio.gather(service_task, return_exceptions=True)
        server.stop()
        parks, failed = self.agent_parking.park_on_stop, {}
        listed = set(self.workers.lease_ids())  # from now on no start begins; one under way ends after this
        if parks and listed:
            why = f"the node agent on {self.node_name} is stopping"
            saved, failed = await self.workers.spill_all(why, self.agent_parking.park_on_stop_timeout)
            self.log.info("saved %d worker(s) to disk: their leases stay parked for the next agent here", len(saved))
        codes = await self.workers.stop_all(keep_spills=parks)
        for lease_id in sorted(set(codes) - listed):
            # Its start was under way: the worker never ran a cell. Left out of the goodbye, so that the
            # service places the lease again rather than ending it (docs/parking.md, "Agent restarts").
            self.log.info("lease %s: its worker started during the stop and was stopped unused", lease_id)
            codes.pop(lease_id)
        await service.goodbye(codes, self.workers.reports() if parks else [], failed)
        await server.close_all_connections()
        service.close()
        self.workers.close()
        self.inventory.close()
        self.node_gpus.enforcement.close(self.log)
        self.log.info("agent %s stopped", self.node_name)

    def _undo_start(self) -> None:
        """After :meth:`_start_workers`, when the agent cannot go on to serve:
        remove the cgroup subtree it made (quietly left while a re-adopted
        worker still runs in it: that worker is left to the next start) and
        close what it opened, as a clean stop does."""
        workers = getattr(self, "workers", None)
        if workers is not None:
            workers.close()
        self.inventory.close()
        self.node_gpus.enforcement.close(self.log)

    def api(self) -> AgentAPI:
        """What the HTTP handlers use; once :meth:`_start_workers` has run (a
        refusing agent has no workers then, and its handlers ask for none)."""
        refusing = self.refusal is not None
        return AgentAPI(self.node_name, self.log, self.tokens, self.metrics,
                        refusal=self.refusal_words() if refusing else None,
                        admission=None if refusing else self.admission(),
                        workers=None if refusing else self.workers, reports=self.worker_reports)

    def admission(self) -> WorkerAdmission:
        """What a worker request is checked against: :attr:`node_gpus` as they are at
        each request (:meth:`refresh_inventory` replaces them)."""
        return WorkerAdmission(self.inventory, self.node_gpus, self.worker_environments, self.account_settings,
                               self.host_totals)

    def service_link(self) -> ServiceLink:
        """The link to the pool service: its settings, and this node's side of it."""
        settings = LinkSettings(self.service_url, self.node_name, self.service_tls, self.service_timeout,
                                   self.retry_max)
        node = NodeSide(self.registration, self.heartbeat, self.refresh_inventory, self.stop_workers,
                        self.write_agent_json, self.inventory)
        return ServiceLink(settings, self.tokens, node, self.log)

    async def _refuse(self, server: Any, stopping: asyncio.Event) -> None:
        """Serve only ``/health`` (503, :attr:`refusal`) until SIGTERM: no registration, no worker."""
        self.log.error("%s", self.refusal_words())
        await stopping.wait()
        server.stop()
        await server.close_all_connections()
        self.inventory.close()
        self.node_gpus.enforcement.close(self.log)
        self.log.info("agent %s stopped (it had refused to serve)", self.node_name)

    def refusal_words(self) -> str:
        """What a refusing agent says (log, ``/health``, ``gpupool health``): why, and the fixes."""
        return (f"gpupool agent {self.node_name} refuses to serve (c.AgentEnforcement.require_containment = True): "
                f"{self.refusal}. Give the agent what it needs (Kubernetes: a privileged container, or the host's "
                "cgroup subtree mounted read-write with c.AgentEnforcement.cgroup_root; systemd: Delegate=yes; an "
                "MPS control daemon or --enforcement=timeslice), or set c.AgentEnforcement.require_containment = "
                "False to run with less (docs/security.md, \"Containment\")")

    async def _start_workers(self) -> None:
        """Lock the state directory, make the worker manager, and re-adopt
        the lease workers a previous agent left running. A refusing agent
        (:attr:`refusal`, set here when the workers would get no cgroup) makes none."""
        state_dir = Path(self.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_fd = lock_state_dir(state_dir, "agent")
        claim_state_dir(state_dir, self.node_name, self.agent_parking.spill_folder(state_dir))
        confinement, workers = self.agent_enforcement, self.agent_workers
        cgroups = None if self.refusal else self.containment(state_dir)
        if cgroups is not None and confinement.require_containment and cgroups.mode == "none":
            setting = f"c.AgentEnforcement.cgroup_mode = {confinement.cgroup_mode!r}"
            # cgroup_mode = 'none' is its own reason: said once, not "(setting): setting".
            why = "" if cgroups.why == setting else f": {cgroups.why}"
            self.refusal = f"the workers' cgroups cannot be made ({setting}){why}"
        if self.refusal is not None:
            if cgroups is not None:
                cgroups.close()
            return
        if self.account_settings.separate:
            state_dir.chmod(0o711)  # enter, not list: the worker user reaches only its own files
            self.account_settings.open_spill_folder(self.agent_parking.spill_folder(state_dir))
        cgroups = self.containment(state_dir)
        try:
            settings = WorkerLaunch(
                state_dir, node=self.node_name, ip=self.ip, advertise_ip=advertised_ip(self.ip),
                start_timeout=workers.worker_start_timeout, stop_timeout=workers.worker_stop_timeout,
                warm=WarmSettings(workers.warm_workers if self.launcher.keeps_warm else 0,
                                  tuple(workers.preload_modules), workers.warm_worker_max_age),
                encryption=workers.transport_encryption,
                user=self.account_settings.user, users=self.account_settings.users,
                enforcement=self.node_gpus.enforcement, config=self.config, templates=workers.worker_templates,
                pids=process_limits.plan(cgroups, confinement.agent_pids_reserve, confinement.worker_pids_max,
                                         len(self.node_gpus.gpus), self.log))
            self.workers = WorkerManager(settings, cgroups=cgroups, launcher=self.launcher, log=self.log,
                                         parking=self.park_settings(state_dir))
            if self.account_settings.template is not None:
                self.workers.workers_dir.chmod(0o711)  # each lease's account reads its own connection file
            adopted = await self.workers.recover()  # before the first report names the workers
            if adopted:
                self.log.info("re-adopted %d worker(s) left running by the previous agent: leases %s", len(adopted),
                              ", ".join(w.spec.lease_id for w in adopted))
        except BaseException:  # a half-made start removes its cgroups, then says why
            if getattr(self, "workers", None) is None:
                cgroups.close()
            raise

    def park_settings(self, state_dir: Path) -> ParkSettings:
        """How this node parks (``c.AgentParking``: its checkpointer, budget, spill folder and
        headroom, the defaults of the last three resolved with the host's memory and ``state_dir``)."""
        total = self.host_totals()[1]
        # Spills of leases moved here are fetched from the other agents of the pool, which share this
        # agent's token and are trusted as the service is (c.NodeAgent.ca_file).
        source = SpillSource(self.service_tls, lambda: self.tokens.token, self.agent_parking.spill_fetch_timeout)
        return ParkSettings(self.gpu_checkpointer, self.parked_budget(), self.agent_parking.spill_folder(state_dir),
                            self.agent_parking.headroom(total), self.inventory.process_memory, source)

    def parked_budget(self) -> int:
        """Bytes parked workers may hold: ``c.AgentParking.parked_memory``, or a quarter of the host's memory."""
        return self.agent_parking.budget(self.host_totals()[1])

    def registration(self) -> NodeRegistration:
        """What ``POST /nodes`` tells the service of this node."""
        cpus, memory = self.host_totals()
        return NodeRegistration(self.node_name, self.url, self.inventory.kind, **self.node_gpus.enforcement.registration(),
                                gpus=tuple(self.node_gpus.gpus.values()), workers=tuple(self.worker_reports()),
                                inventory_error=self.inventory.error, environments=tuple(self.worker_environments),
                                host_cpus=cpus, host_memory=memory, checkpointer=self.gpu_checkpointer.info(),
                                parked_memory=self.parked_budget())

    def host_totals(self) -> tuple[float, int]:
        """``(cores, bytes)`` this node offers leases: ``host_cpus``/``host_memory``
        where set, else what the launcher says the node has (a Slurm node's
        CPUs and memory, asked once), else this host's (:func:`.host_limits.host_totals`)."""
        offered = self.agent_inventory
        if offered.host_cpus and offered.host_memory:
            return host_totals(offered.host_cpus, offered.host_memory)
        if self._launcher_host is None:
            found = launchers.launcher_class(self.agent_workers.worker_launcher).host_totals(self.config, self.log)
            self._launcher_host = found or (None, None)
        cpus, memory = self._launcher_host
        return host_totals(offered.host_cpus or cpus, offered.host_memory or memory)

    def heartbeat(self) -> Heartbeat:
        """What the next ``POST /nodes/{name}/heartbeat`` tells the service; updates the agent's metrics."""
        usage = self.inventory.process_usage()  # one NVML process listing per heartbeat
        reports = self.workers.reports(memory_by_pid(usage))
        gpus = self.gpu_metrics(usage)
        bound = workers_by_gpu(self.workers.get(lease).spec for lease in self.workers.lease_ids()
                               if self.workers.get(lease).parked is None)
        self.metrics.update(self.node_gpus.gpus.values(), gpus, bound, self.inventory.error, reports)
        return Heartbeat(tuple(reports), tuple(GPUReading.of(g) for g in gpus), self.inventory.error)

    async def refresh_inventory(self) -> bool:
        """Once per heartbeat: read NVML (in its helper process, off this
        loop: :class:`~.inventory.nvml.watch.WatchedInventory`), or open it again when it
        failed and its backoff has passed. True when it just came back, with
        ``gpus`` read again."""
        if not await self.inventory.update():
            return False
        node_gpus = self.node_gpus
        node_gpus.gpus = {gpu.uuid: gpu for gpu in self.inventory.discover()}
        mode = enforcement.after_rediscovery(node_gpus.enforcement, self.agent_enforcement.enforcement_mode,
                                             node_gpus.gpus)
        if mode is not node_gpus.enforcement:
            node_gpus.enforcement.close(self.log)
            node_gpus.enforcement = mode
            self.workers.use_enforcement(mode)
        return True

    def gpu_metrics(self, usage: list) -> list[dict[str, Any]]:
        """The inventory's GPU readings plus ``memory_unattributed`` (bytes of
        processes that belong to no worker), from this heartbeat's process
        listing ``usage``; stops, through the memory watchdog, workers over
        their slice, where the enforcement mode asks for it
        (:meth:`~.enforcement.EnforcementMode.over_limit`)."""
        metrics = self.inventory.metrics()
        if not usage:
            return metrics
        live = {lease: self.workers.get(lease) for lease in self.workers.lease_ids()}
        live = {lease: worker for lease, worker in live.items() if not worker.dead}
        watched = {lease: worker for lease, worker in live.items() if worker.parked is None}
        result = attribute(usage, {lease: w.pid for lease, w in live.items()}, read_parents())
        for lease, reason in self.node_gpus.enforcement.over_limit({l: m for l, m in result.memory.items() if l in watched},
                                                         {l: w.spec.memory for l, w in watched.items()}):
            self.log.warning("memory watchdog: stopping the worker of lease %s: %s", lease, reason)
            self.stop_workers([lease])
        return add_unattributed(metrics, result, self.inventory.process_known())

    def stop_workers(self, lease_ids: Any) -> None:
        """Stop, in the background, the workers the service says no lease holds, spilled ones too
        (their files go: a lease released while its move's spill was written leaves one)."""
        held = {*self.workers.lease_ids(), *self.workers.spilled_ids()}
        for lease_id in lease_ids or ():
            if isinstance(lease_id, str) and lease_id in held and lease_id not in self._stopping:
                self.log.info("no lease holds the worker of %s any more: stopping it", lease_id)
                self._stopping.add(lease_id)
                task = asyncio.create_task(self._stop_quietly(lease_id))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _stop_quietly(self, lease_id: str) -> None:
        try:
            await self.workers.stop(lease_id)
        except KeyError:
            pass
        except Exception as exc:
            self.log.error("could not stop the worker of lease %s: %s", lease_id, exc)
        finally:
            self._stopping.discard(lease_id)

    def write_agent_json(self) -> None:
        """``STATE_DIR/agent.json``: who this agent is, for scripts and tests."""
        path = Path(self.state_dir) / "agent.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"name": self.node_name, "url": self.url, "pid": os.getpid()}))
        tmp.replace(path)


def claim_state_dir(state_dir: Path, name: str, spill_folder: Path) -> None:
    """Record in ``STATE_DIR/node.json`` that the state directory is node ``name``'s. GPUPoolError
    ``not_configured`` when it is another node's and still holds its workers' records or saved
    leases: an agent of another name would end them as leases it does not know."""
    path = state_dir / "node.json"
    try:
        owner = json.loads(path.read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        owner = None
    if owner not in (None, name):
        held = any((state_dir / "workers").glob("*.lease.json")) or \
            (spill_folder.is_dir() and any(spill_folder.iterdir()))
        if held:
            raise GPUPoolError(Reason.not_configured, f"the state directory {state_dir} holds the workers or saved "
                               f"leases of node {owner!r}: start this agent as --name={owner}, or give it a state "
                               "directory of its own (--state-dir); under another name it would end them")
    path.write_text(json.dumps({"name": name}))


def main(argv: list[str] | None = None) -> int:
    """``gpupool agent [options]``; returns the exit code (0 after SIGTERM)."""
    app = NodeAgent()
    app.initialize(sys.argv[1:] if argv is None else argv)
    app.start()
    return 0
