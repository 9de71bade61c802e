"""Quotas: resolution and refusals (pure, table-driven), then through a real
service: the exact refusal words, run-time overrides that survive a
restart, the admin scope, and ``gpupool quota``."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
from procs import start_service
from service_api import assert_error, http, register, silent_listener

from gpupool.errors import GPUPoolError
from gpupool.hub_plugin.rules.quotas import Limits, check, merge, parse_entry, parse_table, resolve
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest

TABLE = parse_table({
    "*": {"max_gpus": 1, "gpu_hours_per_day": 8, "max_idle_timeout": "1h"},
    "group:quants": {"max_gpus": 4, "gpu_hours_per_week": "40h"},
    "group:interns": {"max_gpus": 0.5, "gpu_hours_per_week": 10},
    "group:research": {"gpu_hours_per_day": None},
    "user:ann": {"max_gpus": 0.25, "max_lease_gpus": 0.25},
})


@pytest.mark.parametrize("user, groups, expected", [
    pytest.param("zed", (), Limits(1.0, None, 8.0, None, 3600.0), id="default only"),
    pytest.param("zed", ("nobody-configured",), Limits(1.0, None, 8.0, None, 3600.0), id="unknown group: default"),
    pytest.param("bob", ("quants",), Limits(4.0, None, 8.0, 40.0, 3600.0), id="group over default"),
    pytest.param("bob", ("interns", "quants"), Limits(4.0, None, 8.0, 40.0, 3600.0), id="most generous group wins"),
    pytest.param("bob", ("research",), Limits(1.0, None, None, None, 3600.0), id="unlimited is most generous"),
    pytest.param("bob", ("interns", "research"), Limits(0.5, None, None, 10.0, 3600.0), id="per limit, not per group"),
    pytest.param("ann", ("quants",), Limits(0.25, 0.25, 8.0, 40.0, 3600.0), id="user over group"),
])
def test_resolution(user, groups, expected):
    assert resolve(user, groups, TABLE, max_idle_timeout=86400.0) == expected


def test_without_quotas_nothing_is_limited_but_the_pool_idle_maximum():
    assert resolve("ann", ("quants",), {}, max_idle_timeout=7200.0) == Limits(max_idle_timeout=7200.0)


def test_overrides_merge_limit_by_limit():
    table = merge(TABLE, {"user:ann": {"max_gpus": 2.0}, "group:new": {"max_gpus": 3.0}})
    assert table["user:ann"] == {"max_gpus": 2.0, "max_lease_gpus": 0.25}
    assert resolve("ann", ("new",), table).max_gpus == 2.0
    assert resolve("bob", ("new",), table).max_gpus == 3.0
    assert TABLE["user:ann"]["max_gpus"] == 0.25  # the configured table is left as it was


@pytest.mark.parametrize("entry, expected", [
    ({"gpu_hours_per_day": "90m"}, {"gpu_hours_per_day": 1.5}),
    ({"gpu_hours_per_week": "2"}, {"gpu_hours_per_week": 2.0}),
    ({"max_idle_timeout": "30m"}, {"max_idle_timeout": 1800.0}),
    ({"max_gpus": "0.5", "max_lease_gpus": None}, {"max_gpus": 0.5, "max_lease_gpus": None}),
    ({"guaranteed_gpus": "1.5"}, {"guaranteed_gpus": 1.5}),
    # The ceilings themselves are limits like any other.
    ({"max_gpus": 1_000_000, "gpu_hours_per_week": 168e6, "max_idle_timeout": "366d", "max_parked_memory": "1PiB"},
     {"max_gpus": 1e6, "gpu_hours_per_week": 168e6, "max_idle_timeout": 366 * 86400.0, "max_parked_memory": 2**50}),
])
def test_human_units(entry, expected):
    assert parse_entry(entry) == expected


@pytest.mark.parametrize("table, words", [
    ({"ann": {}}, "must be '*', 'group:NAME' or 'user:NAME'"),
    ({"*": {"max_gpu": 1}}, "unknown limit(s) max_gpu"),
    ({"*": {"max_gpus": -1}}, "max_gpus must be a number from 0 to 1,000,000 GPUs (none for unlimited), got -1"),
    ({"*": {"guaranteed_gpus": -0.5}}, "guaranteed_gpus must be a number from 0 to 1,000,000 GPUs"),
    # Absurd values are typos, refused rather than stored (none is unlimited): each limit has a ceiling.
    ({"*": {"max_gpus": 1e99}}, "max_gpus must be a number from 0 to 1,000,000 GPUs (none for unlimited), got 1e+99"),
    ({"*": {"max_lease_gpus": 1_000_001}}, "max_lease_gpus must be a number from 0 to 1,000,000 GPUs"),
    ({"*": {"guaranteed_gpus": "2e6"}}, "guaranteed_gpus must be a number from 0 to 1,000,000 GPUs"),
    ({"*": {"gpu_hours_per_day": 1e99}}, "gpu_hours_per_day must be a number from 0 to 24,000,000 GPU-hours"),
    ({"*": {"gpu_hours_per_week": "1e12h"}}, "gpu_hours_per_week must be a number from 0 to 168,000,000 GPU-hours"),
    ({"*": {"max_idle_timeout": "400d"}}, "max_idle_timeout must be a number from 0 to 31,622,400 seconds (366 days)"),
    ({"*": {"max_idle_timeout": 1e99}}, "max_idle_timeout must be a number from 0 to 31,622,400 seconds"),
    ({"*": {"max_parked_memory": "2PiB"}}, "max_parked_memory must be a number from 0 to 1,125,899,906,842,624 bytes"),
    ({"*": {"max_gpus": True}}, "must be a number"),
    ({"*": {"max_idle_timeout": "soon"}}, "cannot read 'soon' as a duration"),
    ({"*": 3}, "must be a dict of limits"),
])
def test_bad_tables_are_refused_with_words(table, words):
    with pytest.raises(ValueError) as error:
        parse_table(table)
    assert words in str(error.value)


REFUSALS = [
    pytest.param(Limits(max_gpus=1.0), dict(holding=0.75, requested=0.5), "max_gpus",
                 "quota exceeded: you hold 0.75 of 1.00 GPU; requested 0.50; ask for at most 0.25", id="concurrent GPUs"),
    # What still fits, as %gpu acquire takes it: a slice, rounded down; whole GPUs; within max_lease_gpus
    pytest.param(Limits(max_gpus=0.5), dict(requested=0.75), "max_gpus",
                 "quota exceeded: you hold 0.00 of 0.50 GPU; requested 0.75; ask for at most 0.50", id="a slice fits"),
    pytest.param(Limits(max_gpus=1.0), dict(holding=0.125, requested=1.0), "max_gpus",
                 "quota exceeded: you hold 0.12 of 1.00 GPU; requested 1.00; ask for at most 0.87", id="rounded down"),
    pytest.param(Limits(max_gpus=1.0), dict(holding=0.1 + 0.2, requested=1.0), "max_gpus",
                 "quota exceeded: you hold 0.30 of 1.00 GPU; requested 1.00; ask for at most 0.70", id="float sums"),
    pytest.param(Limits(max_gpus=4.0), dict(holding=1.5, requested=4.0), "max_gpus",
                 "quota exceeded: you hold 1.50 of 4.00 GPU; requested 4.00; ask for at most 2", id="whole GPUs fit"),
    pytest.param(Limits(max_gpus=4.0, max_lease_gpus=0.5), dict(holding=1.0, requested=0.5 + 3), "max_lease_gpus",
                 "lease too large: at most 0.50 GPU per lease; requested 3.50", id="one lease first"),
    pytest.param(Limits(max_gpus=4.0, max_lease_gpus=2.0), dict(holding=3.0, requested=2.0), "max_gpus",
                 "quota exceeded: you hold 3.00 of 4.00 GPU; requested 2.00; ask for at most 1", id="the room, not the lease"),
    pytest.param(Limits(max_gpus=1.0), dict(holding=1.0, requested=0.1), "max_gpus",
                 "quota exceeded: you hold 1.00 of 1.00 GPU; requested 0.10; nothing more fits: release a lease or "
                 "cancel a queued request first (gpupool status lists them)", id="nothing fits"),
    pytest.param(Limits(max_gpus=1.0), dict(holding=0.995, requested=0.1), "max_gpus",
                 "quota exceeded: you hold 0.99 of 1.00 GPU; requested 0.10; nothing more fits: release a lease or "
                 "cancel a queued request first (gpupool status lists them)", id="less than the smallest slice"),
    pytest.param(Limits(max_gpus=0.0), dict(requested=0.1), "max_gpus",
                 "quota exceeded: your quota allows no GPUs (max_gpus 0); requested 0.10; ask the pool's admin to "
                 "raise your max_gpus (gpupool quota shows your limits)", id="a quota of none, nothing held"),
    pytest.param(Limits(max_gpus=0.005), dict(requested=0.5), "max_gpus",
                 "quota exceeded: your quota allows no GPUs (max_gpus 0.005); requested 0.50; ask the pool's admin "
                 "to raise your max_gpus (gpupool quota shows your limits)", id="a quota below the smallest slice"),
    pytest.param(Limits(max_lease_gpus=1.0), dict(requested=2.0), "max_lease_gpus",
                 "lease too large: at most 1.00 GPU per lease; requested 2.00", id="one lease"),
    pytest.param(Limits(gpu_hours_per_day=8.0), dict(used_today_s=8 * 3600), "gpu_hours_per_day",
                 "daily GPU-hours used up (8.0 of 8.0); resets 00:00 UTC", id="day"),
    pytest.param(Limits(gpu_hours_per_day=8.0), dict(used_today_s=9 * 3600), "gpu_hours_per_day",
                 "daily GPU-hours used up (9.0 of 8.0); resets 00:00 UTC", id="day, overrun by a running lease"),
    pytest.param(Limits(gpu_hours_per_day=0.05), dict(used_today_s=0.104 * 3600), "gpu_hours_per_day",
                 "daily GPU-hours used up (0.104 of 0.05); resets 00:00 UTC", id="day, the use gpupool quota shows"),
    pytest.param(Limits(gpu_hours_per_week=40.0), dict(used_week_s=41.5 * 3600), "gpu_hours_per_week",
                 "weekly GPU-hours used up (41.5 of 40.0); resets Monday 00:00 UTC", id="week, overrun"),
    pytest.param(Limits(gpu_hours_per_week=40.0), dict(used_week_s=40 * 3600), "gpu_hours_per_week",
                 "weekly GPU-hours used up (40.0 of 40.0); resets Monday 00:00 UTC", id="week"),
    pytest.param(Limits(gpu_hours_per_day=0.001), dict(used_today_s=3.6), "gpu_hours_per_day",
                 "daily GPU-hours used up (0.001 of 0.001); resets 00:00 UTC", id="small: significant digits"),
]


@pytest.mark.parametrize("limits, usage, limit, message", REFUSALS)
def test_refusal_words(limits, usage, limit, message):
    values = {**dict(holding=0.0, requested=0.5, used_today_s=0.0, used_week_s=0.0), **usage}
    refusal = check(limits, **values, day_resets="00:00 UTC", week_resets="Monday 00:00 UTC")
    assert (refusal.limit, refusal.words()) == (limit, message)


@pytest.mark.parametrize("limits, usage", [
    (Limits(max_gpus=1.0), dict(holding=0.5, requested=0.5)),
    (Limits(max_gpus=1.0), dict(holding=0.1 + 0.2, requested=0.7)),  # float sums use an epsilon
    (Limits(gpu_hours_per_day=8.0), dict(used_today_s=8 * 3600 - 1)),
    (Limits(), dict(holding=100.0, requested=64.0, used_today_s=1e9, used_week_s=1e9)),
])
def test_within_limits(limits, usage):
    values = {**dict(holding=0.0, requested=0.5, used_today_s=0.0, used_week_s=0.0), **usage}
    assert check(limits, **values, day_resets="", week_resets="") is None


def test_usage_table_names_each_column():
    """``gpupool quota usage``: the first column says whether the row is a user's or a group's."""
    from gpupool.quota_cli import usage_text

    body = {"timezone": "UTC", "today_gpu_hours": {"users": {"ann": 1.5}, "groups": {"quants": 1.5}},
            "week_gpu_hours": {"users": {"ann": 4.0}, "groups": {"quants": 4.0}}, "daily_gpu_hours": {}}
    assert usage_text(body).splitlines() == [
        "GPU-hours, days and weeks in UTC",
        "user or group  name    today  this week",
        "-------------  ------  -----  ---------",
        "user           ann     1.50   4.00",
        "group          quants  1.50   4.00",
    ]


def test_quota_table_names_each_column():
    """``gpupool quota`` and ``%gpu quota``: the limits' column has a name too (it was blank)."""
    from gpupool.quota_cli import quota_text

    body = {"user": "ann", "groups": [], "usage": {"timezone": "UTC", "today_gpu_hours": 0.1},
            "limits": {"max_gpus": 2, "gpu_hours_per_day": 8}}
    assert quota_text(body).splitlines()[1].split() == ["limit", "on", "used", "limit"]


