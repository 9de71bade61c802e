"""Real gpupool processes for tests, on top of :mod:`gpupool.demo_pool`.

``start_service`` writes a config file with fast reclaim and heartbeat
intervals and known user tokens, so tests can act as several users.
"""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from gpupool import demo_pool
from gpupool.api import ServiceClient
from gpupool.demo_pool import AgentProcess, free_port, processes_mentioning, stop_process, wait_for
from gpupool.hub_plugin.config import GPUPool, PoolLeases, PoolNodes, PoolPressure, PoolQuotas
from gpupool.moved_settings import new_homes

#: The class of each service setting, by name: ``{"idle_timeout": "PoolLeases", ...}``.
SETTING_CLASS = new_homes([GPUPool, PoolNodes, PoolLeases, PoolPressure, PoolQuotas])

__all__ = ["ServiceProc", "AgentProcess", "start_service", "start_agent", "free_port", "processes_mentioning",
           "stop_process", "wait_for"]


@dataclass
class ServiceProc:
    """A running service and the tokens of its test users (``tester`` and any given)."""

    process: demo_pool.ServiceProcess
    extra_tokens: dict[str, str]

    @property
    def proc(self) -> subprocess.Popen:
        return self.process.proc

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def state_dir(self) -> Path:
        return self.process.state_dir

    @property
    def log(self) -> Path:
        return self.process.log

    @property
    def user_token(self) -> str:
        return self.extra_tokens["tester"]

    @property
    def agent_token(self) -> str:
        return self.process.agent_token_file.read_text().strip()

    def client(self, user: str | None = None) -> ServiceClient:
        """A client acting as ``user`` (default ``tester``)."""
        return ServiceClient(self.url, self.extra_tokens[user or "tester"], timeout=30)

    def stop(self) -> int:
        return self.process.stop()


def start_service(root: Path, *, tokens: dict[str, str] | None = None, config: dict[str, Any] | None = None,
                  env: dict[str, str] | None = None, ip: str = "127.0.0.1", port: int | None = None,
                  launcher: Sequence[str] = ()) -> ServiceProc:
    """Start ``gpupool service`` under ``root/service``.

    ``tokens`` maps user name -> token (``tester`` is always there);
    ``config`` holds more service settings by name (``{"idle_timeout": 60}``, written
    ``c.PoolLeases.idle_timeout = 60``), over fast test defaults;
    ``ip``, ``port``, ``launcher``: as for :func:`gpupool.demo_pool.start_service`.
    """
    state = root / "service"
    state.mkdir(parents=True, exist_ok=True)
    settings = {"reclaim_interval": 0.2, "node_heartbeat_interval": 0.2, **(config or {})}
    users = {"tester": "user-token-" + os.urandom(8).hex(), **(tokens or {})}
    lines = [f"c.{SETTING_CLASS[key]}.{key} = {value!r}" for key, value in settings.items()]
    lines.append(f"c.GPUPool.api_tokens = {({token: user for user, token in users.items()})!r}")
    config_file = state / "gpupool_config.py"
    config_file.write_text("\n".join(lines) + "\n")
    return ServiceProc(demo_pool.start_service(state, config_file=config_file, env=env, ip=ip, port=port,
                                               launcher=launcher), users)


def start_agent(root: Path, service: ServiceProc, *, name: str = "node-1", simulate: str = "2xA100-80GB",
                extra_args: list[str] | None = None, ip: str = "127.0.0.1", port: int | None = None,
                launcher: Sequence[str] = ()) -> AgentProcess:
    """Start ``gpupool agent --simulate SPEC`` under ``root/agent-NAME``; ready once the service lists it.
    ``ip``, ``port``, ``launcher``: as for :func:`gpupool.demo_pool.start_agent`."""
    return demo_pool.start_agent(root / f"agent-{name}", service.process, name=name, simulate=simulate,
                                 extra_args=extra_args, client=service.client(), ip=ip, port=port, launcher=launcher)


@contextmanager
def cluster_pool(root: Path, agent_args: list[str]) -> Iterator[tuple[ServiceProc, AgentProcess]]:
    """A service and one agent (two simulated GPUs) started with ``agent_args`` (a cluster launcher's
    settings), with a long client heartbeat TTL and a short node TTL; both stopped after."""
    service = start_service(root, config={"heartbeat_ttl": 120.0, "node_ttl": 3.0})
    agent = start_agent(root, service, simulate="2xA100-80GB", extra_args=agent_args)
    try:
        yield service, agent
    finally:
        agent.stop()
        service.stop()
