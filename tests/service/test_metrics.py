"""Prometheus metrics at ``/metrics`` of a real service: the queue (length,
and how long a queued request waited until a release made room for it) and
GPU-seconds per user, which count running leases up to the scrape and end at
exactly what the usage ledger recorded when the lease ends."""

from __future__ import annotations

import urllib.request
from datetime import datetime, timedelta, timezone

import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_api import wait_state

from gpupool.schema import LeaseState, parse_time
from gpupool.wire.leases import LeaseRequest

WAIT = "gpupool_queue_wait_seconds"
USAGE = "gpupool_usage_gpu_seconds_total"


def scrape(svc, token: str | None = None) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of one scrape of ``/metrics`` with
    ``token`` (default: the metrics token, which sees the per-user series)."""
    req = urllib.request.Request(f"{svc.url.rstrip('/')}/metrics",
                                 headers={"Authorization": f"token {token or svc.metrics_token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def usage_of(samples: dict, user: str) -> float | None:
    return samples.get((USAGE, (("user", user),)))


def waited(lease) -> float:
    """Seconds from the lease's ``queued`` event to its ``starting`` one."""
    at = {e["state"]: parse_time(e["at"]) for e in lease.events}
    return (at["starting"] - at["queued"]).total_seconds()


def test_queue_wait_and_usage_per_user(busy_pool):
    svc, holders = busy_pool
    ann = svc.client("ann")
    before = scrape(svc)
    assert before[(WAIT + "_count", ())] == 0 and before[("gpupool_queue_length", ())] == 0
    assert usage_of(before, "ann") is None  # no series for who never held a lease
    assert usage_of(before, "tester") >= 0  # running leases count before they end
    # A user's scrape shows the pool, not what each user uses (docs/security.md, "Metrics").
    mine = scrape(svc, svc.user_token)
    assert ("gpupool_queue_length", ()) in mine and not any(dict(labels).get("user") for _, labels in mine)

    queued = ann.create_lease(LeaseRequest(fraction=0.5, wait=300))
    assert queued.state is LeaseState.queued
    now = scrape(svc)
    assert now[("gpupool_queue_length", ())] == 1 and now[("gpupool_leases", (("state", "queued"),))] == 1
    assert now[(WAIT + "_count", ())] == 0  # observed when placed, not when queued

    first = svc.client().release(holders[0].id)  # makes room: ann's request is placed in that transaction
    placed = wait_state(svc, queued.id, "queued", user="ann")
    placed = wait_state(svc, placed.id, "starting", user="ann")
    assert placed.state is LeaseState.active, placed.reason
    after = scrape(svc)
    assert after[("gpupool_queue_length", ())] == 0
    assert after[(WAIT + "_count", ())] == 1
    assert after[(WAIT + "_sum", ())] == pytest.approx(waited(placed), abs=1e-6)
    # The one observation lies in every bucket at or above its value and in none below.
    buckets = {float(dict(labels)["le"]): value for (name, labels), value in after.items() if name == WAIT + "_bucket"}
    assert buckets and all(count == (1 if le >= waited(placed) else 0) for le, count in buckets.items())

    # tester: the ended lease at exactly its ledger value, the other one running up to the scrape.
    assert first.state is LeaseState.released and first.usage_gpu_seconds > 0
    assert usage_of(after, "tester") >= first.usage_gpu_seconds
    running_ann = usage_of(after, "ann")  # active: counted up to the scrape
    assert running_ann is not None and running_ann >= 0
    second = svc.client().release(holders[1].id)
    ended_ann = ann.release(placed.id)
    end = scrape(svc)
    assert usage_of(end, "tester") == pytest.approx(first.usage_gpu_seconds + second.usage_gpu_seconds, rel=1e-9)
    assert usage_of(end, "ann") == pytest.approx(ended_ann.usage_gpu_seconds, rel=1e-9)
    assert usage_of(end, "ann") >= running_ann  # a counter: the end never reads less than the running lease did
    assert end[(WAIT + "_count", ())] == 1


# -- the usage counter against the store directly --------------------------------------------------------------------

@pytest.fixture
def store(tmp_path):
    from gpupool.hub_plugin.db import Store

    store = Store(f"sqlite:///{tmp_path}/store.sqlite")
    store.migrate()
    yield store
    store.close()


def test_usage_counter_sums_the_ledger_and_running_leases(store):
    from gpupool.hub_plugin import usage
    from gpupool.hub_plugin.metrics import Metrics
    from gpupool.hub_plugin.models import Lease

    start = datetime.now(timezone.utc) - timedelta(hours=1)

    def lease(owner: str, fraction: float, count: int, state: str, started: datetime | None) -> Lease:
        return Lease(owner=owner, state=state, fraction=fraction, gpu_count=count, memory=1, idle_timeout=60,
                     heartbeat_ttl=60, created_at=start, started_at=started, held_since=started, usage_gpu_seconds=0.0)

    with store.write() as session:
        ended = lease("ann", 0.5, 1, "released", start)
        session.add(ended)
        session.flush()
        usage.close(session, ended, start + timedelta(minutes=10))  # 0.5 x 600 s
        session.add(lease("bob", 1.0, 2, "starting", None))  # not started: nothing used yet
        session.add(lease("cy", 0.25, 2, "active", start))  # running: 0.5 GPUs x seconds up to the scrape
    lo = datetime.now(timezone.utc)
    text = Metrics(store, 0).render().decode()
    hi = datetime.now(timezone.utc)
    samples = {(s.name, s.labels.get("user")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[(USAGE, "ann")] == pytest.approx(300.0)
    assert (USAGE, "bob") not in samples
    assert 0.5 * (lo - start).total_seconds() <= samples[(USAGE, "cy")] <= 0.5 * (hi - start).total_seconds()