# -- through the service ------------------------------------------------------------------------------------------

@pytest.fixture
def quota_service(tmp_path):
    """A service with ann (admin), bob (group quants) and the default tester;
    tester may hold 1 GPU, 8 GPU-hours a day; quants 2 GPUs; a silent node of 4 GPUs."""
    tokens = {"ann": "ann-" + uuid.uuid4().hex, "bob": "bob-" + uuid.uuid4().hex}
    config = {"admin_users": {"ann"}, "groups": {"quants": ["bob"]}, "node_ttl": 3600,
              "quotas": {"*": {"max_gpus": 1, "gpu_hours_per_day": 8, "max_idle_timeout": "1h"},
                         "group:quants": {"max_gpus": 2}}}
    svc = start_service(tmp_path, tokens=tokens, config=config)
    with silent_listener() as silent:
        svc.silent_url = "http://127.0.0.1:%d" % silent.getsockname()[1]
        register(svc, "node-q", gpus=4)
        yield svc
    svc.stop()


def refused(client, **request) -> GPUPoolError:
    with pytest.raises(GPUPoolError) as error:
        client.create_lease(LeaseRequest(**request))
    return error.value


def test_concurrent_quota_refusal_names_the_numbers(quota_service):
    client = quota_service.client()
    client.create_lease(LeaseRequest(fraction=0.5))
    client.create_lease(LeaseRequest(fraction=0.25))
    error = refused(client, fraction=0.5)
    assert (error.status, error.code, error.extra["limit"]) == (429, "quota_exceeded", "max_gpus")
    assert error.message == "quota exceeded: you hold 0.75 of 1.00 GPU; requested 0.50; ask for at most 0.25"
    client.create_lease(LeaseRequest(fraction=0.25))  # exactly up to the limit
    # bob's group is more generous, and his own holdings are his.
    bob = quota_service.client("bob")
    bob.create_lease(LeaseRequest(gpu_count=2))
    assert refused(bob, fraction=0.1).message == ("quota exceeded: you hold 2.00 of 2.00 GPU; requested 0.10; nothing more "
                                                  "fits: release a lease or cancel a queued request first (gpupool status "
                                                  "lists them)")
    assert len(client.list_leases()) == 3 and len(bob.list_leases()) == 1


