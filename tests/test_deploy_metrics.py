"""Service metric names per Prometheus' conventions, against a real store: label values are
codes (every scheduler refusal reason is a Misfit with a code and words; reclaim reasons map
by the words reclaim.py writes, so the two cannot drift apart), ended leases are a counter, the queue's oldest wait."""

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
        state, worker_state = "active", "idle"
        idle_since, idle_timeout = now - timedelta(hours=1), 60.0
        last_heartbeat_at = started_at = now
        heartbeat_ttl = 60.0

    class Silent(Idle):
        worker_state, last_heartbeat_at = "idle", now - timedelta(hours=1)

    idle_words = reclaim.idle_expired(Idle(), now)
    silent_words = reclaim.heartbeat_expired(Silent(), now)
    assert idle_words and silent_words

    def lease(state: str, reason: str | None = None, created: datetime = now) -> Lease:
        return Lease(owner="ann", state=state, reason=reason, fraction=0.5, gpu_count=1, memory=1, idle_timeout=60,
                     heartbeat_ttl=60, created_at=created, usage_gpu_seconds=0.0)

    with store.write() as session:
        session.add_all([lease("reclaimed", idle_words), lease("reclaimed", idle_words),
                         lease("reclaimed", silent_words), lease("released", "released by ann"),
                         lease("failed", "no"), lease("queued", created=now - timedelta(minutes=10)),
                         lease("queued", created=now - timedelta(minutes=1))])
    metrics = Metrics(store, 0)
    metrics.refused({Misfit.no_fraction: 2, limit_code("max_gpus"): 1})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    assert samples[("gpupool_reclaims_total", (("reason", "idle"),))] == 2
    assert samples[("gpupool_reclaims_total", (("reason", "heartbeat"),))] == 1
    assert samples[("gpupool_leases_ended_total", (("state", "reclaimed"),))] == 3
    assert samples[("gpupool_leases_ended_total", (("state", "released"),))] == 1
    assert ("gpupool_leases", (("state", "released"),)) not in samples  # live states only: a gauge
    assert samples[("gpupool_leases", (("state", "queued"),))] == 2
    assert 600 <= samples[("gpupool_queue_oldest_wait_seconds", ())] < 3600
    assert samples[("gpupool_lease_refusals_total", (("reason", "no_fraction"),))] == 1
    assert samples[("gpupool_lease_refusals_total", (("reason", "quota_max_gpus"),))] == 1
    assert not any(name.endswith("_fraction") for name, _ in samples)
