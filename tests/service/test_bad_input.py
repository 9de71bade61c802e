"""Bad input through every door gets a clear error and changes nothing.

Three tables against one live pool (service, one agent with two simulated
A100s; users ``tester``, ``bob`` and the admin ``boss``; bob holds an active
lease, tester a released one, boss has set an override for bob), once on
SQLite and once on PostgreSQL (where ``GPUPOOL_TEST_POSTGRES_URL`` names one):

- REST: raw HTTP calls to ``/api/v1``, each row the request, the status,
  the error code and words of the message;
- CLI: ``gpupool ...`` run as a real process, each row the arguments, the
  exit code and words on stderr;
- magics: ``%gpu ...`` in a real IPython shell pointed at the pool, each row
  the line and words of the UsageError.

After every row the service's state (each user's leases, limits and usage,
the quota overrides, what the pool has allocated) must equal the state
before it, and no answer may carry a traceback or the generic words of a 500.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpupool.leaseargs import FIELD_OPTIONS
from gpupool.wire.leases import LeaseRequest
from procs import free_port, start_agent, start_service

TOKENS = {"bob": "bob-token-bad-input", "boss": "boss-token-bad-input"}
CONFIG = {"admin_users": {"boss"}, "heartbeat_ttl": 3600.0, "quotas": {"*": {"max_gpus": 1.5}}}
GPUPOOL = Path(sys.executable).with_name("gpupool")
#: Lease fields that only a request may change (not workers' reports or the clock).
LEASE_FIELDS = ("id", "owner", "state", "reason", "fraction", "gpu_count", "memory", "node", "gpus",
                "idle_timeout", "kernel_id", "created_at", "started_at", "ended_at", "usage_gpu_seconds", "events")
NEVER = ("Traceback", "unexpected error", "internal_error")


@dataclass
class Pool:
    """The module's pool: the service, bob's active lease and tester's ended one."""

    service: Any
    bob_lease: str
    tester_lease: str
    last: dict[str, Any] | None = None  # the state after the previous row

    def token(self, user: str | None) -> str | None:
        """What to send as ``user``: a user's name, ``agent``, None (no token) or a made-up token."""
        if user is None:
            return None
        if user == "agent":
            return self.service.agent_token
        return self.service.user_token if user == "tester" else TOKENS.get(user, user)

    def check_unchanged(self, what: str) -> None:
        """Fail if the state differs from the previous row's (then take it as the new one)."""
        before, self.last = self.last, state(self.service)
        assert self.last == before, f"{what} changed the service's state"


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def store_url(request, tmp_path_factory):
    """``c.GPUPool.db_url`` of the module's pool: a SQLite file, or a fresh PostgreSQL
    database (it refuses NUL in text, which SQLite keeps) dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('store')}/gpupool.sqlite"
        return
    base = os.environ.get("GPUPOOL_TEST_POSTGRES_URL")
    if not base:
        if os.environ.get("GPUPOOL_REQUIRE_POSTGRES") == "1":
            pytest.fail("GPUPOOL_REQUIRE_POSTGRES=1 but GPUPOOL_TEST_POSTGRES_URL is not set")
        pytest.skip("PostgreSQL rows need GPUPOOL_TEST_POSTGRES_URL (e.g. postgresql+psycopg://postgres@127.0.0.1/test)")
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(base)
    admin = url.set(drivername="postgresql").render_as_string(hide_password=False)
    name = "gpupool_bad_input_" + os.urandom(6).hex()
    with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield url.set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def pool(tmp_path_factory, store_url):
    """The pool the docstring describes, on ``store_url``; the agent's stop checks that no worker leaked."""
    root = tmp_path_factory.mktemp("bad-input")
    service = start_service(root, tokens=TOKENS, config={**CONFIG, "db_url": store_url})
    agent = start_agent(root, service)
    bob = service.client("bob").create_lease(LeaseRequest(fraction=0.5))
    assert service.client("bob").get_lease(bob.id, wait=30, state="starting").state.value == "active"
    mine = service.client().create_lease(LeaseRequest(fraction=0.25))
    service.client().get_lease(mine.id, wait=30, state="starting")
    assert service.client().release(mine.id).state.value == "released"
    service.client("boss").set_quota("user:bob", {"max_gpus": 1})
    world = Pool(service, bob.id, mine.id)
    world.last = state(service)
    yield world
    agent.stop()
    assert service.stop() == 0


def state(service) -> dict[str, Any]:
    """What bad input must not change: every user's leases (the fields only
    requests change), limits, holdings and (while nothing is held, so the
    clock does not move it) usage; the quota overrides; the pool's allocations."""
    out: dict[str, Any] = {}
    for user in ("tester", *TOKENS):
        client = service.client(user)
        leases = client.request("GET", "/leases", params={"active": 0})["leases"]
        out[user] = [{k: lease[k] for k in LEASE_FIELDS} for lease in leases]
        quota = client.quota()
        used = quota["usage"]
        out[f"{user} quota"] = (quota["limits"], used["holding_gpus"],
                                (used["today_gpu_hours"], used["week_gpu_hours"]) if not used["holding_gpus"] else None)
    admin = service.client("boss")
    out["overrides"] = admin.admin_quotas()["overrides"]
    out["pool"] = [(node["name"], node["state"], [(g["uuid"], g["allocated_fraction"], g["allocated_memory"],
                                                   g["leases"], g["healthy"]) for g in node["gpus"]])
                   for node in admin.pool()["nodes"]]
    return out


def assert_clear(text: str, words: str) -> None:
    assert words in text, f"{words!r} not in {text!r}"
    assert not any(bad in text for bad in NEVER), text


# -- REST --------------------------------------------------------------------------------------------------

def rest(path: str, status: int, words: str, *, method: str = "POST", body: Any = None, raw: bytes | None = None,
         user: str | None = "tester", content_type: str = "application/json", code: str = "bad_request", id: str):
    """One row of the REST table. ``path`` may name ``{bob}`` (bob's active lease)
    or ``{mine}`` (tester's ended one); ``body`` is sent as JSON, ``raw`` as is."""
    return pytest.param(method, path, body, raw, user, content_type, status, code, words, id=id)


LONG = "x" * 201
#: The words for a count of whole GPUs above the pool's biggest node (two A100s), after the count.
BEYOND_NODE = ("whole GPUs is more than any node has (a lease's GPUs are all on one node): the biggest, node-1, has "
               "2 GPUs; ask for at most 2")