def use_up_today(service, lease_id: str) -> None:
    """Put tester's 8 GPU-hours of today in the ledger, as earlier leases would leave them: a record
    from midnight to now whose GPUs make 8 GPU-hours whatever the time of day (usage counts
    GPUs x the hours of a record within the day, not its gpu_seconds)."""
    from gpupool.hub_plugin import usage
    from gpupool.hub_plugin.db import Store
    from gpupool.hub_plugin.models import UsageRecord

    store = Store(f"sqlite:///{service.state_dir}/gpupool.sqlite")
    now = datetime.now(timezone.utc)
    midnight = usage.period(now, timezone.utc, usage.DAY)[0]
    held = max((now - midnight).total_seconds(), 1.0)
    with store.write() as session:
        session.add(UsageRecord(lease_id=lease_id, owner="tester", groups=[], gpus=8 * 3600 / held,
                                started_at=now - timedelta(seconds=held), ended_at=now, gpu_seconds=8 * 3600.0))
    store.close()


def test_daily_gpu_hours_refusal(quota_service):
    """8 GPU-hours of today in the ledger (as earlier leases would leave them): the next request is refused."""
    use_up_today(quota_service, "L-0000000000aa")
    error = refused(quota_service.client(), fraction=0.25)
    assert (error.status, error.extra["limit"]) == (429, "gpu_hours_per_day")
    assert error.message == "daily GPU-hours used up (8.0 of 8.0); resets 00:00 UTC"
    mine = quota_service.client().quota()
    assert mine["usage"]["today_gpu_hours"] == pytest.approx(8.0)
    assert mine["limits"]["gpu_hours_per_day"] == 8.0


