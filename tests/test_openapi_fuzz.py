"""The REST API fuzzed from its own OpenAPI document with schemathesis.

A live service (SQLite, one agent with two simulated A100s) serves
``/api/v1/openapi.json``; the first test checks that it is the document
``hub_plugin.openapi.document`` builds for the service's settings, from which
schemathesis generates, for every operation, valid and invalid requests (its
coverage and fuzzing phases, positive and negative data), sent once with a
plain user's token and once with an admin's. Each response must pass
schemathesis's checks: no server error, a documented status code, content
type and headers, a body that matches the document, invalid input rejected
and valid input accepted. Besides, every request answered 4xx must have
changed nothing: no lease created or released, no quota override touched, no
node added.

Deterministic (fixed seed, derandomized) and bounded (``MAX_EXAMPLES`` per
operation); the last test prints how many cases each run sent.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis

from gpupool.api import ServiceClient
from gpupool.hub_plugin.openapi import document
from procs import start_agent, start_service

SEED = 20261129
#: Fuzzing examples per operation (the coverage phase adds its own, deterministic ones).
MAX_EXAMPLES = 10
#: Longest long poll (``GET /leases/{id}?wait=``) a case may ask for, seconds: the
#: service waits up to 60, which would make the run long without testing more.
MAX_POLL = 0.2
TOKENS = {"tester": "fuzz-user-token", "boss": "fuzz-admin-token"}
LIMITS = {"max_wait": 600.0, "max_idle_timeout": 7200.0}
#: Small quotas: each valid lease request starts a real worker process.
CONFIG = {"admin_users": {"boss"}, "heartbeat_ttl": 3600.0, **LIMITS,
          "quotas": {"*": {"max_gpus": 0.05}, "user:boss": {"max_gpus": 0.05}}}
#: Fewest cases a run must send, and of them answered 2xx and 4xx, for it to count.
MIN_CASES, MIN_ACCEPTED, MIN_REJECTED = 200, 10, 100
DOCUMENT = document(**LIMITS)

_COUNTS = {user: {"cases": 0, "accepted": 0, "rejected": 0} for user in TOKENS}
#: The service's state after the previous case (see :func:`_state`).
_LAST: dict[str, Any] = {}


def _schema(user: str):
    """Schemathesis's view of :data:`DOCUMENT`, sending ``user``'s token."""
    config = schemathesis.Config.from_dict({
        "seed": SEED,
        # Health checks of generation speed and example size fail runs on a busy machine, not bugs.
        "suppress-health-check": ["too_slow", "large_base_example"],
        "headers": {"Authorization": f"token {TOKENS[user]}"},
        "request-timeout": 30,
        "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
    })
    return schemathesis.openapi.from_dict(DOCUMENT, config=config)


as_user, as_admin = _schema("tester"), _schema("boss")


@pytest.fixture(scope="module")
def fuzz_pool(tmp_path_factory):
    """A service with a user and an admin, and one agent: ``service``."""
    root = tmp_path_factory.mktemp("fuzz")
    service = start_service(root, tokens=TOKENS, config=CONFIG)
    agent = start_agent(root, service)
    yield service
    agent.stop()  # raises if any worker the fuzz started outlived it
    assert service.stop() == 0


def test_the_fuzzed_document_is_the_one_served(fuzz_pool):
    served = ServiceClient(fuzz_pool.url, None).request("GET", "/openapi.json")
    assert served == document(**LIMITS)


@as_user.parametrize()
def test_fuzzed_as_a_user(case, fuzz_pool):
    _send(case, fuzz_pool, "tester")


@as_admin.parametrize()
def test_fuzzed_as_an_admin(case, fuzz_pool):
    _send(case, fuzz_pool, "boss")


def test_every_fuzz_run_sent_enough_cases():
    for user, counts in _COUNTS.items():
        print(f"openapi fuzz as {user}: {counts['cases']} cases, {counts['accepted']} answered 2xx, "
              f"{counts['rejected']} answered 4xx (each changed nothing), none 5xx")  # shown with -rA
        assert counts["cases"] >= MIN_CASES, counts
        assert counts["accepted"] >= MIN_ACCEPTED and counts["rejected"] >= MIN_REJECTED, counts


def _send(case, service, user: str) -> None:
    """Send ``case``, run schemathesis's checks on the answer, and for a 4xx
    check that the service's state did not change."""
    wait = (case.query or {}).get("wait")
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait > MAX_POLL:
        case.query["wait"] = MAX_POLL
    before = _LAST.get("state") or _state(service)
    response = case.call_and_validate(base_url=f"{service.url}/api/v1")
    after = _LAST["state"] = _state(service)
    counts = _COUNTS[user]
    counts["cases"] += 1
    if 200 <= response.status_code < 300:
        counts["accepted"] += 1
    elif 400 <= response.status_code < 500:
        counts["rejected"] += 1
        assert after == before, (f"{case.method} {case.formatted_path} answered {response.status_code} "
                                 f"but changed the service's state: {response.text[:300]}")


def _state(service) -> dict[str, Any]:
    """What a rejected request must not change, blind to what the service changes
    by itself meanwhile (workers starting, reclaim, heartbeats): per lease its
    request and whether a person released it; the quota overrides with their
    times; the nodes' names."""
    state: dict[str, Any] = {}
    for user, token in TOKENS.items():
        client = ServiceClient(service.url, token, timeout=30)
        state[user] = {lease.id: (lease.owner, lease.fraction, lease.gpu_count, lease.kernel_id,
                                  any((e.get("reason") or "").startswith("released by") for e in lease.events))
                       for lease in client.list_leases(active=False)}
    admin = ServiceClient(service.url, TOKENS["boss"], timeout=30)
    state["overrides"] = admin.admin_quotas()["overrides"]
    state["nodes"] = sorted(node["name"] for node in admin.pool()["nodes"])
    return state