REST = [
    # POST /leases: the amount
    rest("/leases", 400, "'fraction' must be a number, got 'half'", body={"fraction": "half"}, id="fraction-text"),
    rest("/leases", 400, "'fraction' must be a number, got True", body={"fraction": True}, id="fraction-bool"),
    rest("/leases", 400, "'fraction' must be in (0, 1]", body={"fraction": -0.5}, id="fraction-negative"),
    rest("/leases", 400, "'fraction' must be in (0, 1]", body={"fraction": 0}, id="fraction-zero"),
    rest("/leases", 400, "ask for whole GPUs with 'gpu_count'", body={"fraction": 1.5}, id="fraction-1.5"),
    rest("/leases", 400, "'fraction' must be at least 0.01", body={"fraction": 0.001}, id="fraction-tiny"),
    rest("/leases", 400, "NaN is not a JSON number", raw=b'{"fraction": NaN}', id="fraction-nan"),
    rest("/leases", 400, "Infinity is not a JSON number", raw=b'{"fraction": Infinity}', id="fraction-inf"),
    rest("/leases", 400, "'fraction' must be a number, got inf", raw=b'{"fraction": 1e400}', id="fraction-overflow"),
    rest("/leases", 400, "'gpu_count' must be a whole number from 1 to 64", body={"gpu_count": 0}, id="count-zero"),
    rest("/leases", 400, "'gpu_count' must be a whole number from 1 to 64", body={"gpu_count": -1}, id="count-negative"),
    rest("/leases", 400, "'gpu_count' must be a whole number from 1 to 64", body={"gpu_count": 1.5}, id="count-1.5"),
    # Above the wire's bound of 64 too, the pool's own, lower limit is what a person hears
    rest("/leases", 400, f"{10**30} {BEYOND_NODE}", body={"gpu_count": 10**30}, id="count-huge"),
    rest("/leases", 400, f"99 {BEYOND_NODE}", body={"gpu_count": 99.0, "wait": 60}, id="count-above-the-wire"),
    rest("/leases", 400, "'memory' must be a whole number of bytes", body={"gpu_count": 99, "memory": -1},
         id="count-above-the-wire-bad-memory"),
    rest("/leases", 400, "'gpu_count' must be a number, got '2'", body={"gpu_count": "2"}, id="count-text"),
    rest("/leases", 400, "takes whole GPUs", body={"fraction": 0.5, "gpu_count": 2}, id="count-with-fraction"),
    rest("/leases", 429, "quota exceeded: you hold 0.00 of 1.50 GPU; requested 2.00; ask for at most 1",
         body={"gpu_count": 2}, code="quota_exceeded", id="count-over-quota"),
    # POST /leases: memory, time, names
    rest("/leases", 400, "'memory' must be a whole number of bytes", body={"memory": -1}, id="memory-negative"),
    rest("/leases", 400, "'memory' must be a whole number of bytes", body={"memory": 0}, id="memory-zero"),
    rest("/leases", 400, "'memory' must be a whole number of bytes", body={"memory": 2**60}, id="memory-huge"),
    rest("/leases", 400, "'memory' must be a whole number of bytes", body={"memory": 2**20 + 0.5}, id="memory-part"),
    rest("/leases", 400, "'memory' must be a number, got 'lots'", body={"memory": "lots"}, id="memory-text"),
    # a fraction for bytes or a count: refused, never rounded (2.0 and 1.5e9 are integers)
    rest("/leases", 400, "'host_memory' must be a whole number of bytes", raw=b'{"host_memory": 2147483648.5}',
         id="host-memory-part"),
    rest("/leases", 400, "'gpu_count' must be a whole number from 1 to 64, got 2.5", raw=b'{"gpu_count": 2.5}',
         id="count-part"),
    rest("/leases", 400, "of GPU memory is more than any GPU offers", body={"memory": 2**49}, id="memory-none-fits"),
    rest("/leases", 400, "the pool has no GPU of model H100; its models: NVIDIA A100-SXM4-80GB; ask for one",
         body={"fraction": 0.5, "model": "H100", "wait": 60}, id="model-none-in-pool"),
    rest("/leases", 400, "'idle_timeout' must be seconds from 1 to", body={"idle_timeout": -1}, id="idle-negative"),
    rest("/leases", 400, "'idle_timeout' must be seconds from 1 to", body={"idle_timeout": 0}, id="idle-zero"),
    rest("/leases", 400, "'idle_timeout' must be seconds from 1 to", body={"idle_timeout": 0.001}, id="idle-tiny"),
    rest("/leases", 400, "'idle_timeout' must be seconds from 1 to", body={"idle_timeout": 10**12}, id="idle-huge"),
    rest("/leases", 400, "above your maximum of 1d", body={"idle_timeout": 2 * 86400}, id="idle-over-max"),
    rest("/leases", 400, "'wait' must be seconds in [0,", body={"wait": -1}, id="wait-negative"),
    rest("/leases", 400, "'wait' must be seconds in [0,", body={"wait": 10**12}, id="wait-huge"),
    rest("/leases", 400, "above this pool's maximum of 1h", body={"wait": 7200}, id="wait-over-max"),
    rest("/leases", 400, "'lease_class' must be one of interactive, batch", body={"lease_class": "urgent"},
         id="class-unknown"),
    rest("/leases", 400, "'preemptible' must be true or false", body={"preemptible": "yes"}, id="preemptible-text"),
    rest("/leases", 400, "'model' must be a non-empty string", body={"model": ""}, id="model-empty"),
    rest("/leases", 400, "'model' must be a non-empty string", body={"model": ["A100"]}, id="model-list"),
    rest("/leases", 400, "without control characters", body={"kernel_id": "k\x00"}, id="kernel-id-nul"),
    rest("/leases", 400, "unknown field(s): colour", body={"fraction": 0.5, "colour": "red"}, id="unknown-field"),
    # POST /leases: the body itself
    rest("/leases", 400, "not valid JSON", raw=b'{"fraction": 0.5,', id="malformed-json"),
    rest("/leases", 400, "not valid JSON", raw=b"\xff\xfe", id="not-utf8"),
    rest("/leases", 400, "needs a JSON body", raw=b"", id="empty-body"),
    rest("/leases", 400, "must be a JSON object", body=[0.5], id="array-body"),
    rest("/leases", 400, "must be a JSON object", body=0.5, id="number-body"),
    rest("/leases", 400, "larger than 1048576 bytes", raw=b'{"model": "' + b"x" * 2**20 + b'"}', id="huge-body"),
    rest("/leases", 415, "'Content-Type: application/json'", body={"fraction": 0.25}, content_type="text/plain",
         code="unsupported_media_type", id="text-plain"),
    rest("/leases", 415, "'Content-Type: application/json'", raw=b"fraction=0.25", code="unsupported_media_type",
         content_type="application/x-www-form-urlencoded", id="form-encoded"),
    rest("/leases?active=2", 400, "'active' must be 1, 0, true or false", method="GET", id="list-active-2"),
    # lease ids: unknown, malformed, someone else's (404 alike, so ids cannot be probed)
    rest("/leases/L-000000000000", 404, "lease L-000000000000 not found", method="GET", code="not_found",
         id="get-unknown"),
    rest("/leases/L-000000000000", 404, "not found", method="DELETE", code="not_found", id="delete-unknown"),
    rest("/leases/L-000000000000/heartbeat", 404, "not found", code="not_found", id="heartbeat-unknown"),
    rest("/leases/not-a-lease", 404, "not found", method="GET", code="not_found", id="get-malformed-id"),
    rest("/leases/L-%00", 404, "not found", method="DELETE", code="not_found", id="delete-nul-id"),
    rest("/leases/{bob}", 404, "not found", method="GET", code="not_found", id="get-others"),
    rest("/leases/{bob}", 404, "not found", method="DELETE", code="not_found", id="delete-others"),
    rest("/leases/{bob}/heartbeat", 404, "not found", code="not_found", id="heartbeat-others"),
    rest("/leases?all_users=1", 403, "only pool admins may list every user's leases", method="GET",
         code="forbidden", id="list-all-users-not-admin"),
    rest("/leases?all_users=yes", 400, "'all_users' must be 1, 0, true or false", method="GET", user="boss",
         id="list-all-users-bad"),
    rest("/leases/{bob}?wait=5", 404, "not found", method="GET", code="not_found", id="poll-others"),
    # lease ids: the owner's own, with bad arguments
    rest("/leases/{bob}?wait=-1", 400, "'wait' must be a number of seconds >= 0", method="GET", user="bob",
         id="poll-negative"),
    rest("/leases/{bob}?wait=nan", 400, "'wait' must be a number of seconds >= 0", method="GET", user="bob",
         id="poll-nan"),
    rest("/leases/{bob}?wait=1e999", 400, "'wait' must be a number of seconds >= 0", method="GET", user="bob",
         id="poll-inf"),
    rest("/leases/{bob}?wait=1&state=bogus", 400, "'state' must be one of", method="GET", user="bob",
         id="poll-bad-state"),
    rest("/leases/{bob}?reason=", 400, "'reason' must be 1 to 200 characters", method="DELETE", user="bob",
         id="release-empty-reason"),
    rest(f"/leases/{{bob}}?reason={LONG}", 400, "'reason' must be 1 to 200 characters", method="DELETE", user="bob",
         id="release-long-reason"),
    rest("/leases/{bob}?reason=a%0Ab", 400, "without control characters", method="DELETE", user="bob",
         id="release-newline-reason"),
    rest("/leases/{mine}?reason=%20", 400, "'reason' must be 1 to 200 characters", method="DELETE",
         id="release-ended-blank-reason"),
    rest("/leases/{bob}/heartbeat", 400, "must be a JSON object", body=[1], user="bob", id="heartbeat-array"),
    rest("/leases/{bob}/heartbeat", 400, "not valid JSON", raw=b"{", user="bob", id="heartbeat-malformed"),
    rest("/leases/{bob}/heartbeat", 400, "this request takes no fields; got 'x'", body={"x": 1}, user="bob",
         id="heartbeat-field"),
    rest("/leases/{bob}/park", 400, "this request takes no fields; got 'tier'", body={"tier": "bogus"}, user="bob",
         id="park-field"),
    rest("/leases/{bob}/resume", 400, "a resume takes only 'in_place'; got 'now'", body={"now": True}, user="bob",
         id="resume-field"),
    rest("/leases/{bob}/resume", 400, "'in_place' must be true or false, got 'yes'", body={"in_place": "yes"},
         user="bob", id="resume-in-place-not-bool"),
    # who may call what
    rest("/leases", 401, "missing or unknown token", method="GET", user=None, code="unauthorized", id="no-token"),
    rest("/leases", 401, "missing or unknown token", body={"fraction": 0.25}, user=None, code="unauthorized",
         id="no-token-create"),
    rest("/leases", 401, "missing or unknown token", body={"fraction": 0.25}, user="not-a-token",
         code="unauthorized", id="unknown-token"),
    # with c.GPUPool.api_tokens there is no STATE_DIR/user_token to point at
    rest("/leases", 401, "send 'Authorization: token TOKEN' (a token of the service's c.GPUPool.api_tokens: ask "
         "the pool's admin)", method="GET", user=None, code="unauthorized", id="no-token-says-where-tokens-are"),
    rest("/leases/{bob}", 401, "missing or unknown token", method="DELETE", user=None, code="unauthorized",
         id="no-token-release"),
    rest("/leases", 403, "an agent token cannot call this endpoint", body={"fraction": 0.25}, user="agent",
         code="forbidden", id="agent-creates"),
    rest("/nodes", 403, "only node agents", body={"name": "evil"}, code="forbidden", id="user-registers-node"),
    rest("/nodes/node-1/heartbeat", 403, "only node agents", body={}, code="forbidden", id="user-node-heartbeat"),
    rest("/admin/quotas", 403, "only pool admins", method="GET", code="forbidden", id="user-lists-quotas"),
    rest("/admin/quotas/user:tester", 403, "only pool admins", method="PUT", body={"max_gpus": 8}, code="forbidden",
         id="user-sets-quota"),
    rest("/admin/quotas/user:bob", 403, "only pool admins", method="DELETE", code="forbidden",
         id="user-unsets-quota"),
    rest("/admin/usage", 403, "only pool admins", method="GET", code="forbidden", id="user-reads-usage"),
    # admin input
    rest("/admin/quotas/user:bob", 400, "max_gpus must be a number from 0 to 1,000,000 GPUs (none for unlimited), "
         "got -1", method="PUT", body={"max_gpus": -1}, user="boss", id="quota-negative"),
    rest("/admin/quotas/user:bob", 400, "max_gpus must be a number from 0 to 1,000,000 GPUs", method="PUT",
         raw=b'{"max_gpus": 1e400}', user="boss", id="quota-overflow"),
    rest("/admin/quotas/user:bob", 400, "max_gpus must be a number from 0 to 1,000,000 GPUs (none for unlimited), "
         "got 1e+99", method="PUT", body={"max_gpus": 1e99}, user="boss", id="quota-absurd"),
    rest("/admin/quotas/user:bob", 400, "gpu_hours_per_day must be a number from 0 to 24,000,000 GPU-hours", method="PUT",
         body={"max_gpus": 2, "gpu_hours_per_day": "1e12h"}, user="boss", id="quota-absurd-hours"),
    rest("/admin/quotas/user:bob", 400, "max_idle_timeout must be a number from 0 to 31,622,400 seconds", method="PUT",
         body={"max_idle_timeout": "1000d"}, user="boss", id="quota-absurd-idle"),
    rest("/admin/quotas/user:bob", 400, "max_gpus: must be a number of GPUs", method="PUT", body={"max_gpus": "lots"},
         user="boss", id="quota-text"),
    rest("/admin/quotas/user:bob", 400, "max_idle_timeout: cannot read 'forever' as a duration", method="PUT",
         body={"max_idle_timeout": "forever"}, user="boss", id="quota-idle-text"),
    rest("/admin/quotas/user:bob", 400, "unknown limit(s) frob", method="PUT", body={"frob": 1}, user="boss",
         id="quota-unknown-limit"),
    rest("/admin/quotas/user:bob", 400, "must be a dict of limits", method="PUT", body=[1], user="boss",
         id="quota-array"),
    rest("/admin/quotas/user:bob", 400, "not valid JSON", method="PUT", raw=b"{max_gpus: 1}", user="boss",
         id="quota-malformed"),
    rest("/admin/quotas/user:bob", 400, "nothing to set for user:bob: give at least one limit", method="PUT", body={},
         user="boss", id="quota-empty"),
    rest("/admin/quotas/user:bob", 409, "quota user:bob: guaranteed_gpus 5 is more than its max_gpus 1", method="PUT",
         body={"max_gpus": 1, "guaranteed_gpus": 5}, user="boss", code="invalid_state", id="quota-guarantee-above-max"),
    rest("/admin/quotas/user:bob", 415, "'Content-Type: application/json'", method="PUT", body={"max_gpus": 2},
         content_type="text/plain", code="unsupported_media_type", user="boss", id="quota-text-plain"),
    rest("/admin/quotas/nobody", 400, "must be '*', 'group:NAME' or 'user:NAME'", method="PUT", body={"max_gpus": 1},
         user="boss", id="quota-bad-scope"),
    rest("/admin/quotas/user:a%00b", 400, "must be '*', 'group:NAME' or 'user:NAME'", method="PUT",
         body={"max_gpus": 1}, user="boss", id="quota-nul-scope"),
    rest("/admin/quotas/user:%20bob", 400, "must be '*', 'group:NAME' or 'user:NAME'", method="DELETE",
         user="boss", id="unset-bad-scope"),
    rest("/admin/quotas/user:nobody", 404, "quota override for user:nobody not found", method="DELETE",
         user="boss", code="not_found", id="unset-unknown"),
    rest("/admin/usage?days=0", 400, "'days' must be a whole number from 1 to 92", method="GET", user="boss",
         id="usage-days-zero"),
    rest("/admin/usage?days=-3", 400, "'days' must be a whole number from 1 to 92", method="GET", user="boss",
         id="usage-days-negative"),
    rest("/admin/usage?days=1.5", 400, "'days' must be a whole number from 1 to 92", method="GET", user="boss",
         id="usage-days-part"),
    rest("/admin/usage?days=week", 400, "'days' must be a whole number from 1 to 92", method="GET", user="boss",
         id="usage-days-text"),
    rest("/admin/usage?days=100000", 400, "'days' must be a whole number from 1 to 92", method="GET", user="boss",
         id="usage-days-huge"),
    # odd inputs that must not give 500s: big numbers, deep nesting, lone surrogates, NUL
    rest("/leases", 400, "a number of more than 100 digits", raw=b'{"fraction": 1' + b"0" * 400 + b"}",
         id="fraction-400-digits"),
    rest("/leases", 400, "a number of more than 100 digits", raw=b'{"wait": ' + b"9" * 400 + b"}", id="wait-400-digits"),
    rest("/leases", 400, "'idle_timeout' must be seconds from 1 to", body={"idle_timeout": 10**99}, id="idle-99-digits"),
    rest("/leases", 400, "'memory' must be a whole number of bytes", body={"memory": 10**99}, id="memory-99-digits"),
    rest("/leases", 400, "more than 32 levels deep", raw=b"[" * 200_000 + b"]" * 200_000, id="nested-200000"),
    rest("/leases", 400, "more than 32 levels deep", body={"model": json.loads("[" * 40 + "]" * 40)}, id="nested-40"),
    rest("/leases", 400, "not valid Unicode", raw=b'{"kernel_id": "k\\ud800"}', id="kernel-id-surrogate"),
    rest("/leases", 400, "not valid Unicode", raw=b'{"model": "\\udfffA100"}', id="model-surrogate"),
    rest("/leases", 400, "not valid Unicode", raw=b'{"server_name": "\\ud83d"}', id="server-name-surrogate"),
    rest("/leases", 400, "not valid Unicode", raw=b'{"\\ud800": 1}', id="key-surrogate"),
    rest("/admin/quotas/user:bob", 400, "a number of more than 100 digits", method="PUT",
         raw=b'{"max_gpus": 1' + b"0" * 400 + b"}", user="boss", id="quota-400-digits"),
    rest("/admin/quotas/user:bob", 400, "not valid Unicode", method="PUT", raw=b'{"max_gpus": "\\ud800"}',
         user="boss", id="quota-surrogate"),
    rest("/nodes", 400, "memory_total must be bytes in (0, 2**50]", user="agent",
         body={"name": "node-evil", "url": "http://127.0.0.1:9", "inventory": "simulated",
               "gpus": [{"uuid": "GPU-evil", "name": "A100", "index": 0, "memory_total": 2**70}]},
         id="agent-memory-total-2**70"),
    rest("/nodes", 400, "'index' must be a whole number from 0 to 1023", user="agent",
         body={"name": "node-evil", "url": "http://127.0.0.1:9", "inventory": "simulated",
               "gpus": [{"uuid": "GPU-evil", "name": "A100", "index": 2**40, "memory_total": 2**30}]},
         id="agent-index-huge"),
    rest("/nodes", 400, "'memory_total' must be whole bytes", user="agent",
         body={"name": "node-evil", "url": "http://127.0.0.1:9", "inventory": "simulated",
               "gpus": [{"uuid": "GPU-evil", "name": "A100", "index": 0, "memory_total": 8.5e10 + 0.5}]},
         id="agent-memory-total-part"),
    rest("/nodes", 400, "'healthy' must be true or false", user="agent",
         body={"name": "node-evil", "url": "http://127.0.0.1:9", "inventory": "simulated",
               "gpus": [{"uuid": "GPU-evil", "name": "A100", "index": 0, "memory_total": 2**30, "healthy": "no"}]},
         id="agent-healthy-text"),
    rest("/nodes", 400, "'whole_gpus' must be true or false", user="agent",
         body={"name": "node-evil", "url": "http://127.0.0.1:9", "inventory": "simulated", "whole_gpus": 1,
               "gpus": []}, id="agent-whole-gpus-number"),
    rest("/nodes", 400, "'name' must be a node name", user="agent",
         body={"name": "node\x00evil", "url": "http://127.0.0.1:9", "inventory": "simulated", "gpus": []},
         id="agent-node-name-nul"),
    rest("/nodes", 400, "'url' must be the agent's http(s) URL", user="agent",
         body={"name": "node-evil", "url": "http://[::1", "inventory": "simulated", "gpus": []}, id="agent-url-ipv6"),
    rest("/nodes/node-1/heartbeat", 400, "'memory_used' must be a whole number of bytes", user="agent",
         body={"gpus": [{"uuid": "GPU-x", "memory_used": 2**70}]}, id="agent-memory-used-2**70"),
    rest("/nodes/node-1/heartbeat", 400, "each worker report needs a 'lease_id'", user="agent",
         body={"workers": [{"lease_id": "L-\x00", "execution_state": "idle"}]}, id="agent-report-nul-id"),
    rest("/nodes/no%00de/heartbeat", 404, "not found", user="agent", body={}, code="not_found",
         id="agent-heartbeat-nul-name"),
    # no such thing
    rest("/leases", 405, "method not allowed", method="PATCH", body={}, code="method_not_allowed", id="patch"),
    rest("/frobnicate", 404, "no such endpoint: /api/v1/frobnicate", method="GET", code="not_found", id="no-route"),
]