def test_queued_request_fails_when_gpu_hours_run_out_while_it_waits(quota_service):
    """The quota is checked again when a queued request would be placed: GPU-hours used
    up meanwhile end it ``failed`` with the quota's words (here at the next reclaim sweep)."""
    client = quota_service.client()
    quota_service.client("ann").set_quota("user:bob", {"max_gpus": 4})
    # bob's lease fills node-q: starting while its silent agent does not answer (worker_start_timeout, 60 s)
    quota_service.client("bob").create_lease(LeaseRequest(gpu_count=4))
    queued = client.create_lease(LeaseRequest(fraction=0.5, wait=600))  # no room: it waits
    assert queued.state == "queued"
    use_up_today(quota_service, "L-0000000000ab")
    ended = client.get_lease(queued.id, wait=30, state="queued")
    assert ended.state == "failed"
    assert ended.reason.startswith("while queued: daily GPU-hours used up (8.0 of 8.0)"), ended.reason


def test_idle_timeout_above_the_quota_is_refused(quota_service):
    error = refused(quota_service.client(), fraction=0.25, idle_timeout=7200)
    assert (error.status, error.code) == (400, "bad_request")
    assert "above your maximum of 1h (max_idle_timeout: your quota's" in error.message
    lease = quota_service.client().create_lease(LeaseRequest(fraction=0.25))
    assert lease.idle_timeout == 1800  # the pool's default fits under the maximum


