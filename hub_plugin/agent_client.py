"""The service's calls to node agents (docs/api.md, "Agent").

Every failure becomes a GPUPoolError naming the agent URL that was tried,
so a log line or a lease's reason tells an admin where to look.
"""

from __future__ import annotations

from typing import Any

from gpupool.errors import GPUPoolError, Reason
from gpupool.httpout import JSONClient, NoAnswer
from gpupool.tls import client_context
from gpupool.units import format_duration
from gpupool.wire.parking import ParkRequest, WorkerParked, WorkerResumed
from gpupool.wire.workers import WorkerRequest, WorkerStarted, WorkerStopped


class AgentGone(GPUPoolError):
    """``agent_unreachable`` because nothing listens at the agent's URL (the
    connection was refused): its agent is not running there."""


class AgentClient:
    """Async HTTP client of the agents, sending ``agent_token``.

    One client serves all agents; ``max_clients`` bounds concurrent calls
    (worker starts can take a while, so tornado's default of 10 is too few).
    Agents that serve HTTPS are verified against the system's CAs plus
    ``ca_file`` (default: ``$GPUPOOL_CA_FILE``; GPUPoolError
    ``not_configured`` when it cannot be read).
    """

    def __init__(self, agent_token: str, max_clients: int = 100, ca_file: str | None = None) -> None:
        self._token = agent_token
        self._http = JSONClient(client_context(ca_file), max_clients)

    async def start_worker(self, url: str, request: WorkerRequest, timeout: float) -> WorkerStarted:
        """``POST {url}/workers`` with ``request``; returns the started worker.

        ``timeout`` seconds for the whole start. Raises GPUPoolError
        ``worker_start_failed`` (with the agent's reason), ``agent_stopping``
        (the agent is stopping: it started nothing) or ``agent_unreachable``.
        """
        status, reply = await self._call("POST", f"{url}/workers", request.to_json(), timeout)
        if status == 201:
            try:
                return WorkerStarted.from_json(reply)
            except ValueError:
                pass  # no connection: as good as no worker
        code = Reason.agent_stopping if status == 503 and reply.get("error") == Reason.agent_stopping \
            else Reason.worker_start_failed
        raise _failed(code, "POST", f"{url}/workers", status, reply)

    async def stop_worker(self, url: str, lease_id: str, timeout: float) -> int | None:
        """``DELETE {url}/workers/{lease_id}``; returns the worker's exit code,
        or None when the agent did not know it (404: already gone).
        Raises GPUPoolError ``agent_unreachable`` or ``worker_stop_failed``."""
        status, reply = await self._call("DELETE", f"{url}/workers/{lease_id}", None, timeout)
        if status == 404:
            return None
        if status != 200:
            raise _failed(Reason.worker_stop_failed, "DELETE", f"{url}/workers/{lease_id}", status, reply)
        return WorkerStopped.from_json(reply).exit_code

    async def park_worker(self, url: str, lease_id: str, request: ParkRequest, timeout: float) -> WorkerParked:
        """``POST {url}/workers/{lease_id}/park``; returns where the state went.

        Raises GPUPoolError ``worker_busy`` (409: a cell runs and ``request`` refuses
        to touch it), ``agent_unreachable``, or ``cannot_park`` with the agent's
        words for any other answer (an agent from before parking, a worker it
        does not know, a checkpointer that failed)."""
        path = f"{url}/workers/{lease_id}/park"
        status, reply = await self._call("POST", path, request.to_json(), timeout)
        if status == 200:
            try:
                return WorkerParked.from_json(reply)
            except ValueError:
                pass
        if status == 409 and reply.get("error") == Reason.worker_busy:
            raise GPUPoolError(Reason.worker_busy, reply.get("message") or "a cell is running on the worker", 409)
        raise _failed(Reason.cannot_park, "POST", path, status, reply)

    async def resume_worker(self, url: str, request: WorkerRequest, timeout: float) -> WorkerResumed:
        """``POST {url}/workers/{lease_id}/resume`` with the GPUs and limits granted now;
        returns the worker's connection. Raises GPUPoolError ``not_found`` (the agent
        knows no worker of that lease: its state is gone), ``agent_unreachable``, or
        ``worker_start_failed`` with the agent's words (its worker stays parked)."""
        path = f"{url}/workers/{request.lease_id}/resume"
        status, reply = await self._call("POST", path, request.to_json(), timeout)
        if status == 200:
            try:
                return WorkerResumed.from_json(reply)
            except ValueError:
                pass
        raise _failed(Reason.not_found if status == 404 else Reason.worker_start_failed, "POST", path, status, reply)

    async def _call(self, method: str, url: str, body: Any, timeout: float) -> tuple[int, dict[str, Any]]:
        try:
            answer = await self._http.call(method, url, body, token=self._token, timeout=timeout,
                                           connect_timeout=min(timeout, 10.0))
        except NoAnswer as exc:
            raise _unreachable(url, exc, timeout) from None
        return answer.status, answer.object()

    def close(self) -> None:
        self._http.close()


def _failed(code: Reason, method: str, url: str, status: int, reply: dict[str, Any]) -> GPUPoolError:
    """A 502 ``code``: the agent's own reason, else its status; the log names the call."""
    message = reply.get("message")
    words = message if isinstance(message, str) and message else f"the agent at {url} answered HTTP {status}"
    return GPUPoolError(code, words, 502, log_message=f"{method} {url} -> HTTP {status} "
                        f"{reply.get('error', '')}: {words}")


def _unreachable(url: str, exc: NoAnswer, timeout: float) -> GPUPoolError:
    untrusted = exc.untrusted_words(f"the node agent at {url}")
    if untrusted:
        return GPUPoolError(Reason.agent_unreachable, untrusted, 502)
    words = (f"did not answer within {format_duration(timeout)}" if "timeout" in str(exc).lower()
             else "could not be reached")  # refused, no route: said at once, not after the bound
    refused = any(isinstance(cause, ConnectionRefusedError) for cause in (exc.cause, exc.reason))
    args = (Reason.agent_unreachable, f"the node agent at {url} {words} ({exc.cause})", 502)
    log_message = f"the node agent at {url} {words} ({exc.cause!r})"
    if refused:  # nothing listens there: the agent is not running (no route or a timeout may pass)
        return AgentGone(*args, log_message=log_message)
    return GPUPoolError(*args, log_message=log_message)