def call(pool: Pool, method: str, path: str, *, body: Any = None, raw: bytes | None = None,
         user: str | None = "tester", content_type: str = "application/json") -> tuple[int, dict[str, str], Any]:
    """One raw request; returns ``(status, headers, decoded JSON)``."""
    path = path.replace("{bob}", pool.bob_lease).replace("{mine}", pool.tester_lease)
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{pool.service.url}/api/v1{path}", data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", content_type)
    token = pool.token(user)
    if token:
        request.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, headers, text = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            status, headers, text = exc.code, dict(exc.headers), exc.read()
    return status, headers, json.loads(text)


@pytest.mark.parametrize("path", ["/", "/admin"])
def test_the_root_and_admin_say_where_the_api_and_the_admin_page_are(pool, path):
    """A person opening the standalone service in a browser gets a 404 that points on."""
    try:
        urllib.request.urlopen(f"{pool.service.url}{path}", timeout=30)
    except urllib.error.HTTPError as exc:
        with exc:
            reply = json.loads(exc.read())
        assert exc.code == 404 and reply["error"] == "not_found", reply
        assert "the REST API is under /api/v1/" in reply["message"], reply
        assert "the admin page is served only under JupyterHub" in reply["message"], reply
    else:
        pytest.fail(f"{path} answered 200")