def test_own_quota(quota_service):
    bob = quota_service.client("bob").quota()
    assert (bob["user"], bob["groups"]) == ("bob", ["quants"])
    assert bob["limits"] == {"max_gpus": 2.0, "max_lease_gpus": None, "gpu_hours_per_day": 8.0,
                             "gpu_hours_per_week": None, "max_idle_timeout": 3600.0, "guaranteed_gpus": None,
                             "max_parked_memory": None}
    assert bob["usage"]["holding_gpus"] == 0 and bob["usage"]["timezone"] == "UTC"
    assert bob["usage"]["day_resets_at"].endswith("T00:00:00Z")


def test_only_admins_reach_the_admin_api(quota_service):
    for user in (None, "bob"):
        token = quota_service.extra_tokens[user or "tester"]
        assert_error(http(quota_service, "GET", "/admin/quotas", token=token), 403, "forbidden")
        assert_error(http(quota_service, "PUT", "/admin/quotas/user:bob", {"max_gpus": 9}, token=token),
                     403, "forbidden")
        assert_error(http(quota_service, "GET", "/admin/usage", token=token), 403, "forbidden")
    ann = quota_service.extra_tokens["ann"]
    assert_error(http(quota_service, "PUT", "/admin/quotas/bob", {"max_gpus": 1}, token=ann), 400, "bad_request")
    assert_error(http(quota_service, "PUT", "/admin/quotas/user:bob", {"max_gpu": 1}, token=ann), 400, "bad_request")
    assert_error(http(quota_service, "DELETE", "/admin/quotas/user:nobody", token=ann), 404, "not_found")
    assert http(quota_service, "GET", "/admin/quotas", token=ann)[1]["overrides"] == {}


