"""The node agent: ``gpupool agent``.

One per GPU node. It discovers the node's GPUs (NVML, or ``--simulate``),
registers them with the pool service, serves the service's calls to start and
stop workers (docs/api.md, "Agent"), and heartbeats worker states and GPU
metrics. On SIGTERM or SIGINT it stops every worker, verifies they are gone,
and exits 0. Killed or crashed instead, it leaves the workers running; when
it starts again it re-adopts the lease workers that still run and stops
every other process it had started (:mod:`.adoption`).

    gpupool agent --service-url=http://pool:8765 --token-file=/etc/gpupool/agent_token
    gpupool agent --service-url=http://127.0.0.1:8765 --simulate=2xA100-80GB --port=0
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets
import zmq
from traitlets import Dict, Enum, Float, Integer, List, TraitError, Unicode, default, validate
from traitlets.config import Application

from gpupool import httpin
from gpupool.errors import GPUPoolError, bad_request, not_found
from gpupool.tls import client_context, server_context, untrusted, untrusted_message
from gpupool.schema import GPUInfo, WorkerReport
from gpupool.statedir import lock_state_dir
from gpupool.traits import ByteSize, Duration

from .agent_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, AgentMetrics
from .attribution import add_unattributed, attribute, memory_by_pid, read_parents
from . import environments as worker_envs
from .enforcement import MemoryWatchdog, MPSControl, check_slice, enforcement_mode, mps_daemon_running
from .inventory import Inventory, select_inventory
from .inventory_retry import backoff_delay
from .host_limits import enforce as enforce_host_limits, host_totals, parse_host_limits
from .cgroups import MODES as CGROUP_MODES, CgroupError, Containment, containment
from .worker_user import WorkerUser, WorkerUserPool
from .workers import WarmSettings, WorkerManager, WorkerSpec, WorkerStartError, WorkerStopError

TOKEN_ENV = "GPUPOOL_AGENT_TOKEN"
#: Seconds before the first registration retry; each failure doubles it, up to ``retry_max``.
REGISTRATION_RETRY_FIRST_S = 0.5


# -- request parsing (pure) ----------------------------------------------------------------------------------

def parse_worker_request(body: Any, gpus: dict[str, GPUInfo]) -> WorkerSpec:
    """Validate a ``POST /workers`` body against this node's ``gpus`` (uuid ->
    GPUInfo). ``memory`` may be omitted: then the fraction's share of the
    smallest GPU's usable memory. Raises a 400 GPUPoolError naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    lease_id, owner = body.get("lease_id"), body.get("owner")
    if not isinstance(lease_id, str) or not isinstance(owner, str) or not owner or len(owner) > 200:
        raise bad_request("'lease_id' and 'owner' must be non-empty strings")
    uuids = body.get("gpus")
    if not isinstance(uuids, list) or not uuids or not all(isinstance(u, str) for u in uuids):
        raise bad_request("'gpus' must be a non-empty list of GPU UUIDs")
    unknown = [u for u in uuids if u not in gpus]
    if unknown or len(set(uuids)) != len(uuids):
        raise bad_request(f"'gpus' must name distinct GPUs of this node; unknown: {', '.join(unknown) or 'none'}; "
                          f"this node has: {', '.join(gpus)}")
    chosen = tuple(gpus[u] for u in uuids)
    fraction = body.get("fraction", 1.0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise bad_request(f"'fraction' must be a number in (0, 1], got {fraction!r}")
    smallest = min(chosen, key=lambda g: g.memory_total)
    memory = body.get("memory")
    if memory is None:
        memory = int((smallest.memory_total - smallest.memory_reserved) * fraction)
    if isinstance(memory, bool) or not isinstance(memory, int) or not 2**20 <= memory <= smallest.memory_total:
        raise bad_request(f"'memory' must be whole bytes from 1 MiB to the GPU's {smallest.memory_total}, got {memory!r}")
    try:
        return WorkerSpec(lease_id, owner, chosen, float(fraction), memory)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


# -- HTTP handlers ---------------------------------------------------------------------------------------------

@web.stream_request_body
class AgentHandler(httpin.BoundedBody, web.RequestHandler):
    """Base of the agent's handlers: agent-token auth, JSON in and out, every
    error as ``GPUPoolError.to_json()``. The token is checked before the body
    is read, and bodies are bounded (:mod:`gpupool.httpin`)."""

    auth_required = True

    @property
    def agent(self) -> "NodeAgent":
        return self.settings["agent"]

    def prepare(self) -> None:
        if self.auth_required and not self.agent.token_matches(self.request.headers.get("Authorization", "")):
            raise GPUPoolError("unauthorized", "missing or wrong agent token (send 'Authorization: token AGENT_TOKEN')",
                               401)
        try:
            self.start_body()
        except httpin.TooLarge as exc:
            raise bad_request(str(exc)) from None

    def json_body(self) -> Any:
        try:
            return httpin.loads(self.body() or b"null")
        except ValueError as exc:  # TooLarge is one
            raise bad_request(f"the request body is not valid JSON ({str(exc):.200})") from None

    def write_json(self, body: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, GPUPoolError):
            error = exc
        elif isinstance(exc, web.HTTPError):
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
            error = GPUPoolError(code, exc.log_message or self._reason, exc.status_code)
        else:
            error = GPUPoolError("internal_error", f"the agent failed: {exc or self._reason}", status_code)
        self.set_status(error.status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(error.to_json()))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(value, GPUPoolError):  # expected: no traceback; the reason only when it is ours
            level = logging.WARNING if value.status >= 500 else logging.DEBUG
            self.agent.log.log(level, "%s %s -> %s: %s", self.request.method, self.request.path, value.status,
                               value.message)
        else:
            super().log_exception(typ, value, tb)

    def send_error(self, status_code: int = 500, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        super().send_error(exc.status if isinstance(exc, GPUPoolError) else status_code, **kwargs)


class WorkersHandler(AgentHandler):
    """``GET /workers`` and ``POST /workers``."""

    async def get(self) -> None:
        self.write_json({"workers": [r.to_json() for r in self.agent.worker_reports()]})

    async def post(self) -> None:
        if self.agent.inventory.error:
            raise GPUPoolError("inventory_unavailable", f"this node cannot read its GPUs now: "
                               f"{self.agent.inventory.error}", 503)
        body = self.json_body()
        spec = parse_worker_request(body, self.agent.gpus)
        python = self.agent.python_for(body.get("env"))
        user = await asyncio.to_thread(self.agent.account_for, spec.owner)  # NSS may ask LDAP: off the loop
        cpus, host_memory = parse_host_limits(body, self.agent.host_totals())
        spec = dataclasses.replace(spec, python=python, user=user, cpus=cpus, host_memory=host_memory)
        try:
            check_slice(self.agent.enforcement, spec.fraction)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        try:
            worker = await self.agent.workers.start(spec)
        except WorkerStartError as exc:
            raise GPUPoolError("worker_start_failed", str(exc), 502) from None
        self.write_json({"pid": worker.pid, "connection": worker.connection()}, 201)


class WorkerHandler(AgentHandler):
    """``DELETE /workers/{lease_id}``."""

    async def delete(self, lease_id: str) -> None:
        try:
            code = await self.agent.workers.stop(lease_id)
        except KeyError:
            raise not_found(f"worker of lease {lease_id}") from None
        except WorkerStopError as exc:
            raise GPUPoolError("worker_stop_failed", str(exc), 500) from None
        self.write_json({"lease_id": lease_id, "exit_code": code})


class HealthHandler(AgentHandler):
    """``GET /health``: no token needed."""

    auth_required = False

    def get(self) -> None:
        self.write_json({"status": "ok", "node": self.agent.node_name})


class MetricsHandler(AgentHandler):
    """``GET /metrics``: Prometheus text (:mod:`.agent_metrics`), for the metrics
    token (``--metrics-token-file``) or the agent token."""

    def prepare(self) -> None:
        header = self.request.headers.get("Authorization", "")
        if not (self.agent.token_matches(header) or self.agent.metrics_token_matches(header)):
            raise GPUPoolError("unauthorized", "missing or wrong token: send 'Authorization: Bearer METRICS_TOKEN' "
                               "(the file of --metrics-token-file)", 401)

    def get(self) -> None:
        self.set_header("Content-Type", METRICS_CONTENT_TYPE)
        self.finish(self.agent.metrics.render())


class NotFoundHandler(AgentHandler):
    auth_required = False

    def prepare(self) -> None:
        raise not_found(f"{self.request.path} on this agent")


def agent_routes() -> list[tuple[str, type]]:
    return [(r"/workers", WorkersHandler), (r"/workers/([^/]+)", WorkerHandler), (r"/health", HealthHandler),
            (r"/metrics", MetricsHandler)]


# -- the application -------------------------------------------------------------------------------------------

class NodeAgent(Application):
    """``gpupool agent``: the per-node daemon."""

    name = "gpupool-agent"
    description = """The gpupool node agent: registers this node's GPUs with the pool service,
    starts and stops one Jupyter kernel (worker) per lease, and reports worker
    activity and GPU metrics."""

    aliases = {
        "service-url": "NodeAgent.service_url",
        "token-file": "NodeAgent.token_file",
        "simulate": "NodeAgent.simulate",
        "name": "NodeAgent.node_name",
        "ip": "NodeAgent.ip",
        "port": "NodeAgent.port",
        "state-dir": "NodeAgent.state_dir",
        "config": "NodeAgent.config_file",
        "enforcement": "NodeAgent.enforcement_mode",
        "warm-workers": "NodeAgent.warm_workers",
        "worker-user": "NodeAgent.worker_user",
        "cgroup-mode": "NodeAgent.cgroup_mode",
        "transport-encryption": "NodeAgent.transport_encryption",
        "ssl-cert": "NodeAgent.ssl_cert",
        "ssl-key": "NodeAgent.ssl_key",
        "ca-file": "NodeAgent.ca_file",
        "metrics-token-file": "NodeAgent.metrics_token_file",
        "log-level": "Application.log_level",
    }

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

    config_file = Unicode(
        "", help="""A config file (``gpupool_config.py``) setting ``c.NodeAgent.*``; the command line wins.""",
    ).tag(config=True)

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

    warm_worker_max_age = Duration(
        1800.0, help="""Seconds a warm worker may wait for a lease before it is stopped and
        replaced by a fresh one. Default: 30 minutes. ``c.NodeAgent.warm_worker_max_age = "1h"``.""",
    ).tag(config=True)

    @validate("warm_worker_max_age")
    def _warm_worker_max_age_valid(self, proposal: Any) -> float:
        if proposal["value"] <= 0:
            raise ValueError(f"warm_worker_max_age must be positive, got {proposal['value']}")
        return proposal["value"]

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

    enforcement_mode = Enum(
        ["auto", "mps", "mig", "timeslice", "exclusive"], "auto",
        help="""How this node confines workers to their slices (docs/enforcement.md):
        ``mps`` (the agent starts or joins the CUDA MPS control daemon; compute
        share and memory limit per worker), ``mig`` (whole MIG instances),
        ``timeslice`` (framework memory caps plus the agent's memory watchdog),
        ``exclusive`` (whole GPUs only). ``auto`` (default): ``mig`` when the
        GPUs are MIG instances, ``mps`` when an MPS daemon runs, else
        ``timeslice``. Simulated nodes report ``none``.
        ``c.NodeAgent.enforcement_mode = "mps"``.""",
    ).tag(config=True)

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

    default_environment = Unicode(
        "", help="""The environment of a lease that names none. Default: empty, meaning
        ``default`` (the agent's own Python). ``c.NodeAgent.default_environment = "torch"``.""",
    ).tag(config=True)

    metrics_token_file = Unicode(
        "", help="""File holding the token Prometheus sends to ``GET /metrics``
        (``Authorization: Bearer TOKEN``); the agent token is accepted there too.
        Default: empty (the agent token only). Read at start.
        ``c.NodeAgent.metrics_token_file = "/etc/gpupool/metrics_token"``.""",
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

    cgroup_root = Unicode(
        "", help="""The cgroup subtree the workers' cgroups are made in: a path from the
        hierarchy's root (``/system.slice/gpupool-agent.service/workers``) or relative to the
        agent's own cgroup (``/proc/self/cgroup``). It must be the agent's alone: a restarted
        agent kills every cgroup there that it does not re-adopt. Empty (default):
        ``gpupool/agent-HASH`` under the agent's own cgroup, HASH from the state directory,
        which under systemd is the subtree ``Delegate=yes`` gives the unit.
        ``c.NodeAgent.cgroup_root = "gpupool"``.""",
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

    # -- setup ------------------------------------------------------------------------------------------------

    def initialize(self, argv: list[str] | None = None) -> None:
        """Read the command line and config file, the token and the GPUs.
        Raises GPUPoolError (printed by ``gpupool``) for a bad setup."""
        self.parse_command_line(argv)
        if self.config_file:
            path = Path(self.config_file)
            if not path.is_file():
                raise GPUPoolError("not_configured", f"config file {path} does not exist (--config)")
            self.load_config_file(path.name, path=str(path.parent.resolve()))
        if not self.service_url:
            raise GPUPoolError("not_configured", "no service URL: pass --service-url=http://HOST:PORT of the pool service")
        self.service_url = self.service_url.rstrip("/")
        self.tls = server_context(self.ssl_cert, self.ssl_key, "--ssl-cert / --ssl-key")
        self.service_tls = client_context(self.ca_file)
        self.token = self.read_token()
        self.metrics_token = self._read_metrics_token()
        self.metrics = AgentMetrics(self.node_name)
        self.worker_environments = self.check_environments()
        self.user = self.worker_account()
        self.users = self.worker_pool()
        self.inventory: Inventory = select_inventory(self.simulate or None, self.node_name, self.host_proc or None,
                                                     retry=(self.nvml_retry_min, self.nvml_retry_max),
                                                     timeout=self.nvml_timeout)
        self.gpus = {gpu.uuid: gpu for gpu in self.inventory.discover()}
        self.metrics.update(self.gpus.values(), [], {}, None)  # the GPUs, before the first heartbeat's readings
        self.enforcement = enforcement_mode(self.inventory.kind,
                                            self.inventory.kind != "simulated" and mps_daemon_running(),
                                            self.enforcement_mode, any(u.startswith("MIG-") for u in self.gpus))
        self.watchdog = MemoryWatchdog()
        self.mps: MPSControl | None = None
        if self.enforcement == "mps":
            self.mps = MPSControl(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"),
                                  os.environ.get("CUDA_MPS_LOG_DIRECTORY", os.path.join(self.state_dir, "mps-log")))
            try:
                self.log.info("MPS control daemon %s (pipe directory %s)", self.mps.start(), self.mps.pipe_dir)
            except RuntimeError as exc:
                raise GPUPoolError("not_configured", f"{exc} (--enforcement=timeslice runs without MPS)") from None
            os.environ.update(self.mps.environment())  # workers inherit them
        self.url = ""
        self._background: set[asyncio.Task] = set()
        self._stopping: set[str] = set()

    def worker_pool(self) -> WorkerUserPool | None:
        """The ``worker_users`` pool, each account checked as ``worker_user``'s."""
        if not self.worker_users:
            return None
        if self.worker_user:
            raise GPUPoolError("not_configured", "set c.NodeAgent.worker_user or c.NodeAgent.worker_users, not both")
        try:
            return WorkerUserPool([self.worker_account(name) for name in self.worker_users], log=self.log)
        except ValueError as exc:
            raise GPUPoolError("not_configured", str(exc)) from None

    def worker_account(self, name: str | None = None) -> WorkerUser | None:
        """The ``worker_user`` account (or the account ``name``), checked:
        it exists, this agent may start processes as it, and it can reach the
        state directory. Raises GPUPoolError ``not_configured`` naming what
        is wrong."""
        option = "--worker-user" if name is None else "c.NodeAgent.worker_users"
        name = name or self.worker_user
        if not name:
            return None
        if is_user_template(self.worker_user or ""):  # an account per lease, looked up when the lease asks
            expand_worker_user(self.worker_user, "probe")  # a bad template stops the start
            return None
        try:
            user = WorkerUser.lookup(name)
            user.check_can_switch()
        except ValueError as exc:
            raise GPUPoolError("not_configured", f"{exc} ({option})") from None
        state_dir = Path(self.state_dir).resolve()
        python = Path(sys.executable).absolute()  # what workers run
        blocked = user.blocked_at(python) or user.blocked_at(python.resolve())
        if blocked is not None:
            raise GPUPoolError("not_configured", f"worker user {user.name!r} cannot run this Python ({python}): "
                               f"it may not enter or execute {blocked}; install gpupool where that user can "
                               "(e.g. a virtual environment under /opt) or pick another --worker-user")
        # The state dir itself is opened to it (0711) when the agent starts.
        blocked = user.blocked_at(next(folder for folder in state_dir.parents if folder.exists()))
        if blocked is not None:
            raise GPUPoolError("not_configured", f"worker user {user.name!r} cannot enter {blocked} on the way to "
                               f"the state directory {state_dir} (--state-dir), where its connection files are: "
                               f"allow it (chmod o+x {blocked}) or choose another state directory")
        return user

    def account_for(self, owner: str) -> WorkerUser | None:
        """The account of ``owner``'s worker when ``worker_user`` is a template
        (None otherwise: the one fixed account). Raises a 400 GPUPoolError when
        the owner has no account on this node, or it may not be switched to."""
        if not is_user_template(self.worker_user or ""):
            return None
        name = expand_worker_user(self.worker_user, owner)
        try:
            user = WorkerUser.lookup(name)
            user.check_can_switch()
        except ValueError as exc:
            raise GPUPoolError("worker_user_unknown", f"cannot start the worker of {owner!r} on node "
                               f"{self.node_name}: {exc} (c.NodeAgent.worker_user = {self.worker_user!r})",
                               400) from None
        if user.uid == 0:
            raise bad_request(f"refusing to run {owner!r}'s worker as root (c.NodeAgent.worker_user)")
        return user

    def containment(self, state_dir: Path) -> Containment:
        """The workers' cgroups (``cgroup_mode``, ``cgroup_root``); GPUPoolError
        ``not_configured`` when the mode asked for cannot be had."""
        try:
            return containment(self.cgroup_mode, self.cgroup_root, state_dir, log=self.log)
        except CgroupError as exc:
            raise GPUPoolError("not_configured", str(exc)) from None

    def read_token(self) -> str:
        """The agent token, from ``token_file`` or GPUPOOL_AGENT_TOKEN. Read
        again before each registration, so a rotated token is picked up."""
        if self.token_file:
            try:
                token = Path(self.token_file).read_text().strip()
            except OSError as exc:
                raise GPUPoolError("not_configured", f"cannot read the agent token file {self.token_file}: "
                                   f"{exc.strerror} (--token-file)") from None
        else:
            token = os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            raise GPUPoolError("not_configured", "no agent token: pass --token-file=FILE (the service writes "
                               f"STATE_DIR/agent_token) or set {TOKEN_ENV}")
        return token

    def check_environments(self) -> list[worker_envs.Environment]:
        """Check every worker environment once (:func:`.environments.check_all`);
        unusable ones are logged and reported, not fatal."""
        try:
            found = worker_envs.check_all(self.environments, self.default_environment)
        except ValueError as exc:
            raise GPUPoolError("not_configured", str(exc)) from None
        for env in found:
            if not env.usable:
                self.log.warning("worker environment %r is not usable: %s", env.name, env.problem)
        if not any(env.default and env.usable for env in found):
            raise GPUPoolError("not_configured", "the default worker environment cannot run workers: "
                               f"{next(e.problem for e in found if e.default)} (c.NodeAgent.default_environment)")
        return found

    def python_for(self, name: Any) -> str | None:
        """The interpreter of the environment a ``POST /workers`` names (None: the
        agent's own). Raises a 400 GPUPoolError for an unknown or unusable one."""
        if name is not None and not isinstance(name, str):
            raise bad_request(f"'env' must be the name of a worker environment, got {name!r}")
        try:
            env = worker_envs.choose(self.worker_environments, name)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        return None if env.python == sys.executable else env.python

    def _read_metrics_token(self) -> str:
        if not self.metrics_token_file:
            return ""
        try:
            return Path(self.metrics_token_file).read_text().strip()
        except OSError as exc:
            raise GPUPoolError("not_configured", f"cannot read the metrics token file {self.metrics_token_file}: "
                               f"{exc.strerror} (--metrics-token-file)") from None

    def metrics_token_matches(self, header: str) -> bool:
        """True when the header carries the metrics token (never when none is set)."""
        scheme, _, value = header.partition(" ")
        return bool(self.metrics_token) and scheme.lower() in ("token", "bearer") and hmac.compare_digest(
            value.strip().encode(), self.metrics_token.encode())

    def token_matches(self, header: str) -> bool:
        """True when an ``Authorization: token ...`` header carries the agent token."""
        scheme, _, value = header.partition(" ")
        return scheme.lower() in ("token", "bearer") and hmac.compare_digest(value.strip().encode(), self.token.encode())

    def worker_reports(self) -> list:
        return self.workers.reports(self.inventory.process_memory())

    # -- run --------------------------------------------------------------------------------------------------

    def start(self) -> None:
        asyncio.run(self.run())

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT, then stop every worker."""
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopping.set)
        state_dir = Path(self.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_fd = lock_state_dir(state_dir, "agent")
        if self.user is not None or self.users is not None or is_user_template(self.worker_user or ""):
            state_dir.chmod(0o711)  # enter, not list: the worker user reaches only its own files
        self.workers = WorkerManager(state_dir, ip=self.ip, advertise_ip=_advertised_ip(self.ip), node=self.node_name,
                                     start_timeout=self.worker_start_timeout, stop_timeout=self.worker_stop_timeout,
                                     log=self.log, warm=WarmSettings(self.warm_workers, tuple(self.preload_modules),
                                                                     self.warm_worker_max_age), user=self.user,
                                     encryption=self.transport_encryption, cgroups=self.containment(state_dir),
                                     users=self.users)
        if is_user_template(self.worker_user or ""):
            self.workers.workers_dir.chmod(0o711)  # each lease's account reads its own connection file
        adopted = await self.workers.recover()  # before the first report names the workers
        if adopted:
            self.log.info("re-adopted %d worker(s) left running by the previous agent: leases %s", len(adopted),
                          ", ".join(w.spec.lease_id for w in adopted))
        try:
            sockets = bind_sockets(self.port, self.ip)
        except OSError as exc:
            raise GPUPoolError("not_configured", f"cannot listen on {self.ip}:{self.port}: {exc.strerror} "
                               "(--ip, --port; --port=0 picks a free port)") from None
        server = HTTPServer(web.Application(agent_routes(), agent=self, default_handler_class=NotFoundHandler,
                                            log_function=self._log_request), ssl_options=self.tls,
                            **httpin.server_options())
        server.add_sockets(sockets)
        scheme = "https" if self.tls else "http"
        self.url = f"{scheme}://{_url_host(self.ip)}:{sockets[0].getsockname()[1]}"
        self.http = AsyncHTTPClient(force_instance=True)
        self.log.info("agent %s serving on %s with %d %s GPU(s) (enforcement: %s); service %s",
                      self.node_name, self.url, len(self.gpus), self.inventory.kind, self.enforcement,
                      self.service_url)
        service_task = asyncio.create_task(self.service_loop())
        self.workers.start_warm_pool()
        await stopping.wait()
        self.log.info("stopping: shutting down %d worker(s)", len(self.workers.lease_ids()))
        service_task.cancel()
        await asyncio.gather(service_task, return_exceptions=True)
        server.stop()
        codes = await self.workers.stop_all()
        await self._final_heartbeat(codes)
        await server.close_all_connections()
        self.http.close()
        self.workers.close()
        self.inventory.close()
        if self.mps is not None:
            try:
                self.mps.stop()  # only a daemon this agent started
            except RuntimeError as exc:
                self.log.warning("%s", exc)
        self.log.info("agent %s stopped", self.node_name)

    def _log_request(self, handler: web.RequestHandler) -> None:
        status = handler.get_status()
        level = logging.INFO if status < 400 else logging.WARNING
        if handler.request.path == "/health" and status == 200:
            level = logging.DEBUG
        self.log.log(level, "%d %s %s %.0fms", status, handler.request.method, handler.request.path,
                     1000 * handler.request.request_time())

    # -- talking to the service -------------------------------------------------------------------------------

    async def service_loop(self) -> None:
        """Register, then heartbeat every ``heartbeat_interval``; register
        again when the service forgets the node (404)."""
        while True:
            interval = await self.register()
            while True:
                await asyncio.sleep(interval)
                if await self.refresh_inventory():
                    break  # NVML is back: register its GPUs
                try:
                    status, reply = await self.call("POST", f"/nodes/{quote(self.node_name, safe='')}/heartbeat",
                                                    self.heartbeat_body())
                except Exception as exc:  # keep beating: the service may come back
                    self.log.warning("heartbeat to %s failed (%s); retrying in %.1fs", self.service_url, exc, interval)
                    continue
                if status == 404:
                    self.log.warning("the service does not know node %s any more; registering again", self.node_name)
                    break
                if status != 200:
                    self.log.warning("heartbeat refused by %s: HTTP %s %s", self.service_url, status,
                                     reply.get("message", ""))
                    if status == 401:
                        break  # re-read the token file while registering again
                    continue
                self.stop_workers(reply.get("stop"))

    async def register(self) -> float:
        """``POST /nodes`` until it succeeds, backing off while the service is
        down or refuses; writes ``agent.json``; returns the heartbeat interval."""
        failures = 0
        while True:
            try:
                self.token = self.read_token()
                status, reply = await self.call("POST", "/nodes", self.registration_body())
            except GPUPoolError as exc:
                status, reply, problem = 0, {}, exc.message
            except Exception as exc:  # unreachable, or a bad --service-url
                status, reply, problem = 0, {}, f"cannot reach it ({exc})"
            else:
                problem = f"HTTP {status}: {reply.get('message') or 'no message'}"
                if status in (401, 403):
                    problem += (f" (check --token-file {self.token_file or '(unset)'} / {TOKEN_ENV}: it must hold "
                                "the service's agent token, STATE_DIR/agent_token, not a user token)")
            if status == 200:
                break
            failures += 1
            delay = backoff_delay(failures, REGISTRATION_RETRY_FIRST_S, self.retry_max)
            self.log.warning("registration with %s failed: %s; retrying in %.1fs", self.service_url, problem, delay)
            await asyncio.sleep(delay)
        interval = reply.get("heartbeat_interval")
        interval = float(interval) if isinstance(interval, (int, float)) and interval > 0 else 5.0
        self.write_agent_json()
        self.log.info("registered with %s as %s (heartbeat every %gs)", self.service_url, self.node_name, interval)
        self.stop_workers(reply.get("stop"))
        return interval

    def registration_body(self) -> dict[str, Any]:
        return {"name": self.node_name, "url": self.url, "inventory": self.inventory.kind,
                "enforcement": self.enforcement, "gpus": [gpu.to_json() for gpu in self.gpus.values()],
                "workers": [r.to_json() for r in self.worker_reports()], "inventory_error": self.inventory.error,
                "environments": [env.to_json() for env in self.worker_environments],
                **dict(zip(("host_cpus", "host_memory"), self.host_totals()))}

    def host_totals(self) -> tuple[float, int]:
        """``(cores, bytes)`` this node offers leases (:func:`.host_limits.host_totals`)."""
        return host_totals(self.host_cpus, self.host_memory)

    def heartbeat_body(self) -> dict[str, Any]:
        usage = self.inventory.process_usage()  # one NVML process listing per heartbeat
        reports = self.workers.reports(memory_by_pid(usage))
        gpus = self.gpu_metrics(usage)
        self.metrics.update(self.gpus.values(), gpus, self._workers_by_gpu(), self.inventory.error, reports)
        return {"workers": [r.to_json() for r in reports], "gpus": gpus, "inventory_error": self.inventory.error}

    def _workers_by_gpu(self) -> dict[str, int]:
        """GPU UUID -> lease workers bound to it, for ``/metrics``."""
        counts: dict[str, int] = {}
        for lease in self.workers.lease_ids():
            spec = self.workers.get(lease).spec
            for gpu in spec.gpus if spec is not None else ():
                counts[gpu.uuid] = counts.get(gpu.uuid, 0) + 1
        return counts

    async def refresh_inventory(self) -> bool:
        """Once per heartbeat: read NVML (in its helper process, off this
        loop: :class:`~.nvml_watch.WatchedInventory`), or open it again when it
        failed and its backoff has passed. True when it just came back, with
        ``gpus`` read again."""
        if not await self.inventory.update():
            return False
        self.gpus = {gpu.uuid: gpu for gpu in self.inventory.discover()}
        if self.enforcement_mode == "auto" and any(u.startswith("MIG-") for u in self.gpus):
            self.enforcement = "mig"  # unknown while NVML was down when the agent started
        return True

    def gpu_metrics(self, usage: list) -> list[dict[str, Any]]:
        """The inventory's GPU readings plus ``memory_unattributed`` (bytes of
        processes that belong to no worker), from this heartbeat's process
        listing ``usage``; stops, through the memory watchdog, workers over
        their slice (not in ``mig``/``exclusive`` mode, where the hardware or
        whole GPUs confine them)."""
        metrics = self.inventory.metrics()
        if not usage:
            return metrics
        live = {lease: self.workers.get(lease) for lease in self.workers.lease_ids()}
        live = {lease: worker for lease, worker in live.items() if not worker.dead}
        result = attribute(usage, {lease: w.pid for lease, w in live.items()}, read_parents())
        if self.enforcement in ("mps", "timeslice"):
            for lease, reason in self.watchdog.check(result.memory, {l: w.spec.memory for l, w in live.items()}):
                self.log.warning("memory watchdog: stopping the worker of lease %s: %s", lease, reason)
                self.stop_workers([lease])
        return add_unattributed(metrics, result, self.inventory.process_known())

    def stop_workers(self, lease_ids: Any) -> None:
        """Stop, in the background, the workers the service says no lease holds."""
        for lease_id in lease_ids or ():
            if isinstance(lease_id, str) and lease_id in self.workers.lease_ids() and lease_id not in self._stopping:
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

    async def call(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        """One call to ``{service_url}/api/v1{path}``; returns (status, JSON
        reply). Raises OSError when the service cannot be reached."""
        request = HTTPRequest(f"{self.service_url}/api/v1{path}", method=method, body=json.dumps(body),
                              headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
                              connect_timeout=self.service_timeout, request_timeout=self.service_timeout,
                              ssl_options=self.service_tls)
        try:
            response = await self.http.fetch(request, raise_error=False)
        except OSError as exc:  # tornado raises what is no HTTP answer: refused, a certificate not trusted
            why = untrusted(exc)
            if why:
                raise OSError(untrusted_message(f"the pool service at {self.service_url}", why)) from None
            raise
        if response.code == 599:  # tornado: no HTTP answer (timeout)
            raise OSError(str(response.error))
        try:
            reply = json.loads(response.body or b"{}")
        except ValueError:
            reply = {}
        return response.code, reply if isinstance(reply, dict) else {}

    async def _final_heartbeat(self, exit_codes: dict[str, int | None]) -> None:
        """Tell the service, best effort, that the workers are gone (``dead``
        with their exit codes), so their leases end now rather than when the
        node's TTL runs out."""
        why = f"the node agent on {self.node_name} was stopped"
        workers = [WorkerReport(lease, None, "dead", exit_code=code, reason=why).to_json()
                   for lease, code in exit_codes.items()]
        try:
            await asyncio.wait_for(self.call("POST", f"/nodes/{quote(self.node_name, safe='')}/heartbeat",
                                             {"workers": workers, "gpus": self.inventory.metrics(),
                                              "inventory_error": self.inventory.error}), 2.0)
        except Exception:  # the service may be down too; its node TTL covers it
            pass

    def write_agent_json(self) -> None:
        """``STATE_DIR/agent.json``: who this agent is, for scripts and tests."""
        path = Path(self.state_dir) / "agent.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"name": self.node_name, "url": self.url, "pid": os.getpid()}))
        tmp.replace(path)


def is_user_template(worker_user: str) -> bool:
    """Whether ``c.NodeAgent.worker_user`` names an account per lease (``"{username}"``)."""
    return "{" in worker_user


def expand_worker_user(template: str, owner: str) -> str:
    """The account name ``template`` gives for the lease owner ``owner`` (pure):
    ``"{username}"`` -> ``"ann"``, ``"jupyter-{username}"`` -> ``"jupyter-ann"``.
    Raises a 400 GPUPoolError for an owner that is no POSIX account name, and
    GPUPoolError ``not_configured`` for a template with other fields."""
    if not re.fullmatch(r"[a-z_][a-z0-9_.-]{0,31}", owner):
        raise bad_request(f"lease owner {owner!r} is no account name of this node (c.NodeAgent.worker_user "
                          f"{template!r}): lower-case letters, digits, '_', '.', '-', at most 32")
    try:
        return template.format(username=owner)
    except (KeyError, IndexError, ValueError):
        raise GPUPoolError("not_configured", f"c.NodeAgent.worker_user {template!r}: the only field a "
                           "template may hold is {username}") from None


def _advertised_ip(ip: str) -> str:
    """The address others use to reach what listens on ``ip``: a wildcard
    bind is advertised as this host's own address."""
    if ip in ("", "0.0.0.0", "::"):
        return socket.gethostbyname(socket.gethostname())
    return ip


def _url_host(ip: str) -> str:
    """The host part of the URL the service uses to reach this agent."""
    host = _advertised_ip(ip)
    return f"[{host}]" if ":" in host else host


def main(argv: list[str] | None = None) -> int:
    """``gpupool agent [options]``; returns the exit code (0 after SIGTERM)."""
    app = NodeAgent()
    app.initialize(sys.argv[1:] if argv is None else argv)
    app.start()
    return 0