@pytest.mark.parametrize("method, path, body, raw, user, content_type, status, code, words", REST)
def test_rest(pool, method, path, body, raw, user, content_type, status, code, words):
    got, headers, reply = call(pool, method, path, body=body, raw=raw, user=user, content_type=content_type)
    assert (got, reply.get("error")) == (status, code), reply
    assert headers.get("Content-Type") == "application/json"
    assert_clear(reply["message"], words)
    pool.check_unchanged(f"{method} {path}")


def test_a_405_says_what_is_allowed(pool):
    status, headers, _ = call(pool, "PUT", "/leases/{bob}", body={}, user="bob")
    assert status == 405 and headers.get("Allow") == "GET, DELETE"
    pool.check_unchanged("PUT /leases/{id}")


def test_someone_elses_lease_answers_as_one_that_never_was(pool):
    """The 404 for bob's lease and for an id never issued differ only in the id,
    so a user cannot tell which ids exist."""
    for method, suffix in (("GET", ""), ("DELETE", ""), ("POST", "/heartbeat")):
        theirs = call(pool, method, f"/leases/{{bob}}{suffix}")
        never = call(pool, method, f"/leases/L-000000000000{suffix}")
        assert theirs[0] == never[0] == 404
        assert json.dumps(theirs[2]).replace(pool.bob_lease, "ID") == json.dumps(never[2]).replace("L-000000000000", "ID")
    pool.check_unchanged("probing another user's lease")