def test_overrides_survive_a_restart(tmp_path, quota_service, capsys):
    from gpupool.quota_cli import main as quota_main

    def token_file(user: str, service) -> str:
        path = tmp_path / f"{user}.token"
        path.write_text(service.extra_tokens[user] + "\n")
        return str(path)

    ann = ["--url", quota_service.url, "--token-file", token_file("ann", quota_service)]
    assert quota_main(["set", "user:bob", "max_gpus=0.25", "gpu_hours_per_week=90m", *ann]) == 0
    assert "user:bob: max_gpus 0.25 GPU, gpu_hours_per_week 1.5 GPU-hours" in capsys.readouterr().out
    assert quota_main(["set", "user:carl", "gpu_hours_per_day=0.001", *ann]) == 0
    assert "user:carl: gpu_hours_per_day 0.001 GPU-hours" in capsys.readouterr().out, "not 0.0"
    assert quota_main(["set", "group:quants", "max_idle_timeout=2h", *ann]) == 0
    assert quota_service.stop() == 0
    config = {"admin_users": {"ann"}, "groups": {"quants": ["bob"]}, "node_ttl": 3600,
              "quotas": {"*": {"max_gpus": 1}, "group:quants": {"max_gpus": 2}}}
    svc = start_service(tmp_path, tokens={u: t for u, t in quota_service.extra_tokens.items() if u != "tester"},
                        config=config)
    try:
        bob = svc.client("bob")
        assert bob.quota()["limits"] == {"max_gpus": 0.25, "max_lease_gpus": None, "gpu_hours_per_day": None,
                                         "gpu_hours_per_week": 1.5, "max_idle_timeout": 7200.0, "guaranteed_gpus": None,
                                         "max_parked_memory": None}
        error = refused(bob, fraction=0.5)
        assert error.message == "quota exceeded: you hold 0.00 of 0.25 GPU; requested 0.50; ask for at most 0.25"
        listing = svc.client("ann").admin_quotas()
        assert listing["overrides"]["user:bob"]["updated_by"] == "ann"
        assert listing["effective"]["group:quants"] == {"max_gpus": 2.0, "max_idle_timeout": 7200.0}
        ann = ["--url", svc.url, "--token-file", token_file("ann", svc)]
        capsys.readouterr()
        assert quota_main(["list", *ann]) == 0 and quota_main(["usage", *ann]) == 0
        listed = capsys.readouterr().out
        bob_row, = [line for line in listed.splitlines() if line.startswith("user:bob ")]
        assert "0.25 GPU" in bob_row and "1.5 GPU-hours" in bob_row and " ann " in bob_row, listed
        assert "GPU-hours, days and weeks in UTC" in listed and "{" not in listed, "tables, not JSON"
        assert quota_main(["unset", "user:bob", *ann]) == 0
        assert bob.quota()["limits"]["max_gpus"] == 2.0
        assert quota_main(["--url", svc.url, "--token-file", token_file("bob", svc)]) == 0
        out = capsys.readouterr().out
        assert "user bob (groups: quants)" in out and "2.00 GPU" in out
    finally:
        svc.stop()


# -- concurrency: the quota check and the reservation are one transaction ---------------------------------------------

@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/race.sqlite"
    return request.getfixturevalue("postgres_url")


