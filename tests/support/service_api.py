"""Calls to a real pool service's REST API as the tests make them: raw
requests, node registration as an agent would, and waits on a lease's state."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any

from procs import wait_for

from gpupool.schema import LeaseState
from gpupool.wire.leases import Lease, LeaseRequest

GiB = 1024**3


def http(svc, method: str, path: str, body: Any = None, *, token: str | None = "user", raw: bytes | None = None,
         prefix: str = "/api/v1") -> tuple[int, Any]:
    """One raw call; ``token`` "user" (the default user's), "agent", None, or a token.
    Returns (status, decoded JSON or text)."""
    token = {"user": svc.user_token, "agent": svc.agent_token}.get(token, token)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(svc.url + prefix + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")  # else urllib sends a form type, which gets 415
    if token:
        request.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def assert_error(reply: tuple[int, Any], status: int, code: str) -> dict[str, Any]:
    got_status, body = reply
    assert (got_status, body.get("error")) == (status, code), body
    assert isinstance(body["message"], str) and body["message"]
    return body


def all_leases(svc) -> list[dict[str, Any]]:
    status, body = http(svc, "GET", "/leases?active=0")
    assert status == 200
    return body["leases"]


def register(svc, name: str = "node-x", gpus: int = 2, url: str | None = None,
             enforcement: str = "none", whole_gpus: bool = False) -> dict[str, Any]:
    """Register a node through the API (as an agent would), with ``gpus`` A100s
    (``whole_gpus``: its mode's capacity rule, as the agent reports it).
    Its agent URL is ``svc.silent_url`` unless given (see the ``service`` fixture here)."""
    url = url or svc.silent_url
    body = {"name": name, "url": url, "inventory": "simulated", "enforcement": enforcement,
            "whole_gpus": whole_gpus, "gpus": [{"uuid": f"GPU-{name}-{i}", "name": "NVIDIA A100-SXM4-80GB", "index": i,
                      "memory_total": 80 * GiB, "memory_reserved": 0} for i in range(gpus)], "workers": []}
    status, reply = http(svc, "POST", "/nodes", body, token="agent")
    assert status == 200, reply
    return reply


def wait_state(svc, lease_id: str, leave: str, user: str | None = None, timeout: float = 60) -> Lease:
    """Long-poll until the lease leaves ``leave``."""
    client = svc.client(user)
    deadline = time.monotonic() + timeout
    lease = client.get_lease(lease_id)
    while lease.state.value == leave and time.monotonic() < deadline:
        lease = client.get_lease(lease_id, wait=min(30, deadline - time.monotonic()), state=leave)
    return lease


def wait_ended(svc, lease_id: str, timeout: float = 60) -> Lease:
    """Long-poll until the lease has ended (released, reclaimed or failed)."""
    deadline = time.monotonic() + timeout
    lease = svc.client().get_lease(lease_id)
    while not lease.state.ended and time.monotonic() < deadline:
        lease = wait_state(svc, lease_id, lease.state.value, timeout=deadline - time.monotonic())
    return lease


def acquire(svc, fraction: float = 0.5, **kwargs: Any) -> Lease:
    """A lease that is active (fails the test otherwise)."""
    lease = svc.client().create_lease(LeaseRequest(fraction=fraction, **kwargs))
    assert lease.state is LeaseState.starting
    lease = wait_state(svc, lease.id, "starting")
    assert lease.state is LeaseState.active, lease.reason
    return lease


def gpu_allocations(svc) -> list[float]:
    return [gpu["allocated_fraction"] for node in svc.client().pool()["nodes"] for gpu in node["gpus"]]


def silent_listener() -> socket.socket:
    """A socket that accepts connections and never answers: an agent address
    whose worker starts hang, so leases placed there stay ``starting``
    (holding capacity) for the whole test."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(128)
    return silent


def ended_lease(service, lease_id: str, timeout: float, what: str):
    """The lease once it has ended (long-polled through the service's API)."""
    client = service.client()
    return wait_for(lambda: (lease := client.get_lease(lease_id)).state.ended and lease, timeout, what)


def active_leases(service) -> list:
    """The default user's active leases."""
    return service.client().list_leases(active=True)