# -- the gpupool command -----------------------------------------------------------------------------------

def cli(args: str, code: int, words: str, *, user: str | None = "tester", id: str):
    """One row of the CLI table: ``gpupool ARGS`` as ``user`` (its token in
    ``GPUPOOL_TOKEN``), the exit code and words on stderr."""
    return pytest.param(args, user, code, words, id=id)


CLI = [
    cli("frobnicate", 2, "unknown command 'frobnicate'", id="unknown-command"),
    cli("", 2, "gpupool: a command is required\n\nusage: gpupool COMMAND", id="no-command"),
    cli("status --colour", 2, "unrecognized arguments: --colour", id="unknown-option"),
    cli("status", 1, "refused the call: the token sent is not one it knows; pass --token-file FILE or set "
        "GPUPOOL_TOKEN (in a JupyterHub server, JUPYTERHUB_API_TOKEN) to your token", user="not-a-token",
        id="unknown-token"),
    cli("status --token-file /nonexistent/token", 2, "cannot read the token file", id="missing-token-file"),
    cli("status --url not-a-url", 1, "is not a service URL", id="bad-url"),
    cli("status --url 127.0.0.1:8765", 1, "'127.0.0.1:8765' is not a service URL", id="url-without-scheme"),
    cli("status --url ftp://x", 1, "'ftp://x' is not a service URL", id="url-not-http"),
    cli("status --url http://127.0.0.1:{dead}", 1, "cannot reach the gpupool service", id="nothing-listens"),
    cli("quota frob", 2, "invalid choice: 'frob'", id="unknown-action"),
    cli("quota set", 2, "'set' needs a SCOPE", user="boss", id="set-no-scope"),
    cli("quota set user:bob", 2, "'set' needs at least one LIMIT=VALUE", user="boss", id="set-no-limits"),
    cli("quota set user:bob max_gpus=2", 1, "only pool admins", id="set-as-user"),
    cli("quota list", 1, "only pool admins", id="list-as-user"),
    cli("quota set user:bob max_gpus=-1", 1, "max_gpus must be a number from 0 to 1,000,000 GPUs (none for "
        "unlimited), got -1\n", user="boss", id="set-negative"),  # as typed, not -1.0
    cli("quota set user:bob max_gpus=1e99", 1, "max_gpus must be a number from 0 to 1,000,000 GPUs (none for "
        "unlimited), got 1e+99\n", user="boss", id="set-absurd"),
    cli("quota set user:bob max_gpus=2 gpu_hours_per_week=1e12", 1, "gpu_hours_per_week must be a number from 0 to "
        "168,000,000 GPU-hours", user="boss", id="set-absurd-hours"),
    cli("quota set user:bob max_gpus=lots", 1, "or none (null in JSON) for unlimited", user="boss", id="set-text"),
    cli("quota set user:bob max_idle_timeout=0", 1, "more than 0 seconds", user="boss", id="set-idle-zero"),
    cli("quota set user:bob frob=1", 1, "cannot read 'frob=1'", user="boss", id="set-unknown-limit"),
    cli("quota set user:bob max_gpus", 1, "cannot read 'max_gpus'", user="boss", id="set-no-value"),
    cli("quota set user:bob max_gpus=2 max_gpus=3", 1, "max_gpus is given twice (2 and '3')", user="boss",
        id="set-twice"),
    cli("quota set nobody max_gpus=1", 1, "must be '*', 'group:NAME' or 'user:NAME'", user="boss", id="set-bad-scope"),
    cli("quota unset user:nobody", 1, "quota override for user:nobody not found", user="boss", id="unset-unknown"),
    cli("quota show user:bob", 2, "'show' takes no arguments: unrecognized arguments: user:bob", user="boss",
        id="show-scope"),
    cli("quota list extra", 2, "'list' takes no arguments: unrecognized arguments: extra", user="boss",
        id="list-extra"),
    cli("quota usage user:bob", 2, "'usage' takes no arguments: unrecognized arguments: user:bob", user="boss",
        id="usage-scope"),
    cli("quota unset user:bob max_gpus=2", 2, "'unset' takes a SCOPE only: unrecognized arguments: max_gpus=2",
        user="boss", id="unset-limits"),
    cli("quota set * max_gpus=nan", 1, "max_gpus must be a number from 0 to 1,000,000 GPUs (none for unlimited), "
        "got 'nan'", user="boss", id="set-nan"),
    cli("quota set user:bob gpu_hours_per_day=inf", 1, "gpu_hours_per_day must be a number from 0 to 24,000,000 "
        "GPU-hours (none for unlimited), got 'inf'", user="boss", id="set-inf"),
    cli("health notaurl", 2, "'notaurl' is not a URL; it should look like http://HOST:PORT/health",
        id="health-not-a-url"),
    cli("quota usage --days 0", 2, "--days must be a whole number from 1 to 92, got 0", user="boss", id="usage-zero"),
    cli("quota usage --days many", 2, "invalid int value: 'many'", user="boss", id="usage-text"),
    cli("quota show --days -3", 2, "--days must be a whole number from 1 to 92, got -3", id="show-days-negative"),
    cli("quota --days 93", 2, "--days must be a whole number from 1 to 92, got 93", id="show-days-huge"),
    cli("agent --service-url http://127.0.0.1:{dead} --warm-workers=-1", 1,
        "c.AgentWorkers.warm_workers must be 0 or more, got -1", id="agent-warm-negative"),
    cli("run", 2, "the following arguments are required: script", id="run-no-script"),
    cli("run --gpus 0 {script}", 2, "GPU amount must be more than 0", id="run-gpus-zero"),
    cli("run --gpus 1.5 {script}", 2, "is above 1 but not whole", id="run-gpus-1.5"),
    cli("run --memory lots {script}", 2, "--memory: cannot read 'lots' as a memory size", id="run-memory-text"),
    cli("run --wait forever {script}", 2, "--wait: cannot read 'forever' as a duration", id="run-wait-text"),
    cli("run --cpus 0 {script}", 2, "--cpus must be more than 0 cores", id="run-cpus-zero"),
    cli("run --wait -1m {script}", 2, "duration must be more than 0 seconds, got '-1m'", id="run-wait-negative"),
    cli("run --gpus 1 --bogus {script}", 2, "unrecognized arguments: --bogus", id="run-unknown-option"),
    cli("run /nonexistent/job.py", 2, "cannot read the script /nonexistent/job.py", id="run-no-such-script"),
    cli("run --gpus 2 {script}", 2, "quota exceeded: you hold 0.00 of 1.50 GPU; requested 2.00; ask for at most 1",
        id="run-over-quota"),
    cli("run --gpus 99 {script}", 2, f"99 {BEYOND_NODE}", id="run-gpus-huge"),
    cli("run --gpus 3 {script}", 2, f"3 {BEYOND_NODE}", id="run-gpus-over-the-biggest-node-and-quota"),
    cli("run --gpus 0.001 {script}", 2, "a slice is at least 0.01 of a GPU", id="run-gpus-tiny"),
    cli("run --memory 400GiB {script}", 2, "of GPU memory is more than any GPU offers", id="run-none-fits"),
    cli("run --gpus 0.5 --model H100 {script}", 2, "the pool has no GPU of model H100; its models: NVIDIA "
        "A100-SXM4-80GB", id="run-model-none-in-pool"),
    cli("run --env nope {script}", 2, "gpupool pool lists them per node", id="run-unknown-env"),
    cli("run --host-memory 1 {script}", 2, "--host-memory of 1 byte is below the minimum of 1 MiB (1048576 bytes)",
        id="run-host-memory-tiny"),
    cli("run --wait 400d {script}", 2, "--wait must be seconds in [0, 31622400]", id="run-wait-huge"),
    cli("run --url http://127.0.0.1:{dead} {script}", 2, "cannot reach the gpupool service", id="run-nothing-listens"),
]