def test_200_concurrent_requests_of_many_users_respect_pool_and_quotas(tmp_path, store_url):
    """Six users, 200 requests for 0.25 at once, two GPUs (8 slices). Quotas:
    0.25 each, 1.0 for u0 (group big). No GPU over-allocated, no quota
    overrun; after releasing, one ledger record per lease, adding up."""
    import threading
    from collections import Counter

    from procs import start_agent
    from sqlalchemy import func, select

    from gpupool.hub_plugin.db import Store
    from gpupool.hub_plugin.models import Lease, UsageRecord

    users = [f"u{i}" for i in range(6)]
    limit = {user: 0.25 for user in users} | {"u0": 1.0}
    config = {"db_url": store_url, "admin_users": {"u0"}, "groups": {"big": ["u0"]},
              "quotas": {"*": {"max_gpus": 0.25}, "group:big": {"max_gpus": 1.0}}}
    svc = start_service(tmp_path, tokens={u: f"{u}-{uuid.uuid4().hex}" for u in users}, config=config)
    agent = start_agent(tmp_path, svc)
    try:
        barrier = threading.Barrier(200)
        outcomes: Counter = Counter()
        lock = threading.Lock()

        def ask(user: str) -> None:
            client = svc.client(user)
            barrier.wait()
            try:
                client.create_lease(LeaseRequest(fraction=0.25))
                outcome = "granted"
            except GPUPoolError as exc:
                outcome = exc.code
            with lock:
                outcomes[outcome] += 1

        threads = [threading.Thread(target=ask, args=(users[i % len(users)],)) for i in range(200)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert outcomes["granted"] == 8 and sum(outcomes.values()) == 200
        assert set(outcomes) <= {"granted", "pool_full", "quota_exceeded"} and outcomes["quota_exceeded"] > 0
        assert [g["allocated_fraction"] for n in svc.client().pool()["nodes"] for g in n["gpus"]] == [1.0, 1.0]
        held = {user: [lease for lease in svc.client(user).list_leases()] for user in users}
        for user in users:
            assert sum(lease.fraction for lease in held[user]) <= limit[user] + 1e-9, user
        # Let the workers start, so the leases have usage, then release them all.
        from service_api import wait_state

        for user in users:
            for lease in held[user]:
                assert wait_state(svc, lease.id, "starting", user=user).state is LeaseState.active
        for user in users:
            for lease in held[user]:
                svc.client(user).release(lease.id)
        usage = svc.client("u0").admin_usage(days=1)
    finally:
        agent.stop()
        svc.stop()
    store = Store(store_url)
    try:
        with store.read() as session:
            ended = session.scalars(select(Lease).where(Lease.ended_at.is_not(None))).all()
            records = session.scalars(select(UsageRecord)).all()
            assert session.scalar(select(func.count()).select_from(Lease)) == 8
        assert sorted(r.lease_id for r in records) == sorted(lease.id for lease in ended) and len(records) == 8
        assert all(r.gpu_seconds > 0 for r in records)
        assert sum(r.gpu_seconds for r in records) == pytest.approx(sum(x.usage_gpu_seconds for x in ended))
        by_user = Counter()
        for record in records:
            by_user[record.owner] += record.gpu_seconds / 3600.0
        assert usage["today_gpu_hours"]["users"] == pytest.approx(dict(by_user))
        assert usage["today_gpu_hours"]["groups"] == pytest.approx({"big": by_user["u0"]} if by_user["u0"] else {})
        assert {u: sum(days.values()) for u, days in usage["daily_gpu_hours"].items()} == pytest.approx(dict(by_user))
    finally:
        store.close()


def test_a_move_within_quota_does_not_count_the_lease_it_replaces(tmp_path):
    """tester (max_gpus 1) holds 0.5 and moves to 1 (``replaces``, as ``%gpu acquire 1``
    while attached sends it): allowed, though both leases are held for a moment. A
    ``replaces`` of someone else's lease, or of none, is refused with words and changes nothing."""
    from procs import start_agent

    tokens = {"bob": "bob-" + uuid.uuid4().hex}
    svc = start_service(tmp_path, tokens=tokens, config={"quotas": {"*": {"max_gpus": 1}}})
    agent = start_agent(tmp_path, svc, name="node-m")
    try:
        client, bob = svc.client(), svc.client("bob")
        old = client.get_lease(client.create_lease(LeaseRequest(fraction=0.5)).id, wait=30, state="starting")
        assert old.state == LeaseState.active, old.reason
        error = refused(client, fraction=1)
        assert error.message == ("quota exceeded: you hold 0.50 of 1.00 GPU; requested 1.00; ask for at most 0.50"), \
            "not a move: counted"
        for who, lease_id in ((bob, old.id), (client, "L-000000000000")):
            error = refused(who, fraction=0.5, replaces=lease_id)
            assert (error.status, error.code) == (409, "invalid_state")
            assert error.message == (f"'replaces' must name one of your active or parked leases; {lease_id!r} "
                                     "is not one"), error.message
        assert bob.list_leases() == [] and [lease.id for lease in client.list_leases()] == [old.id]
        new = client.create_lease(LeaseRequest(fraction=1, replaces=old.id))
        assert new.state in (LeaseState.starting, LeaseState.active), new.reason
        assert client.get_lease(old.id).state == LeaseState.active, "the move releases it, not the service"
        error = refused(client, fraction=0.25, replaces=old.id)  # a second move of it would leave two uncounted
        assert error.message == (f"{old.id} is being replaced already, by {new.id} (a move): release one of them "
                                 "first"), error.message
        client.release(old.id)
        error = refused(client, fraction=0.5, replaces=old.id)
        assert error.message.endswith(f"{old.id!r} is not one (it is released)"), error.message
    finally:
        agent.stop()
        svc.stop()
