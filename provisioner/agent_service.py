"""The agent's side of the service's node API (docs/api.md, "Service:
``/api/v1``", ``POST /nodes`` and ``POST /nodes/{name}/heartbeat``): register,
heartbeat, and a last heartbeat when it stops."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from gpupool.errors import GPUPoolError
from gpupool.httpout import JSONClient, NoAnswer
from gpupool.schema import WorkerState
from gpupool.wire.nodes import GPUReading, Heartbeat, HeartbeatReply, RegistrationReply, WorkerReport

from .agent_tokens import TOKEN_ENV
from .inventory import backoff_delay

if TYPE_CHECKING:
    from .agent import NodeAgent

#: Seconds before the first registration retry; each failure doubles it, up to ``retry_max``.
REGISTRATION_RETRY_FIRST_S = 0.5


class ServiceLink:
    """Calls to ``{service_url}/api/v1`` for ``agent``: its settings
    (``service_url``, ``service_timeout``, ``service_tls``, ``retry_max``,
    ``token_file``, ``node_name``, ``log``) and the bodies and answers it gives
    (``registration``, ``heartbeat``, ``refresh_inventory``,
    ``stop_workers``, ``write_agent_json``) and its ``tokens``, read again
    before each registration."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent, self.log = agent, agent.log
        self.url, self.node = agent.service_url, agent.node_name
        self.heartbeat_path = f"/nodes/{quote(agent.node_name, safe='')}/heartbeat"
        self.http = JSONClient(agent.service_tls)

    def close(self) -> None:
        self.http.close()

    async def run(self) -> None:
        """Register, then heartbeat every ``heartbeat_interval``; register
        again when the service forgets the node (404)."""
        while True:
            interval = await self.register()
            while True:
                await asyncio.sleep(interval)
                if await self.agent.refresh_inventory():
                    break  # NVML is back: register its GPUs
                try:
                    status, reply = await self.call("POST", self.heartbeat_path, self.agent.heartbeat().to_json())
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
                self.agent.stop_workers(HeartbeatReply.from_json(reply).stop)

    async def register(self) -> float:
        """``POST /nodes`` until it succeeds, backing off while the service is
        down or refuses; writes ``agent.json``; returns the heartbeat interval."""
        failures = 0
        while True:
            try:
                self.agent.tokens.read()  # also what the service's calls here must carry
                status, reply = await self.call("POST", "/nodes", self.agent.registration().to_json())
            except GPUPoolError as exc:
                status, reply, problem = 0, {}, exc.message
            except Exception as exc:  # unreachable, or a bad --service-url
                status, reply, problem = 0, {}, f"cannot reach it ({exc})"
            else:
                problem = f"HTTP {status}: {reply.get('message') or 'no message'}"
                if status in (401, 403):
                    problem += (f" (check --token-file {self.agent.token_file or '(unset)'} / {TOKEN_ENV}: it must "
                                "hold the service's agent token, STATE_DIR/agent_token, not a user token)")
            if status == 200:
                break
            failures += 1
            delay = backoff_delay(failures, REGISTRATION_RETRY_FIRST_S, self.agent.retry_max)
            self.log.warning("registration with %s failed: %s; retrying in %.1fs", self.url, problem, delay)
            await asyncio.sleep(delay)
        registered = RegistrationReply.from_json(reply)
        self.agent.write_agent_json()
        self.log.info("registered with %s as %s (heartbeat every %gs)", self.url, self.node,
                      registered.heartbeat_interval)
        self.agent.stop_workers(registered.stop)
        return registered.heartbeat_interval

    async def call(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        """One call to ``{service_url}/api/v1{path}``; returns (status, JSON
        reply). Raises OSError when the service cannot be reached."""
        agent = self.agent
        try:
            answer = await self.http.call(method, f"{self.url}/api/v1{path}", body, token=agent.tokens.token,
                                          timeout=agent.service_timeout)
        except NoAnswer as exc:
            untrusted = exc.untrusted_words(f"the pool service at {self.url}")
            if untrusted:
                raise OSError(untrusted) from None
            raise
        return answer.status, answer.object()

    async def goodbye(self, exit_codes: dict[str, int | None]) -> None:
        """Tell the service, best effort, that the workers are gone (``dead``
        with their exit codes), so their leases end now rather than when the
        node's TTL runs out."""
        why = f"the node agent on {self.node} was stopped"
        last = Heartbeat(tuple(WorkerReport(lease, None, WorkerState.dead, exit_code=code, reason=why)
                               for lease, code in exit_codes.items()),
                         tuple(GPUReading.of(g) for g in self.agent.inventory.metrics()), self.agent.inventory.error)
        try:
            await asyncio.wait_for(self.call("POST", self.heartbeat_path, last.to_json()), 2.0)
        except Exception:  # the service may be down too; its node TTL covers it
            pass