@pytest.mark.parametrize("args, user, code, words", CLI)
def test_cli(pool, args, user, code, words, tmp_path):
    env = {**os.environ, "GPUPOOL_URL": pool.service.url, "GPUPOOL_TOKEN": pool.token(user) or ""}
    script = tmp_path / "job.py"  # `gpupool run`'s: refused before it runs
    script.write_text("raise SystemExit('this script must not run')\n")
    argv = [str(GPUPOOL), *args.replace("{dead}", str(free_port())).replace("{script}", str(script)).split()]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == code, done.stderr
    assert_clear(done.stderr, words)
    assert not any(f"'{field}'" in done.stderr for field in FIELD_OPTIONS), done.stderr  # the option, not the field
    assert "Traceback" not in done.stdout
    if args.startswith("run"):  # README: "2 with one line when gpupool could not run it"
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    pool.check_unchanged(f"gpupool {args}")


@pytest.mark.parametrize("path, answered", [("", "HTTP 404 Not Found"), ("/page", "HTTP 200, not JSON")])
def test_a_url_that_is_not_a_gpupool_service_says_so(pool, shell, path, answered):
    """A plausible wrong URL (JupyterHub's own, whose 404 is ``{"status": 404, "message": null}``,
    or a web page) is named in one line, by the command and by %gpu, not a traceback."""
    from IPython.core.error import UsageError

    from otherserver import not_gpupool

    with not_gpupool() as other:
        url = other + path
        words = f"{url} is not a gpupool service ({answered}): check the URL (GPUPOOL_URL or --url)"
        env = {**os.environ, "GPUPOOL_TOKEN": pool.service.user_token}
        for command in (["status", "--url", url], ["quota", "--url", url]):
            done = subprocess.run([str(GPUPOOL), *command], env=env, capture_output=True, text=True, timeout=60)
            assert (done.returncode, done.stderr) == (1, f"gpupool {command[0]}: {words}\n"), done.stderr
        service = shell.magics_manager.registry["GPUMagics"].service
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("GPUPOOL_URL", url)
            patch.setattr(service, "_client", None)  # made again from GPUPOOL_URL
            with pytest.raises(UsageError) as raised:
                shell.run_line_magic("gpu", "status")
        # A magic takes no --url: the notebook's words name the variable the kernelspec sets.
        assert words.replace("GPUPOOL_URL or --url", "GPUPOOL_URL, which the gpupool kernelspec sets") \
            in str(raised.value)
    assert shell.magics_manager.registry["GPUMagics"].service.client.url == pool.service.url
    pool.check_unchanged(f"a URL that is not gpupool's ({answered})")


