"""The agent's HTTP API (docs/api.md, "Agent"): ``/workers``, a worker's
``park`` and ``resume`` (docs/parking.md), ``/health``, ``/health/live``,
``/metrics``, and the server that listens for it (:func:`serve_api`).

Every handler but the health ones needs the agent token (``/metrics`` also takes
the metrics token); bodies are bounded (:mod:`gpupool.httpin`) and every
error is ``GPUPoolError.to_json()``. An agent that refuses to serve
(``c.NodeAgent.require_containment``) answers every call but ``/health/live``
with 503 and its reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import sys
from typing import TYPE_CHECKING

from tornado import web
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from gpupool import httpin
from gpupool.errors import GPUPoolError, Reason, bad_request, not_found
from gpupool.jsonhandler import JSONHandler
from gpupool.wire.nodes import GPUInfo, WorkerEnvironment
from gpupool.wire.parking import ParkRequest
from gpupool.wire.workers import WorkerRequest, WorkerStarted, WorkerStopped

from . import environments as worker_envs
from .agent_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .host_limits import check_host_limits
from .workers import WorkerSpec, WorkerStartError, WorkerStopError

if TYPE_CHECKING:
    from .agent import NodeAgent


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


@web.stream_request_body
class AgentHandler(JSONHandler):
    """Base of the agent's handlers: agent-token auth, JSON in and out, every
    error as ``GPUPoolError.to_json()`` (:class:`gpupool.jsonhandler.JSONHandler`).
    The token is checked before the body is read, and bodies are bounded."""

    failure = "the agent hit an unexpected error; an admin can find the details in its log"
    json_media_type_only = False  # only the service calls it, and agents never asked
    auth_required = True

    @property
    def agent(self) -> NodeAgent:
        return self.settings["agent"]

    @property
    def log(self) -> logging.Logger:  # the agent's own, as its settings name it
        return self.agent.log

    def prepare(self) -> None:
        if self.agent.refusal is not None and not isinstance(self, (HealthHandler, LiveHandler)):
            raise GPUPoolError(Reason.not_configured, self.agent.refusal_words(), 503)
        if self.auth_required and not self.agent.tokens.agent_matches(self.request.headers.get("Authorization", "")):
            raise GPUPoolError(Reason.unauthorized,
                               "missing or wrong agent token (send 'Authorization: token AGENT_TOKEN')",
                               401)
        self.start_body()

    async def worker_spec(self, request: WorkerRequest) -> WorkerSpec:
        """The worker ``request`` asks for on this node, checked against it
        (its GPUs, environments, host, enforcement mode); 400 naming the
        field, 503 ``inventory_unavailable`` while the GPUs cannot be read."""
        if self.agent.inventory.error:
            raise GPUPoolError(Reason.inventory_unavailable, f"this node cannot read its GPUs now: "
                               f"{self.agent.inventory.error}", 503)
        spec = worker_spec(request, self.agent.gpus)
        python = python_for(self.agent.worker_environments, request.env)
        accounts = self.agent.account_settings
        # NSS may ask LDAP: off the loop. Without a template there is nothing to look up (no thread hop).
        user = await asyncio.to_thread(accounts.for_owner, spec.owner) if accounts.template is not None else None
        cpus, host_memory = check_host_limits(request.cpus, request.host_memory, self.agent.host_totals())
        spec = dataclasses.replace(spec, python=python, user=user, cpus=cpus, host_memory=host_memory)
        try:
            self.agent.enforcement.check(spec.fraction)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        return spec


@web.stream_request_body
class WorkersHandler(AgentHandler):
    """``GET /workers`` and ``POST /workers``."""

    async def get(self) -> None:
        self.write_json({"workers": [r.to_json() for r in self.agent.worker_reports()]})

    async def post(self) -> None:
        spec = await self.worker_spec(WorkerRequest.from_json(self.json_body()))
        try:
            worker = await self.agent.workers.start(spec)
        except WorkerStartError as exc:
            raise GPUPoolError(Reason.worker_start_failed, str(exc), 502) from None
        self.write_json(WorkerStarted(worker.pid, worker.connection()).to_json(), 201)


class WorkerHandler(AgentHandler):
    """``DELETE /workers/{lease_id}``."""

    async def delete(self, lease_id: str) -> None:
        try:
            code = await self.agent.workers.stop(lease_id)
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
            parked = await self.agent.workers.park(lease_id, request)
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
            resumed = await self.agent.workers.resume(lease_id, spec)
        except KeyError:
            raise not_found(f"worker of lease {lease_id}") from None
        self.write_json(resumed.to_json())


class HealthHandler(AgentHandler):
    """``GET /health`` (readiness): no token needed; 503 with the reason in words when the
    agent refuses to serve (``c.NodeAgent.require_containment``)."""

    auth_required = False

    def get(self) -> None:
        if self.agent.refusal is not None:
            self.write_json({"status": "refused", "node": self.agent.node_name,
                             **GPUPoolError(Reason.not_configured, self.agent.refusal_words(), 503).to_json()}, 503)
            return
        self.write_json({"status": "ok", "node": self.agent.node_name})


class LiveHandler(AgentHandler):
    """``GET /health/live`` (liveness): 200 whenever the agent's loop answers, refusing or not,
    so a refusing agent is shown not ready rather than restarted over and over."""

    auth_required = False

    def get(self) -> None:
        self.write_json({"status": "refused" if self.agent.refusal is not None else "ok",
                         "node": self.agent.node_name})


class MetricsHandler(AgentHandler):
    """``GET /metrics``: Prometheus text (:mod:`.agent_metrics`), for the metrics
    token (``--metrics-token-file``) or the agent token."""

    def prepare(self) -> None:
        header = self.request.headers.get("Authorization", "")
        if not (self.agent.tokens.agent_matches(header) or self.agent.tokens.metrics_matches(header)):
            raise GPUPoolError(Reason.unauthorized,
                               "missing or wrong token: send 'Authorization: Bearer METRICS_TOKEN' "
                               "(the file of --metrics-token-file)", 401)

    def get(self) -> None:
        self.set_header("Content-Type", METRICS_CONTENT_TYPE)
        self.finish(self.agent.metrics.render())


class NotFoundHandler(AgentHandler):
    auth_required = False

    def prepare(self) -> None:
        raise not_found(f"{self.request.path} on this agent")


def agent_routes() -> list[tuple[str, type]]:
    return [(r"/workers", WorkersHandler), (r"/workers/([^/]+)", WorkerHandler),
            (r"/workers/([^/]+)/park", ParkHandler), (r"/workers/([^/]+)/resume", ResumeHandler),
            (r"/health", HealthHandler), (r"/health/live", LiveHandler), (r"/metrics", MetricsHandler)]


def serve_api(agent: NodeAgent) -> tuple[HTTPServer, str]:
    """Listen on the agent's ``ip``:``port`` and serve its API there; returns
    the server and the URL the service reaches it at. GPUPoolError
    ``not_configured`` when it cannot listen."""
    try:
        sockets = bind_sockets(agent.port, agent.ip)
    except OSError as exc:
        raise GPUPoolError(Reason.not_configured, f"cannot listen on {agent.ip}:{agent.port}: {exc.strerror} "
                           "(--ip, --port; --port=0 picks a free port)") from None

    def log_request(handler: web.RequestHandler) -> None:
        status = handler.get_status()
        level = logging.INFO if status < 400 else logging.WARNING
        if handler.request.path in ("/health", "/health/live") and status == 200:
            level = logging.DEBUG
        agent.log.log(level, "%d %s %s %.0fms", status, handler.request.method, handler.request.path,
                      1000 * handler.request.request_time())

    server = HTTPServer(web.Application(agent_routes(), agent=agent, default_handler_class=NotFoundHandler,
                                        log_function=log_request), ssl_options=agent.tls,
                        **httpin.server_options())
    server.add_sockets(sockets)
    scheme = "https" if agent.tls else "http"
    return server, f"{scheme}://{_url_host(agent.ip)}:{sockets[0].getsockname()[1]}"


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
