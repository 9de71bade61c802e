"""The agent's HTTP API (docs/api.md, "Agent"): ``/workers``, a worker's
``park`` and ``resume`` and a spilled lease's ``spill`` (docs/parking.md), ``/health``, ``/health/live``,
``/metrics``, and the server that listens for it (:func:`listen`, :func:`serve_api`).

Every handler but the health ones needs the agent token (``/metrics`` also takes
the metrics token); bodies are bounded (:mod:`gpupool.httpin`) and every
error is ``GPUPoolError.to_json()``. An agent that refuses to serve
(``c.AgentEnforcement.require_containment``) answers every call but ``/health/live``
with 503 and its reason. The handlers use only what the agent hands them
(:class:`AgentAPI`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import ssl
import sys
import time
from dataclasses import dataclass
from typing import Callable

from tornado import web
from tornado.httpserver import HTTPServer
from tornado.iostream import StreamClosedError
from tornado.netutil import bind_sockets

from gpupool import httpin
from gpupool.errors import GPUPoolError, Reason, bad_request, not_found
from gpupool.jsonhandler import JSONHandler
from gpupool.wire.nodes import GPUInfo, WorkerEnvironment, WorkerReport
from gpupool.wire.parking import ParkRequest
from gpupool.wire.workers import WorkerRequest, WorkerStarted, WorkerStopped

from . import environments as worker_envs
from .agent_accounts import WorkerAccountSettings
from .agent_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, AgentMetrics
from .agent_tokens import AgentTokens
from .node_gpus import NodeGPUs
from .host_limits import check_host_limits
from .inventory import Inventory
from .workers import WorkerManager, WorkerSpec, WorkerStartError, WorkerStopError
from .workers.spillmove import CHUNK_BYTES, manifest


def worker_spec(request: WorkerRequest, gpus: dict[str, GPUInfo]) -> WorkerSpec:
    """The worker ``request`` asks for on this node's ``gpus`` (uuid ->
    GPUInfo). Without ``memory``: the fraction's share of the smallest GPU's
    usable memory. Raises a 400 GPUPoolError naming the field."""
    unknown = [u for u in request.gpus if u not in gpus]
    if unknown or len(set(request.gpus)) != len(request.gpus):
        raise bad_request(f"'gpus' must name distinct GPUs of this node; unknown: {', '.join(unknown) or 'none'}; "
                          f"this node has: {', '.join(gpus)}")
    chosen = tuple(gpus[u] for u in request.gpus)
    smallest = min(chosen, key=lambda g: g.memory_total)
    memory = request.memory
    if memory is None:
        memory = int((smallest.memory_total - smallest.memory_reserved) * request.fraction)
    if not 2**20 <= memory <= smallest.memory_total:
        raise bad_request(f"'memory' must be whole bytes from 1 MiB to the GPU's {smallest.memory_total}, got {memory!r}")
    try:
        return WorkerSpec(request.lease_id, request.owner, chosen, request.fraction, memory)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def python_for(environments: list[WorkerEnvironment], name: str | None) -> str | None:
    """The interpreter of the environment ``name`` of the node's
    ``environments`` (None: the agent's own). Raises a 400 GPUPoolError for
    an unknown or unusable one."""
    try:
        env = worker_envs.choose(environments, name)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return None if env.python == sys.executable else env.python


@dataclass(frozen=True)
class WorkerAdmission:
    """What a worker request is checked against on this node (:meth:`check`).
    ``node_gpus`` are read per request: the agent replaces their GPUs and
    enforcement when NVML comes back (``NodeAgent.refresh_inventory``)."""

    inventory: Inventory  # its ``error``: no worker while the GPUs cannot be read
    node_gpus: NodeGPUs
    environments: list[WorkerEnvironment]
    accounts: WorkerAccountSettings
    host_totals: Callable[[], tuple[float, int]]  # (cores, bytes) offered to leases

    async def check(self, request: WorkerRequest) -> WorkerSpec:
        """The worker ``request`` asks for on this node, checked against it
        (its GPUs, environments, host, enforcement mode); 400 naming the
        field, 503 ``inventory_unavailable`` while the GPUs cannot be read."""
        if self.inventory.error:
            raise GPUPoolError(Reason.inventory_unavailable, f"this node cannot read its GPUs now: "
                               f"{self.inventory.error}", 503)
        spec = worker_spec(request, self.node_gpus.gpus)
        python = python_for(self.environments, request.env)
        # NSS may ask LDAP: off the loop. Without a template there is nothing to look up (no thread hop).
        user = (await asyncio.to_thread(self.accounts.for_owner, spec.owner) if self.accounts.template is not None
                else None)
        cpus, host_memory = check_host_limits(request.cpus, request.host_memory, self.host_totals())
        spec = dataclasses.replace(spec, python=python, user=user, cpus=cpus, host_memory=host_memory)
        try:
            self.node_gpus.enforcement.check(spec.fraction)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        return spec


@dataclass(frozen=True)
class AgentAPI:
    """What the agent's handlers use, built once by the agent when it serves
    (``NodeAgent.api``). ``refusal`` holds the words of an agent that refuses
    to serve (``c.AgentEnforcement.require_containment``); such an agent has no
    ``admission`` and no ``workers``, and its handlers never reach them."""

    node: str
    log: logging.Logger
    tokens: AgentTokens
    metrics: AgentMetrics
    refusal: str | None
    admission: WorkerAdmission | None
    workers: WorkerManager | None
    reports: Callable[[], list[WorkerReport]]  # the workers' states, for GET /workers


@web.stream_request_body
class AgentHandler(JSONHandler):
    """Base of the agent's handlers: agent-token auth, JSON in and out, every
    error as ``GPUPoolError.to_json()`` (:class:`gpupool.jsonhandler.JSONHandler`).
    The token is checked before the body is read, and bodies are bounded.
    What they use is the application's setting ``api`` (:class:`AgentAPI`)."""

    failure = "the agent hit an unexpected error; an admin can find the details in its log"
    json_media_type_only = False  # only the service calls it, and agents never asked
    auth_required = True

    @property
    def api(self) -> AgentAPI:
        return self.settings["api"]

    @property
    def log(self) -> logging.Logger:  # the agent's own, as its settings name it
        return self.api.log

    @property
    def workers(self) -> WorkerManager:
        """The agent's workers; only handlers that a refusing agent never reaches (:meth:`prepare`) ask."""
        assert self.api.workers is not None
        return self.api.workers

    def prepare(self) -> None:
        if self.api.refusal is not None and not isinstance(self, (HealthHandler, LiveHandler)):
            raise GPUPoolError(Reason.not_configured, self.api.refusal, 503)
        if self.auth_required and not self.api.tokens.agent_matches(self.request.headers.get("Authorization", "")):
            raise GPUPoolError(Reason.unauthorized,
                               "missing or wrong agent token (send 'Authorization: token AGENT_TOKEN')",
                               401)
        self.start_body()

    async def worker_spec(self, request: WorkerRequest) -> WorkerSpec:
        """``request`` checked against this node (:meth:`WorkerAdmission.check`)."""
        assert self.api.admission is not None  # as for workers
        return await self.api.admission.check(request)


@web.stream_request_body
class WorkersHandler(AgentHandler):
    """``GET /workers`` and ``POST /workers``."""

    async def get(self) -> None:
        self.write_json({"workers": [r.to_json() for r in self.api.reports()]})

    async def post(self) -> None:
        spec = await self.worker_spec(WorkerRequest.from_json(self.json_body()))
        try:
            worker = await self.workers.start(spec)
        except WorkerStartError as exc:
            if self.workers.closing:
                raise stopping(spec.lease_id) from None
            raise GPUPoolError(Reason.worker_start_failed, str(exc), 502) from None
        if self.workers.closing:  # it came up during the stop, which stops it unused
            raise stopping(spec.lease_id)
        self.write_json(WorkerStarted(worker.pid, worker.connection()).to_json(), 201)


def stopping(lease_id: str) -> GPUPoolError:
    """The 503 of a start while the agent stops: it keeps no worker of ``lease_id``."""
    return GPUPoolError(Reason.agent_stopping, f"the node agent is stopping (a restart or an upgrade, say): it "
                        f"keeps no worker of lease {lease_id}", 503)


class WorkerHandler(AgentHandler):
    """``DELETE /workers/{lease_id}``."""

    async def delete(self, lease_id: str) -> None:
        try:
            code = await self.workers.stop(lease_id)
        except KeyError:
            raise not_found(f"worker of lease {lease_id}") from None
        except WorkerStopError as exc:
            raise GPUPoolError(Reason.worker_stop_failed, str(exc), 500) from None
        self.write_json(WorkerStopped(lease_id, code).to_json())


@web.stream_request_body
class ParkHandler(AgentHandler):
    """``POST /workers/{lease_id}/park``: a ParkRequest -> WorkerParked (docs/parking.md)."""

    async def post(self, lease_id: str) -> None:
        request = ParkRequest.from_json(self.json_body())
        try:
            parked = await self.workers.park(lease_id, request)
        except KeyError:
            raise not_found(f"worker of lease {lease_id}") from None
        self.write_json(parked.to_json())


@web.stream_request_body
class ResumeHandler(AgentHandler):
    """``POST /workers/{lease_id}/resume``: a WorkerRequest (the GPUs and limits granted now) -> WorkerResumed."""

    async def post(self, lease_id: str) -> None:
        request = WorkerRequest.from_json(self.json_body())
        if request.lease_id != lease_id:
            raise bad_request(f"'lease_id' must be the lease of the path, {lease_id!r}, got {request.lease_id!r:.60}")
        spec = await self.worker_spec(request)
        try:
            resumed = await self.workers.resume(lease_id, spec, request.spill_from, request.move_from)
        except KeyError:
            raise not_found(f"worker of lease {lease_id}") from None
        self.write_json(resumed.to_json())


@web.stream_request_body
class OfferHandler(AgentHandler):
    """``POST /workers/{lease_id}/offer``, ``{"owner": ...}``: the namespace of a
    worker parked in memory offered on its data plane to the node it moves to
    (:mod:`.workers.warmmove`)."""

    async def post(self, lease_id: str) -> None:
        body = self.json_body()
        owner = body.get("owner") if isinstance(body, dict) else None
        if not isinstance(owner, str) or not owner:
            raise bad_request("the body must be {\"owner\": the lease's owner}")
        try:
            offered = await self.workers.offer(lease_id, owner)
        except KeyError:
            raise not_found(f"worker of lease {lease_id} parked in memory") from None
        self.write_json(offered)


def not_spilled(lease_id: str) -> GPUPoolError:
    """The 404 of a spill this node does not hold."""
    return GPUPoolError(Reason.not_found, f"lease {lease_id} has no spill on this node (a worker parked in memory "
                        f"is spilled first: POST /workers/{lease_id}/park with {{\"tier\": \"disk\"}})", 404)


class SpillHandler(AgentHandler):
    """``GET /workers/{lease_id}/spill``: the manifest of a lease spilled on
    this node, for the agent of another node that the lease moves to
    (:mod:`.workers.spillmove`)."""

    async def get(self, lease_id: str) -> None:
        try:
            spill, namespace = await self.workers.open_spill(lease_id)
        except KeyError:
            raise not_spilled(lease_id) from None
        with namespace:
            self.write_json(manifest(spill, os.fstat(namespace.fileno()).st_size))


class SpillNamespaceHandler(AgentHandler):
    """``GET /workers/{lease_id}/spill/namespace``: the namespace file of a
    lease spilled on this node, streamed (``application/octet-stream``, with
    its ``Content-Length``), :data:`~.workers.spillmove.CHUNK_BYTES` at a
    time: a state may be many GiB. The file was opened under the lease's
    lock, so a DELETE meanwhile does not cut it short."""

    async def get(self, lease_id: str) -> None:
        try:
            _spill, namespace = await self.workers.open_spill(lease_id)
        except KeyError:
            raise not_spilled(lease_id) from None
        with namespace:
            size = os.fstat(namespace.fileno()).st_size
            self.set_header("Content-Type", "application/octet-stream")
            self.set_header("Content-Length", str(size))
            self.set_header("Cache-Control", "no-store")
            sent, began = 0, time.monotonic()
            try:
                while sent < size:
                    chunk = await asyncio.to_thread(namespace.read, min(CHUNK_BYTES, size - sent))
                    if not chunk:  # cannot happen to an open file that only shrinks when unlinked
                        raise OSError(f"the namespace of lease {lease_id} ends after {sent} of {size} bytes")
                    self.write(chunk)
                    await self.flush()
                    sent += len(chunk)
            except StreamClosedError:
                self.log.warning("the spill of lease %s: the caller went away after %d of %d bytes", lease_id,
                                 sent, size)
                return
        self.log.info("served the spill of lease %s: %d bytes in %.1fs", lease_id, size, time.monotonic() - began)
        self.finish()


class HealthHandler(AgentHandler):
    """``GET /health`` (readiness): no token needed; 503 with the reason in words when the
    agent refuses to serve (``c.AgentEnforcement.require_containment``)."""

    auth_required = False

    def get(self) -> None:
        if self.api.refusal is not None:
            self.write_json({"status": "refused", "node": self.api.node,
                             **GPUPoolError(Reason.not_configured, self.api.refusal, 503).to_json()}, 503)
            return
        self.write_json({"status": "ok", "node": self.api.node})


class LiveHandler(AgentHandler):
    """``GET /health/live`` (liveness): 200 whenever the agent's loop answers, refusing or not,
    so a refusing agent is shown not ready rather than restarted over and over."""

    auth_required = False

    def get(self) -> None:
        self.write_json({"status": "refused" if self.api.refusal is not None else "ok", "node": self.api.node})


class MetricsHandler(AgentHandler):
    """``GET /metrics``: Prometheus text (:mod:`.agent_metrics`), for the metrics
    token (``--metrics-token-file``) or the agent token."""

    def prepare(self) -> None:
        header = self.request.headers.get("Authorization", "")
        if not (self.api.tokens.agent_matches(header) or self.api.tokens.metrics_matches(header)):
            raise GPUPoolError(Reason.unauthorized,
                               "missing or wrong token: send 'Authorization: Bearer METRICS_TOKEN' "
                               "(the file of --metrics-token-file)", 401)

    def get(self) -> None:
        self.set_header("Content-Type", METRICS_CONTENT_TYPE)
        self.finish(self.api.metrics.render())


class NotFoundHandler(AgentHandler):
    auth_required = False

    def prepare(self) -> None:
        raise not_found(f"{self.request.path} on this agent")


def agent_routes() -> list[tuple[str, type]]:
    return [(r"/workers", WorkersHandler), (r"/workers/([^/]+)", WorkerHandler),
            (r"/workers/([^/]+)/park", ParkHandler), (r"/workers/([^/]+)/resume", ResumeHandler),
            (r"/workers/([^/]+)/offer", OfferHandler),
            (r"/workers/([^/]+)/spill", SpillHandler), (r"/workers/([^/]+)/spill/namespace", SpillNamespaceHandler),
            (r"/health", HealthHandler), (r"/health/live", LiveHandler), (r"/metrics", MetricsHandler)]


def listen(ip: str, port: int) -> list[socket.socket]:
    """The listening sockets on ``ip``:``port``, bound before the agent makes
    anything (a port taken stops the start first). GPUPoolError ``not_configured``
    when it cannot listen."""
    try:
        return bind_sockets(port, ip)
    except OSError as exc:
        raise GPUPoolError(Reason.not_configured, f"cannot listen on {ip}:{port}: {exc.strerror} "
                           "(--ip, --port; --port=0 picks a free port)") from None


def serve_api(api: AgentAPI, sockets: list[socket.socket], ip: str,
              tls: ssl.SSLContext | None) -> tuple[HTTPServer, str]:
    """Serve ``api`` on ``sockets`` (:func:`listen` on ``ip``; ``tls``: HTTPS);
    returns the server and the URL the service reaches it at."""

    def log_request(handler: web.RequestHandler) -> None:
        status = handler.get_status()
        level = logging.INFO if status < 400 else logging.WARNING
        if handler.request.path in ("/health", "/health/live") and status == 200:
            level = logging.DEBUG
        api.log.log(level, "%d %s %s %.0fms", status, handler.request.method, handler.request.path,
                    1000 * handler.request.request_time())

    server = HTTPServer(web.Application(agent_routes(), api=api, default_handler_class=NotFoundHandler,
                                        log_function=log_request), ssl_options=tls,
                        **httpin.server_options())
    server.add_sockets(sockets)
    scheme = "https" if tls else "http"
    return server, f"{scheme}://{_url_host(ip)}:{sockets[0].getsockname()[1]}"


def advertised_ip(ip: str) -> str:
    """The address others use to reach what listens on ``ip``: a wildcard
    bind is advertised as this host's own address."""
    if ip in ("", "0.0.0.0", "::"):
        return socket.gethostbyname(socket.gethostname())
    return ip


def _url_host(ip: str) -> str:
    """The host part of the URL the service uses to reach this agent."""
    host = advertised_ip(ip)
    return f"[{host}]" if ":" in host else host
