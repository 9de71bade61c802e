"""Service metric names per Prometheus' conventions, against a real store: label values are
codes (every scheduler refusal reason is a Misfit with a code and words; a reclaim counts by
the code reclaim.py decides beside its words, and revision 0010 gives older reclaimed leases
theirs from their words), ended leases are a counter, the queue's oldest wait."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from prometheus_client.parser import text_string_to_metric_families


def test_every_refusal_reason_has_a_code():
    from gpupool.hub_plugin.rules import scheduler
    from gpupool.hub_plugin.rules.misfits import Misfit, limit_code

    assert set(scheduler.REASONS) <= set(Misfit)
    codes, words = [str(m) for m in Misfit], [m.words for m in Misfit]
    assert len(set(codes)) == len(codes) and all(c.replace("_", "").isalpha() and c.islower() for c in codes)
    assert len(set(words)) == len(words) and not set(words) & set(codes)
    assert limit_code("max_gpus") == "quota_max_gpus" and limit_code("none; DROP") == "quota"
    # The pool's own limits (its 400s) count as the misfit of its biggest node, never as a quota's (docs/api.md)
    assert [limit_code(limit, quota=False) for limit in ("gpu_count", "memory", "model", "cpus", "host_memory")] == [
        "few_on_node", "no_memory", "model_mismatch", "no_host_cpus", "no_host_memory"]
    assert limit_code("gpu_count") == "quota_gpu_count" and limit_code("nonesuch", quota=False) == "bad_request"


@pytest.fixture
def store(tmp_path):
    from gpupool.hub_plugin.db import Store

    store = Store(f"sqlite:///{tmp_path}/store.sqlite")
    store.migrate()
    yield store
    store.close()


def test_ended_leases_reclaims_and_the_oldest_wait(store):
    from gpupool.hub_plugin.rules import reclaim
    from gpupool.hub_plugin.metrics import Metrics
    from gpupool.hub_plugin.models import Lease
    from gpupool.hub_plugin.rules.misfits import Misfit, limit_code

    now = datetime.now(timezone.utc)

    class Idle:  # what reclaim.py reads of a lease
        id, state, worker_state = "L-1", "active", "idle"
        idle_since, idle_timeout = now - timedelta(hours=1), 60.0
        last_heartbeat_at = started_at = now
        heartbeat_ttl = 60.0

    class Silent(Idle):
        worker_state, last_heartbeat_at = "idle", now - timedelta(hours=1)

    [idle], [silent] = reclaim.decide([Idle()], now), reclaim.decide([Silent()], now)
    assert (idle.code, silent.code) == (reclaim.Reclaim.idle, reclaim.Reclaim.heartbeat)

    def lease(state: str, reason: str | None = None, created: datetime = now, code: str | None = None) -> Lease:
        return Lease(owner="ann", state=state, reason=reason, fraction=0.5, gpu_count=1, memory=1, idle_timeout=60,
                     heartbeat_ttl=60, created_at=created, usage_gpu_seconds=0.0, reclaim_code=code)

    with store.write() as session:
        session.add_all([lease("reclaimed", idle.reason, code=idle.code), lease("reclaimed", "idle", code=idle.code),
                         lease("reclaimed", silent.reason, code=silent.code), lease("reclaimed", idle.reason),
                         lease("released", "released by ann"),
                         lease("failed", "no"), lease("queued", created=now - timedelta(minutes=10)),
                         lease("queued", created=now - timedelta(minutes=1))])
    metrics = Metrics(store, 0)
    metrics.refused({Misfit.no_fraction: 2, limit_code("max_gpus"): 1})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    assert samples[("gpupool_reclaims_total", (("reason", "idle"),))] == 2  # by the code, not the words
    assert samples[("gpupool_reclaims_total", (("reason", "heartbeat"),))] == 1
    assert samples[("gpupool_reclaims_total", (("reason", "pressure"),))] == 0  # every code has its series
    assert samples[("gpupool_reclaims_total", (("reason", "other"),))] == 1  # no code kept
    assert samples[("gpupool_leases_ended_total", (("state", "reclaimed"),))] == 4
    assert samples[("gpupool_leases_ended_total", (("state", "released"),))] == 1
    assert ("gpupool_leases", (("state", "released"),)) not in samples  # live states only: a gauge
    assert samples[("gpupool_leases", (("state", "queued"),))] == 2
    assert 600 <= samples[("gpupool_queue_oldest_wait_seconds", ())] < 3600
    assert samples[("gpupool_lease_refusals_total", (("reason", "no_fraction"),))] == 1
    assert samples[("gpupool_lease_refusals_total", (("reason", "quota_max_gpus"),))] == 1
    assert not any(name.endswith("_fraction") for name, _ in samples)


def test_revision_0010_gives_reclaimed_leases_their_code(store_url):
    from sqlalchemy import select, text

    from gpupool.hub_plugin.db import Store
    from gpupool.hub_plugin.migrations import upgrade
    from gpupool.hub_plugin.models import Lease

    rows = {"L-000000000001": ("reclaimed", None, "idle for 31m (idle timeout 30m); its worker was not confirmed"),
            "L-000000000002": ("reclaimed", None, "the notebook kernel stopped sending heartbeats for 2m (...)"),
            "L-000000000003": ("releasing", "reclaimed", "parked early: 2 people are waiting for a GPU (...)"),
            "L-000000000004": ("released", "released", "idle for nothing: released by its owner"),
            "L-000000000005": ("reclaimed", None, "reclaimed by a newer rule")}
    store = Store(store_url)
    try:
        with store.engine.begin() as connection:
            upgrade(connection, "0009")
            for lease_id, (state, end_state, reason) in rows.items():
                connection.execute(text(
                    "INSERT INTO leases (id, owner, state, end_state, reason, fraction, gpu_count, memory, "
                    "idle_timeout, heartbeat_ttl, created_at, usage_gpu_seconds) VALUES (:id, 'ann', :state, "
                    ":end_state, :reason, 0.5, 1, 1024, 60, 60, '2026-12-01 12:00:00', 0)"),
                    {"id": lease_id, "state": state, "end_state": end_state, "reason": reason})
        store.migrate()
        with store.read() as session:
            codes = dict(session.execute(select(Lease.id, Lease.reclaim_code)).all())
        assert codes == {"L-000000000001": "idle", "L-000000000002": "heartbeat", "L-000000000003": "pressure",
                         "L-000000000004": None, "L-000000000005": None}
    finally:
        store.close()