@pytest.mark.parametrize("token, sent", [(None, "no token was sent"),
                                         ("not-a-token", "the token sent is not one it knows")])
def test_the_cli_refused_for_its_token_names_its_own_options(pool, token, sent):
    """A command-line user is told the options that pass a token, not the header an API caller
    sends; and a service with ``c.GPUPool.api_tokens`` has no ``user_token`` file to point at."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPUPOOL_URL", "GPUPOOL_TOKEN", "JUPYTERHUB_API_TOKEN")}
    env.update({"GPUPOOL_TOKEN": token} if token else {})
    done = subprocess.run([str(GPUPOOL), "status", "--url", pool.service.url], env=env, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr
    assert done.stderr == (f"gpupool status: the gpupool service at {pool.service.url} refused the call: {sent}; "
                           "pass --token-file FILE or set GPUPOOL_TOKEN (in a JupyterHub server, JUPYTERHUB_API_TOKEN) "
                           "to your token (a token of the service's c.GPUPool.api_tokens: ask the pool's admin)\n")
    pool.check_unchanged(f"gpupool status with token {token}")


@pytest.mark.parametrize("command", ["status", "pool", "quota"])
def test_the_cli_in_a_jupyterhub_terminal_sends_the_hub_token(pool, command):
    """A single-user server's terminal has GPUPOOL_URL and JUPYTERHUB_API_TOKEN, no GPUPOOL_TOKEN:
    each command sends that token, as a kernel does (here a token the standalone service knows),
    and its help says so. GPUPOOL_TOKEN, where set, still wins."""
    env = {k: v for k, v in os.environ.items() if k != "GPUPOOL_TOKEN"}
    env.update(GPUPOOL_URL=pool.service.url, JUPYTERHUB_API_TOKEN=pool.token("bob"))
    done = subprocess.run([str(GPUPOOL), command, "--json"], env=env, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    if command == "status":
        assert pool.bob_lease in done.stdout
    wrong = subprocess.run([str(GPUPOOL), command], env={**env, "GPUPOOL_TOKEN": "not-a-token"}, capture_output=True,
                           text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert "the token sent is not one it knows" in wrong.stderr, wrong.stderr
    helped = subprocess.run([str(GPUPOOL), command, "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert "JUPYTERHUB_API_TOKEN" in helped.stdout, helped.stdout
    pool.check_unchanged(f"gpupool {command} with JUPYTERHUB_API_TOKEN")


def test_status_without_leases_says_they_are_yours(pool):
    """``gpupool status`` lists the caller's leases while the pool table counts everyone's:
    with none of theirs it says whose, so bob's lease on the GPU is not read as a contradiction."""
    def status(user: str, *args: str) -> str:
        env = {**os.environ, "GPUPOOL_URL": pool.service.url, "GPUPOOL_TOKEN": pool.token(user)}
        done = subprocess.run([str(GPUPOOL), "status", *args], env=env, capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr
        return done.stdout

    tester = status("tester")  # tester's one lease ended; bob's holds half a GPU
    assert tester.rstrip().endswith("you hold no leases (this lists your own; the pool table above counts everyone's)")
    assert pool.tester_lease in status("tester", "--all")
    assert status("boss", "--all").rstrip().endswith("you have no leases, active or ended (this lists your own; "
                                                    "the pool table above counts everyone's)")
    pool.check_unchanged("gpupool status")


def test_an_admin_lists_every_users_leases_with_their_owners(pool):
    """``gpupool status --all-users`` (``GET /leases?all_users=1``): an admin sees bob's lease and
    whose it is; the others' listing stays their own, and a user who asks gets 403 and nothing."""
    def status(user: str, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "GPUPOOL_URL": pool.service.url, "GPUPOOL_TOKEN": pool.token(user)}
        return subprocess.run([str(GPUPOOL), "status", *args], env=env, capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)

    shown = status("boss", "--all-users")
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[1]: line.split()[0] for line in shown.stdout.splitlines() if " L-" in line}
    assert rows == {pool.bob_lease: "bob"}, shown.stdout  # active only: tester's ended lease is left out
    everything = status("boss", "--all-users", "--all").stdout
    assert pool.bob_lease in everything and pool.tester_lease in everything
    assert status("boss").stdout.rstrip().endswith("you hold no leases (this lists your own; the pool table above "
                                                    "counts everyone's)")
    refused = status("bob", "--all-users")
    assert refused.returncode != 0 and "only pool admins may list every user's leases" in refused.stderr, refused
    assert pool.bob_lease not in refused.stdout
    pool.check_unchanged("gpupool status --all-users")


