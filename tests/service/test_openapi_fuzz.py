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

The bulk (below): hypothesis strategies for what schemathesis never made
(number literals of hundreds of digits, nesting 200,000 deep, lone surrogates,
bytes that are not UTF-8, huge integers in the agent's fields), 2,600 generated
requests each sent with the user's, the admin's and the agent's token and
without a valid one: 10,400 cases, none answered 5xx, none changing the store
when refused. Measured here: about 16 ms a case on 2 busy CPUs (load average
10), most of it hypothesis's own work per example, hence four sends per example.
"""

from __future__ import annotations

import http.client
import json
import socket
import sqlite3
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings, strategies as st

from gpupool.api import ServiceClient
from gpupool.hub_plugin.openapi import document
from gpupool.wire.leases import LeaseRequest
from procs import start_agent, start_service
from service_api import register, silent_listener

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


# -- the bulk: hypothesis against the live service, at a few milliseconds a case -------------------------------
#
# Schemathesis sends each case on a new connection and reads the state through
# the API four times per case (about 10 cases a second here). For the bulk,
# hypothesis drives the service directly: one kept-alive connection, the state
# read from the SQLite file, and strategies for the inputs a probe found to give
# 500s, which schemathesis never generated: number literals of
# hundreds of digits, nesting tens of thousands deep, lone surrogates in any
# string, bytes that are not UTF-8, NUL and control characters, huge integers
# in every numeric field of the agent's registration and heartbeat. Every
# answer must be a 4xx or 2xx in the error shape; every 4xx changes nothing.


#: Generated requests; each is sent as the user, the admin, the agent and without a valid token: 10,400 cases.
BULK_EXAMPLES = 2600
BULK_COUNTS: dict[str | None, dict[int, int]] = {"tester": {}, "boss": {}, "agent": {}, None: {}}

_SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
_ODD_TEXT = st.one_of(
    st.text(max_size=30),
    st.text(st.one_of(st.characters(), _SURROGATE), min_size=1, max_size=10),  # lone surrogates
    st.text(st.characters(max_codepoint=0x1F), min_size=1, max_size=5),  # NUL and control characters
    st.sampled_from(["", " ", "A100", "L-000000000000", "user:bob", "*", "http://[::1", "x" * 300]))
_ODD_NUMBER = st.one_of(
    st.integers(), st.integers(min_value=-(10**120), max_value=10**120), st.sampled_from([2**63, 2**64, 2**70]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, -1, 0.01, 0.02, 0.5, 1, 2, 64, 65, 1e308]))
_LEAF = st.one_of(st.none(), st.booleans(), _ODD_NUMBER, _ODD_TEXT)
_JSON = st.recursive(_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                    st.dictionaries(_ODD_TEXT, inner, max_size=3)), max_leaves=5)
#: A field's value: mostly one odd leaf, sometimes any JSON (generation stays cheap: a case is a few ms).
_VALUE = st.one_of(_LEAF, _LEAF, _LEAF, _JSON)


def _fields(*names: str) -> st.SearchStrategy[dict]:
    """Objects with some of ``names`` (the endpoint's own fields), each an odd value."""
    return st.fixed_dictionaries({}, optional={name: _VALUE for name in names})


_GPU = _fields("uuid", "name", "index", "memory_total", "memory_reserved", "compute_capability", "healthy")
_REPORT = _fields("lease_id", "pid", "execution_state", "idle_since", "exit_code", "memory_used", "reason")
_READING = _fields("uuid", "memory_used", "memory_unattributed", "utilization", "healthy")
_BODIES = {
    "lease": _fields(*LeaseRequest.KEYS),
    "limits": _fields("max_gpus", "max_lease_gpus", "gpu_hours_per_day", "gpu_hours_per_week", "max_idle_timeout"),
    "register": st.fixed_dictionaries({"name": st.one_of(st.just("node-fuzz"), _ODD_TEXT),
                                       "url": st.one_of(st.just("http://127.0.0.1:9"), _ODD_TEXT),
                                       "inventory": st.sampled_from(["simulated", "nvml", "gpu"]),
                                       "gpus": st.lists(st.one_of(_GPU, _VALUE), max_size=2)},
                                      optional={"workers": st.lists(_REPORT, max_size=2), "enforcement": _VALUE,
                                                "whole_gpus": _VALUE, "inventory_error": _VALUE}),
    "heartbeat": st.fixed_dictionaries({}, optional={"workers": st.one_of(st.lists(_REPORT, max_size=2), _VALUE),
                                                     "gpus": st.one_of(st.lists(_READING, max_size=2), _VALUE),
                                                     "inventory_error": _VALUE}),
}


def _raw(body: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    """The body as sent: JSON of ``body`` (surrogates as ``\\ud800`` escapes), or bytes no JSON encoder makes."""
    return st.one_of(
        body.map(lambda value: json.dumps(value).encode()),
        st.integers(33, 200_000).map(lambda n: b"[" * n + b"]" * n),  # nested deeper than 32
        st.integers(101, 5000).map(lambda n: b'{"fraction": 1' + b"0" * n + b"}"),  # a 100+ digit literal
        st.binary(max_size=40),  # anything, UTF-8 or not
        st.sampled_from([b"", b"{", b'{"a": NaN}', b'{"wait": 1e999}', b'"\\ud800"', b'{"\\udfff": 1}']))


_PATH_ID = st.one_of(st.sampled_from(["{mine}", "{theirs}", "L-000000000000"]),
                     st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="/?#%"),
                             min_size=1, max_size=20))
_QUERY = st.dictionaries(st.sampled_from(["wait", "state", "active", "kernel_id", "reason", "days"]),
                         st.one_of(st.text(max_size=10), st.sampled_from(["0.1", "-1", "nan", "1e999", "9" * 400])),
                         max_size=2)


@st.composite
def _request(draw) -> tuple[str, str, bytes | None]:
    """``(method, path with query, body)`` of one call to the API."""
    what = draw(st.sampled_from([
        ("POST", "/leases", "lease"), ("GET", "/leases", None), ("GET", "/leases/{id}", None),
        ("DELETE", "/leases/{id}", None), ("POST", "/leases/{id}/heartbeat", "heartbeat"),
        ("GET", "/pool", None), ("GET", "/quota", None), ("POST", "/nodes", "register"),
        ("POST", "/nodes/{name}/heartbeat", "heartbeat"), ("GET", "/admin/quotas", None),
        ("PUT", "/admin/quotas/{scope}", "limits"), ("DELETE", "/admin/quotas/{scope}", None),
        ("GET", "/admin/usage", None), ("PATCH", "/leases", "lease")]))
    method, path, body = what
    path = path.replace("{id}", draw(_PATH_ID))
    path = path.replace("{name}", draw(st.one_of(st.just("node-x"), _PATH_ID)))
    path = path.replace("{scope}", urllib.parse.quote(draw(st.one_of(st.sampled_from(["user:bob", "*", "group:g"]),
                                                                     _ODD_TEXT)), safe=""))
    query = draw(_QUERY)
    if query:
        path += "?" + urllib.parse.urlencode(query)
    return method, path, draw(_raw(_BODIES[body])) if body else None


class _Bulk:
    """One kept-alive connection to the bulk service, and its store's fingerprint."""

    def __init__(self, service, tokens: dict[str | None, str]) -> None:
        self.service, self.tokens = service, tokens
        host, port = service.url.rsplit("/", 1)[-1].rsplit(":", 1)
        self.address = (host, int(port))
        self.conn = http.client.HTTPConnection(*self.address, timeout=60)
        self.db = sqlite3.connect(f"file:{service.state_dir}/gpupool.sqlite?mode=ro", uri=True,
                                  isolation_level=None, check_same_thread=False)
        self.ids: dict[str, str] = {}
        self.last = self.fingerprint()

    def send(self, token: str | None, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        path = "/api/v1" + path.replace("{mine}", self.ids["mine"]).replace("{theirs}", self.ids["theirs"])
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"token {token}"
        for attempt in (1, 2):  # the service closes a connection it refused a body on: open a new one
            try:
                self.conn.request(method, path, body=body, headers=headers)
                response = self.conn.getresponse()
                return response.status, response.read()
            except (http.client.HTTPException, ConnectionError, socket.timeout):
                self.conn.close()
                self.conn = http.client.HTTPConnection(*self.address, timeout=60)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def fingerprint(self) -> tuple:
        """What a rejected request must not change, blind to what the service does by
        itself meanwhile (a placed lease failing to start on a made-up node, placements):
        the leases' requests and their releases by a person, the quota overrides, the
        nodes and their GPUs."""
        query = self.db.execute
        return (query("SELECT id, owner, fraction, gpu_count, kernel_id, model, server_name FROM leases "
                      "ORDER BY id").fetchall(),
                query("SELECT lease_id, reason FROM lease_events WHERE reason LIKE 'released by%' "
                      "ORDER BY lease_id").fetchall(),
                query("SELECT scope, limits FROM quota_overrides ORDER BY scope").fetchall(),
                query("SELECT name, url, inventory, enforcement, whole_gpus FROM nodes ORDER BY name").fetchall(),
                query("SELECT uuid, node_name, name, \"index\", memory_total, memory_reserved FROM gpus "
                      "ORDER BY uuid").fetchall())


@pytest.fixture(scope="module")
def bulk():
    """A service with tester, bob and the admin boss, on a node whose agent never
    answers (leases placed there stay ``starting``; releasing one takes 0.2 s)."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="fuzz-bulk-"))
    config = {**CONFIG, "node_ttl": 3600, "worker_start_timeout": "1h", "worker_stop_timeout": 0.2}
    service = start_service(root, tokens={**TOKENS, "bob": "fuzz-bob-token"}, config=config)
    with silent_listener() as silent:
        service.silent_url = "http://127.0.0.1:%d" % silent.getsockname()[1]
        register(service, "node-x")
        tokens = {"tester": service.user_token, "boss": TOKENS["boss"], "agent": service.agent_token, None: None}
        world = _Bulk(service, tokens)
        world.ids["mine"] = service.client().create_lease(LeaseRequest(fraction=0.01)).id
        world.ids["theirs"] = service.client("bob").create_lease(LeaseRequest(fraction=0.01)).id
        world.last = world.fingerprint()
        yield world
        world.conn.close()
        world.db.close()
    assert service.stop() == 0


def _bulk_case(world: _Bulk, who: str | None, token: str | None, request) -> None:
    method, path, body = request
    status, raw = world.send(token, method, path, body)
    counts = BULK_COUNTS[who]
    counts[status] = counts.get(status, 0) + 1
    assert status < 500, f"{method} {path} {(body or b'')[:200]!r} as {who} -> {status}: {raw[:300]!r}"
    reply = json.loads(raw)
    if status >= 400:
        assert set(reply) >= {"error", "message"} and "Traceback" not in reply["message"], reply
        if who is None:
            assert status in (400, 401, 404, 405), (method, path, status, reply)  # no token: refused first
        after = world.fingerprint()
        assert after == world.last, f"{method} {path} {(body or b'')[:200]!r} as {who} answered {status} " \
                                    "but changed the store"
    else:
        world.last = world.fingerprint()


_BULK_SETTINGS = dict(derandomize=True, database=None, deadline=None, print_blob=True,
                      suppress_health_check=list(HealthCheck))


@pytest.mark.timeout(900)
def test_bulk_fuzz(bulk):
    """Each generated request is sent four times: with the user's, the admin's and
    the agent's token, and with none or a made-up one (hypothesis's own cost per
    example is most of a case's time here, so one example makes four cases)."""
    @settings(max_examples=BULK_EXAMPLES, **_BULK_SETTINGS)
    @given(_request(), st.sampled_from([None, "not-a-token"]))
    def case(request, bad_token):
        for who in ("tester", "boss", "agent"):
            _bulk_case(bulk, who, bulk.tokens[who], request)
        _bulk_case(bulk, None, bad_token, request)

    case()


def test_every_bulk_run_sent_its_cases():
    for who in BULK_COUNTS:
        print(f"bulk fuzz as {who}: {sum(BULK_COUNTS[who].values())} cases, by status "
              f"{dict(sorted(BULK_COUNTS[who].items()))}")  # shown with -rA
        assert sum(BULK_COUNTS[who].values()) >= BULK_EXAMPLES, who
    assert sum(sum(c.values()) for c in BULK_COUNTS.values()) >= 10_000
