"""The agent's side of the service's node API (docs/api.md, "Service:
``/api/v1``", ``POST /nodes`` and ``POST /nodes/{name}/heartbeat``): register,
heartbeat, and a last heartbeat when it stops."""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable
from urllib.parse import quote

from gpupool.errors import GPUPoolError
from gpupool.httpout import JSONClient, NoAnswer
from gpupool.schema import WorkerState
from gpupool.wire.nodes import GPUReading, Heartbeat, HeartbeatReply, NodeRegistration, RegistrationReply, WorkerReport

from .agent_tokens import TOKEN_ENV, AgentTokens
from .inventory import Inventory, backoff_delay

#: Seconds before the first registration retry; each failure doubles it, up to ``retry_max``.
REGISTRATION_RETRY_FIRST_S = 0.5


@dataclass(frozen=True)
class LinkSettings:
    """Where the service is and how to call it: ``url`` (``c.NodeAgent.service_url``, no
    trailing ``/``), the ``tls`` context that checks it, the ``timeout`` of a call and the
    longest pause between registrations (``retry_max``), in seconds; ``node``: this node's name."""

    url: str
    node: str
    tls: ssl.SSLContext | None
    timeout: float
    retry_max: float


@dataclass(frozen=True)
class NodeSide:
    """What the link asks of the node, each on the agent's event loop."""

    registration: Callable[[], NodeRegistration]  # the body of POST /nodes
    heartbeat: Callable[[], Heartbeat]  # the body of the next heartbeat
    refresh: Callable[[], Awaitable[bool]]  # read the GPUs once per heartbeat; True: register them again
    stop: Callable[[Iterable[str]], None]  # the workers the service says no lease holds
    registered: Callable[[], None]  # after each registration
    inventory: Inventory  # its readings go into the goodbye (:meth:`ServiceLink.goodbye`)


class ServiceLink:
    """Calls to ``{url}/api/v1`` for one node: its ``settings``, its ``tokens``
    (the agent token, read again before each registration) and its ``node``
    side, which gives the bodies and takes the answers."""

    def __init__(self, settings: LinkSettings, tokens: AgentTokens, node: NodeSide, log: logging.Logger) -> None:
        self.settings, self.tokens, self.node_side, self.log = settings, tokens, node, log
        self.url, self.node = settings.url, settings.node
        self.heartbeat_path = f"/nodes/{quote(settings.node, safe='')}/heartbeat"
        self.http = JSONClient(settings.tls)

    def close(self) -> None:
        self.http.close()

    async def run(self) -> None:
        """Register, then heartbeat every ``heartbeat_interval``; register
        again when the service forgets the node (404)."""
        while True:
            interval = await self.register()
            while True:
                await asyncio.sleep(interval)
                if await self.node_side.refresh():
                    break  # NVML is back: register its GPUs
                try:
                    status, reply = await self.call("POST", self.heartbeat_path, self.node_side.heartbeat().to_json())
                except Exception as exc:  # keep beating: the service may come back
                    self.log.warning("heartbeat to %s failed (%s); retrying in %.1fs", self.url, exc, interval)
                    continue
                if status == 404:
                    self.log.warning("the service does not know node %s any more; registering again", self.node)
                    break
                if status != 200:
                    self.log.warning("heartbeat refused by %s: HTTP %s %s", self.url, status, reply.get("message", ""))
                    if status == 401:
                        break  # re-read the token file while registering again
                    continue
                self.node_side.stop(HeartbeatReply.from_json(reply).stop)

    async def register(self) -> float:
        """``POST /nodes`` until it succeeds, backing off while the service is
        down or refuses, then tells the node (``registered``); returns the heartbeat interval."""
        failures = 0
        while True:
            try:
                self.tokens.read()  # also what the service's calls here must carry
                status, reply = await self.call("POST", "/nodes", self.node_side.registration().to_json())
            except GPUPoolError as exc:
                status, reply, problem = 0, {}, exc.message
            except Exception as exc:  # unreachable, or a bad --service-url
                status, reply, problem = 0, {}, f"cannot reach it ({exc})"
            else:
                problem = f"HTTP {status}: {reply.get('message') or 'no message'}"
                if status in (401, 403):
                    problem += (f" (check --token-file {self.tokens.token_file or '(unset)'} / {TOKEN_ENV}: it must "
                                "hold the service's agent token, STATE_DIR/agent_token, not a user token)")
            if status == 200:
                break
            failures += 1
            delay = backoff_delay(failures, REGISTRATION_RETRY_FIRST_S, self.settings.retry_max)
            self.log.warning("registration with %s failed: %s; retrying in %.1fs", self.url, problem, delay)
            await asyncio.sleep(delay)
        registered = RegistrationReply.from_json(reply)
        self.node_side.registered()
        self.log.info("registered with %s as %s (heartbeat every %gs)", self.url, self.node,
                      registered.heartbeat_interval)
        self.node_side.stop(registered.stop)
        return registered.heartbeat_interval

    async def call(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        """One call to ``{url}/api/v1{path}``; returns (status, JSON
        reply). Raises OSError when the service cannot be reached."""
        try:
            answer = await self.http.call(method, f"{self.url}/api/v1{path}", body, token=self.tokens.token,
                                          timeout=self.settings.timeout)
        except NoAnswer as exc:
            untrusted = exc.untrusted_words(f"the pool service at {self.url}")
            if untrusted:
                raise OSError(untrusted) from None
            raise
        return answer.status, answer.object()

    async def goodbye(self, exit_codes: dict[str, int | None], spilled: list[WorkerReport] = (),
                      unsaved: dict[str, str] | None = None) -> None:
        """Tell the service, best effort, that the workers are gone (``dead``
        with their exit codes; ``unsaved``: why those a save to disk was tried
        for were not saved) or saved to disk (``spilled``: their reports, their
        leases parked there for the next agent) and that the agent is leaving
        (``leaving``), so the others' leases end now and nothing new is placed
        on the node, rather than when the node's TTL runs out."""
        why, inventory, unsaved = f"the node agent on {self.node} was stopped", self.node_side.inventory, unsaved or {}

        def reason(lease: str) -> str:
            return f"{why} and could not save the worker to disk ({unsaved[lease]})" if lease in unsaved else why

        last = Heartbeat(tuple(WorkerReport(lease, None, WorkerState.dead, exit_code=code, reason=reason(lease))
                               for lease, code in exit_codes.items()) + tuple(spilled),
                         tuple(GPUReading.of(g) for g in inventory.metrics()), inventory.error, leaving=True)
        try:
            await asyncio.wait_for(self.call("POST", self.heartbeat_path, last.to_json()), 2.0)
        except Exception:  # the service may be down too; its node TTL covers it
            pass