# -- the %gpu magics ---------------------------------------------------------------------------------------

MAGICS = [
    pytest.param("acquire", "say how much: %gpu acquire 0.5 (a share of one GPU)", id="no-amount"),
    pytest.param("acquire --wait 5m", "say how much: %gpu acquire 0.5", id="no-amount-options"),
    pytest.param("acquire half", "cannot read 'half' as a GPU amount", id="amount-text"),
    pytest.param("acquire -0.5", "GPU amount must be more than 0", id="amount-negative"),
    pytest.param("acquire 0", "GPU amount must be more than 0", id="amount-zero"),
    pytest.param("acquire 1.5", "is above 1 but not whole", id="amount-1.5"),
    pytest.param("acquire nan", "GPU amount must be a finite number, got 'nan'", id="amount-nan"),
    pytest.param("acquire inf", "GPU amount must be a finite number, got 'inf'", id="amount-inf"),
    pytest.param("acquire 65", f"65 {BEYOND_NODE}", id="amount-huge"),
    pytest.param("acquire 1e9", f"1000000000 {BEYOND_NODE}", id="amount-1e9"),
    pytest.param("acquire 3", f"3 {BEYOND_NODE}", id="amount-over-the-biggest-node-and-quota"),
    pytest.param("acquire 0.0000001", "a slice is at least 0.01 of a GPU", id="amount-tiny"),
    pytest.param("acquire 2", "quota exceeded: you hold 0.00 of 1.50 GPU; requested 2.00; ask for at most 1",
                 id="amount-over-quota"),
    pytest.param("acquire 0.5 --memory lots", "--memory: cannot read 'lots' as a memory size", id="memory-text"),
    pytest.param("acquire 0.5 --memory 0", "--memory: memory size must be at least 1 byte", id="memory-zero"),
    pytest.param("acquire 0.5 --memory 2000TiB", "--memory must be a whole number of bytes", id="memory-huge"),
    # The option as typed leads what cannot be read, --memory and --host-memory told apart (not 'host_memory')
    pytest.param("acquire 0.5 --host-memory lots", "--host-memory: cannot read 'lots' as a memory size",
                 id="host-memory-text"),
    pytest.param("acquire 0.5 --host-memory 1", "--host-memory of 1 byte is below the minimum of 1 MiB "
                 "(1048576 bytes)", id="host-memory-tiny"),
    pytest.param("acquire 0.5 --cpus 99999", "--cpus must be host cores from 0.01 to 4096", id="cpus-huge"),
    pytest.param("acquire 0.5 --memory 400GiB", "of GPU memory is more than any GPU offers", id="memory-none-fits"),
    pytest.param("acquire 0.5 --model H100 --wait 5m", "the pool has no GPU of model H100; its models: NVIDIA "
                 "A100-SXM4-80GB", id="model-none-in-pool"),
    pytest.param("acquire 0.5 --idle-timeout forever", "--idle-timeout: cannot read 'forever' as a duration", id="idle-text"),
    pytest.param("acquire 0.5 --idle-timeout 0", "--idle-timeout: duration must be more than 0 seconds", id="idle-zero"),
    pytest.param("acquire 0.5 --idle-timeout 2d", "above your maximum of 1d", id="idle-over-max"),
    pytest.param("acquire 0.5 --wait 2h", "above this pool's maximum of 1h", id="wait-over-max"),
    pytest.param("acquire 0.5 --wait -5m", "--wait: duration must be more than 0 seconds, got '-5m'", id="wait-negative"),
    pytest.param("acquire 0.5 --memory -5GiB", "--memory: memory size must be at least 1 byte", id="memory-negative"),
    pytest.param("acquire 0.5 --colour red", "unrecognized arguments: --colour red", id="unknown-option"),
    pytest.param("acquire 0.5 --on-idle sleep", "invalid choice: 'sleep'", id="on-idle-choice"),
    pytest.param("acquire 0.5 --memory '20GiB", "--memory: cannot read \"acquire 0.5 --memory '20GiB\": a quote in it "
                 "is not closed", id="quote-unclosed"),
    pytest.param("acquire 0.5 --memory '400 GiB'", "of GPU memory is more than any GPU offers", id="memory-quoted"),
    pytest.param("frobnicate", "unknown %gpu command 'frobnicate'", id="unknown-command"),
    pytest.param("release", "not attached to a GPU", id="release-detached"),
    pytest.param("pull model", "not attached to a GPU", id="pull-detached"),
    pytest.param("push", "needs variable names", id="push-nothing"),
    pytest.param("push nosuchvar", "not attached to a GPU; run %gpu acquire 0.5 first", id="push-detached"),
    pytest.param("status now", "takes no arguments", id="status-argument"),
    pytest.param("quota set user:bob max_gpus=2", "gpupool quota set", id="quota-set"),
    pytest.param("pool nodes", "takes no arguments", id="pool-argument"),
]


@pytest.fixture(scope="module")
def shell(pool):
    """A real IPython shell with the extension loaded, its client pointed at the pool as tester."""
    from IPython.testing import globalipapp

    with pytest.MonkeyPatch.context() as env:
        env.setenv("GPUPOOL_URL", pool.service.url)
        env.setenv("GPUPOOL_TOKEN", pool.service.user_token)
        env.delenv("GPUPOOL_KERNEL_ID", raising=False)
        ip = globalipapp.get_ipython()  # the module's: once started, the one shell's
        ip.run_line_magic("load_ext", "gpupool.magics")
        yield ip
        ip.run_line_magic("unload_ext", "gpupool.magics")


@pytest.mark.parametrize("line, words", MAGICS)
def test_magic(pool, shell, line, words):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError) as raised:
        shell.run_line_magic("gpu", line)
    assert_clear(str(raised.value), words)
    assert not any(f"'{field}'" in str(raised.value) for field in FIELD_OPTIONS), raised.value  # the option, not the field
    assert shell.magics_manager.registry["GPUMagics"].attachment is None
    pool.check_unchanged(f"%gpu {line}")


def test_cell_magic_with_a_bad_amount_runs_nothing(pool, shell):
    from IPython.core.error import UsageError

    shell.user_ns.pop("ran", None)
    with pytest.raises(UsageError) as raised:
        shell.run_cell_magic("gpu", "1.5", "ran = True\n")
    assert_clear(str(raised.value), "is above 1 but not whole")
    assert "ran" not in shell.user_ns
    pool.check_unchanged("%%gpu 1.5")
