"""The agent's ``/metrics`` of a real agent (simulated GPUs) registered with a real service:
the metrics token (or the agent token) reads it, a user's token does not; per-GPU series
carry DCGM exporter's labels; a lease's worker is counted on its GPU after a heartbeat."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from procs import start_agent, wait_for

from gpupool.wire.leases import LeaseRequest

METRICS_TOKEN = "metrics-token-for-tests"


def scrape(url: str, token: str) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, {}
    return 200, {(s.name, tuple(sorted(s.labels.items()))): s.value
                 for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def metered_agent(tmp_path, service):
    token_file = tmp_path / "metrics_token"
    token_file.write_text(METRICS_TOKEN + "\n")
    node = start_agent(tmp_path, service, extra_args=[f"--metrics-token-file={token_file}"])
    yield service, node
    node.stop()


def gpu_series(samples: dict, name: str) -> dict[str, float]:
    return {dict(labels)["UUID"]: value for (sample, labels), value in samples.items() if sample == name}


def test_agent_metrics_need_the_metrics_token_and_count_workers(metered_agent):
    service, node = metered_agent
    assert scrape(node.url, service.user_token)[0] == 401
    assert scrape(node.url, service.agent_token)[0] == 200
    status, samples = scrape(node.url, METRICS_TOKEN)
    assert status == 200
    totals = [(dict(labels), value) for (name, labels), value in samples.items()
              if name == "gpupool_agent_gpu_memory_total_bytes"]
    assert len(totals) == 2
    for labels, value in totals:
        assert set(labels) == {"gpu", "UUID", "modelName", "Hostname"}
        assert labels["Hostname"] == node.name and labels["modelName"] == "NVIDIA A100-SXM4-80GB"
        assert value == 80 * 1024**3
    assert samples[("gpupool_agent_nvml_up", ())] == 1
    assert samples[("gpupool_agent_nvml_errors_total", ())] == 0
    assert not [name for name, _ in samples if name.endswith("_created")], "no series docs/api.md does not list"

    lease = service.client().create_lease(LeaseRequest(fraction=0.5))
    uuid = lease.gpus[0]["uuid"]
    wait_for(lambda: gpu_series(scrape(node.url, METRICS_TOKEN)[1], "gpupool_agent_gpu_workers").get(uuid) == 1,
             30, "the worker counted on its GPU", node.proc, node.log)
    samples = scrape(node.url, METRICS_TOKEN)[1]
    assert sum(gpu_series(samples, "gpupool_agent_gpu_workers").values()) == 1
    assert samples[("gpupool_agent_workers", (("state", "idle"),))] + \
        samples[("gpupool_agent_workers", (("state", "busy"),))] + \
        samples[("gpupool_agent_workers", (("state", "starting"),))] == 1
    service.client().release(lease.id)
