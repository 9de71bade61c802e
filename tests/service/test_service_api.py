"""The pool service over HTTP: a real ``gpupool service`` subprocess, real
SQLite (and PostgreSQL when ``GPUPOOL_TEST_POSTGRES_URL`` is set), real
agents with simulated GPUs and real ipykernel workers."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from typing import Any

import pytest
from procs import start_agent, start_service, wait_for
from service_api import (GiB, acquire, all_leases, assert_error, gpu_allocations, http, register, silent_listener,
                         wait_ended, wait_state)

from gpupool.demo_pool import processes_mentioning

from gpupool.errors import GPUPoolError
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest



# -- fixtures ---------------------------------------------------------------------------------------------------

@pytest.fixture
def service(service):
    """The conftest service, plus ``silent_url`` (see :func:`service_api.silent_listener`)."""
    with silent_listener() as silent:
        service.silent_url = "http://127.0.0.1:%d" % silent.getsockname()[1]
        yield service


@pytest.fixture(scope="module")
def shared_service(tmp_path_factory):
    """One service for the tests that must change nothing, with node-x
    registered (two GPUs, a silent agent)."""
    svc = start_service(tmp_path_factory.mktemp("shared"), config={"node_ttl": 3600})
    with silent_listener() as silent:
        svc.silent_url = "http://127.0.0.1:%d" % silent.getsockname()[1]
        register(svc)
        yield svc
    svc.stop()


def snapshot(svc) -> tuple:
    """Everything a bad request must leave as it was."""
    return all_leases(svc), svc.client().pool()["nodes"]


@pytest.fixture
def users(tmp_path):
    """A service with users ann (admin) and bob besides the default tester."""
    svc = start_service(tmp_path, tokens={"ann": "ann-" + uuid.uuid4().hex, "bob": "bob-" + uuid.uuid4().hex},
                        config={"admin_users": {"ann"}})
    yield svc
    svc.stop()


# -- no agent needed --------------------------------------------------------------------------------------------

def test_health_needs_no_token(service):
    assert http(service, "GET", "/health", token=None, prefix="") == (200, {"status": "ok"})
    assert http(service, "GET", "/health", token=None) == (200, {"status": "ok"})


@pytest.mark.parametrize("token", [None, "not-a-token"])
@pytest.mark.parametrize("method, path", [("GET", "/leases"), ("POST", "/leases"), ("GET", "/leases/L-000000000000"),
                                          ("DELETE", "/leases/L-000000000000"), ("GET", "/pool"),
                                          ("POST", "/nodes"), ("POST", "/nodes/node-1/heartbeat")])
def test_calls_without_a_valid_token_get_401(shared_service, token, method, path):
    before = snapshot(shared_service)
    reply = http(shared_service, method, path, {"fraction": 0.5} if method == "POST" else None, token=token)
    assert_error(reply, 401, "unauthorized")
    assert snapshot(shared_service) == before


def test_without_configured_tokens_the_service_writes_them(tmp_path):
    """Standalone: a token for the user running the service, and the agent's, each mode 0600."""
    import getpass
    import stat

    from gpupool import demo_pool

    svc = demo_pool.start_service(tmp_path / "bare")
    try:
        for name in ("user_token", "agent_token"):
            assert stat.S_IMODE((svc.state_dir / name).stat().st_mode) == 0o600
        client = svc.client()  # the token in STATE_DIR/user_token
        assert client.list_leases() == []
        assert client.pool()["nodes"] == []
        assert getpass.getuser() in svc.log.read_text()
        assert (svc.state_dir / "user_token").read_text().strip() not in svc.log.read_text()
    finally:
        svc.stop()


def test_one_service_per_state_dir_and_ports_in_range(service):
    """A second service on a live one's state dir would decide on its own
    in-memory view of the same store: refused in one line, as is a port out of range."""
    import subprocess
    import sys

    def run_service(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpupool.cli", "service", *args], capture_output=True,
                              text=True, timeout=60)

    second = run_service("--port=0", f"--state-dir={service.state_dir}")
    assert second.returncode == 1
    assert f"another service is running with the state directory {service.state_dir}" in second.stderr
    assert "Traceback" not in second.stderr
    assert http(service, "GET", "/health", token=None)[0] == 200  # the first one is untouched
    wrapped = run_service("--port=99999", f"--state-dir={service.state_dir}-other")
    assert wrapped.returncode != 0 and "should not be greater than 65535" in wrapped.stderr, wrapped.stderr


def test_agent_token_cannot_use_leases(service):
    register(service)
    assert_error(http(service, "POST", "/leases", {"fraction": 0.5}, token="agent"), 403, "forbidden")
    assert_error(http(service, "GET", "/leases", token="agent"), 403, "forbidden")
    assert all_leases(service) == []


def test_user_token_cannot_register_nodes(service):
    body = {"name": "rogue", "url": "http://127.0.0.1:9", "inventory": "simulated", "gpus": []}
    assert_error(http(service, "POST", "/nodes", body), 403, "forbidden")
    assert_error(http(service, "POST", "/nodes/rogue/heartbeat", {}), 403, "forbidden")
    assert service.client().pool()["nodes"] == []


@pytest.mark.parametrize("raw, message", [
    (b"{not json", "not valid JSON"),
    (b"", "needs a JSON body"),
    (b"[0.5]", "JSON object"),
    (b'{"fraction": 0.5, "colour": "red"}', "unknown field"),
    (b'{"fraction": 0}', "'fraction' must be in (0, 1]"),
    (b'{"fraction": 1.5}', "'fraction' must be in (0, 1]"),
    (b'{"fraction": "half"}', "'fraction' must be a number"),
    (b'{"fraction": true}', "'fraction' must be a number"),
    (b'{"fraction": 0.5, "gpu_count": 2}', "whole GPUs"),
    (b'{"gpu_count": 1.5}', "'gpu_count'"),
    (b'{"memory": 0}', "'memory'"),
    (b'{"idle_timeout": -1}', "'idle_timeout'"),
    (b'{"idle_timeout": 172800}', "above your maximum of 1d"),
    (b'{"model": ""}', "'model'"),
])
def test_bad_lease_requests_get_400_and_change_nothing(shared_service, raw, message):
    before = snapshot(shared_service)
    body = assert_error(http(shared_service, "POST", "/leases", raw=raw), 400, "bad_request")
    assert message in body["message"]
    assert snapshot(shared_service) == before
    assert before[0] == [] and gpu_allocations(shared_service) == [0.0, 0.0]


def test_bad_query_arguments_get_400(service):
    assert_error(http(service, "GET", "/leases?active=maybe"), 400, "bad_request")
    register(service)
    lease = service.client().create_lease(LeaseRequest(fraction=0.25))
    assert_error(http(service, "GET", f"/leases/{lease.id}?wait=soon"), 400, "bad_request")
    assert_error(http(service, "GET", f"/leases/{lease.id}?wait=1&state=sleeping"), 400, "bad_request")
    assert_error(http(service, "DELETE", f"/leases/{lease.id}?reason=" + "x" * 300), 400, "bad_request")
    assert_error(http(service, "POST", f"/leases/{lease.id}/heartbeat", raw=b"{oops"), 400, "bad_request")
    assert_error(http(service, "POST", "/leases?start_wait=-1", {"fraction": 0.25}), 400, "bad_request")


def test_start_wait_answers_starting_when_the_worker_takes_longer(service):
    """The silent agent never answers: after ``start_wait`` the lease is answered ``starting``."""
    register(service)
    lease = service.client().create_lease(LeaseRequest(fraction=0.25), start_wait=0.2)
    assert (lease.state, lease.connection) == (LeaseState.starting, None)


def test_unknown_paths_and_leases_are_json_404(service):
    assert_error(http(service, "GET", "/nowhere"), 404, "not_found")
    assert_error(http(service, "GET", "/leases/L-000000000000"), 404, "not_found")
    assert_error(http(service, "DELETE", "/leases/L-000000000000"), 404, "not_found")
    assert_error(http(service, "POST", "/leases/L-000000000000/heartbeat", {}), 404, "not_found")
    assert_error(http(service, "PUT", "/leases", {}), 405, "method_not_allowed")


def test_openapi_document_lists_every_path(service):
    from gpupool.hub_plugin.app import ROUTES

    status, doc = http(service, "GET", "/openapi.json", token=None)
    assert status == 200 and doc["openapi"].startswith("3.1")
    served = {re.sub(r"\([^)]*\)", "{}", path.removeprefix("/api/v1")) for path, _ in ROUTES
              if path.startswith("/api/v1/")}
    documented = {re.sub(r"\{[^}]*\}", "{}", path) for path in doc["paths"]}
    assert served == documented
    assert set(doc["components"]["schemas"]["LeaseRequest"]["properties"]) == set(LeaseRequest.KEYS)
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            assert op["responses"] and op["summary"], (path, method)


@pytest.mark.parametrize("change, message", [
    ({"name": ""}, "'name'"),
    ({"name": "a/b"}, "'name'"),
    ({"url": "ftp://x"}, "'url'"),
    ({"url": None}, "'url'"),
    ({"inventory": "imaginary"}, "'inventory'"),
    ({"gpus": "two"}, "'gpus' must be a list"),
    ({"gpus": None}, "'gpus' must be a list"),
    ({"gpus": [{"uuid": "G-1", "name": "A100", "index": 0}]}, "'memory_total' is required"),
    ({"gpus": [{"uuid": "G-1", "name": "A100", "index": 0, "memory_total": 10, "memory_reserved": 10}]},
     "memory_reserved"),
    ({"gpus": [{"uuid": "G-1", "name": "A100", "index": 0, "memory_total": 10}] * 2}, "once"),
    ({"workers": [{"lease_id": "L-1", "execution_state": "dreaming"}]}, "execution_state"),
])
def test_node_registration_validation(shared_service, change, message):
    before = snapshot(shared_service)
    body = {"name": "node-v", "url": shared_service.silent_url, "inventory": "simulated",
            "gpus": [{"uuid": "G-0", "name": "NVIDIA L4", "index": 0, "memory_total": 24 * GiB}], **change}
    reply = assert_error(http(shared_service, "POST", "/nodes", body, token="agent"), 400, "bad_request")
    assert message in reply["message"]
    assert snapshot(shared_service) == before


def test_a_second_agent_cannot_take_a_live_nodes_name(service):
    register(service, "node-t", gpus=2)
    body = {"name": "node-t", "url": "http://127.0.0.1:9/", "inventory": "simulated", "gpus": []}
    status, reply = http(service, "POST", "/nodes", body, token="agent")
    assert (status, reply["error"]) == (409, "node_name_taken") and "--name" in reply["message"]
    assert [len(n["gpus"]) for n in service.client().pool()["nodes"]] == [2], "nothing changed"
    register(service, "node-t", gpus=1)  # the same agent (same URL) registering again is fine


def test_node_registration_and_heartbeat(service):
    reply = register(service, "node-r", gpus=2)
    assert reply == {"name": "node-r", "heartbeat_interval": 0.2, "stop": []}
    (node,) = service.client().pool()["nodes"]
    assert (node["name"], node["state"], len(node["gpus"])) == ("node-r", "up", 2)
    # A heartbeat: GPU readings are stored, workers of unknown leases must stop.
    status, reply = http(service, "POST", "/nodes/node-r/heartbeat", token="agent", body={
        "workers": [{"lease_id": "L-0123456789ab", "pid": 1, "execution_state": "idle"}],
        "gpus": [{"uuid": "GPU-node-r-0", "memory_used": 5 * GiB, "utilization": 42.0}]})
    assert (status, reply) == (200, {"stop": ["L-0123456789ab"]})
    gpu0 = service.client().pool()["nodes"][0]["gpus"][0]
    assert (gpu0["memory_used"], gpu0["utilization"]) == (5 * GiB, 42.0)
    assert_error(http(service, "POST", "/nodes/node-r/heartbeat", {"gpus": [{"uuid": 1}]}, token="agent"),
                 400, "bad_request")
    # The service forgot nothing, but an unknown node must register again.
    assert_error(http(service, "POST", "/nodes/node-zz/heartbeat", {}, token="agent"), 404, "not_found")
    # Registering again with one GPU fewer drops the missing one.
    register(service, "node-r", gpus=1)
    assert [len(n["gpus"]) for n in service.client().pool()["nodes"]] == [1]


def test_memory_of_no_worker_and_whole_gpu_nodes_shape_placement(service):
    register(service, "node-u", gpus=1)
    register(service, "node-mig", gpus=1, enforcement="mig", whole_gpus=True)
    status, _ = http(service, "POST", "/nodes/node-u/heartbeat", token="agent", body={
        "gpus": [{"uuid": "GPU-node-u-0", "memory_used": 75 * GiB, "memory_unattributed": 75 * GiB}]})
    assert status == 200
    with pytest.raises(GPUPoolError) as refused:
        service.client().create_lease(LeaseRequest(fraction=0.25))
    assert refused.value.extra["reasons"] == {
        "not enough free memory": 1, "whole GPUs only on its node (its enforcement mode does not share a GPU)": 1}
    assert all_leases(service) == []


def test_a_lease_written_behind_the_services_back_is_not_overbooked(service):
    """The service decides on an in-memory view of the pool; a lease another
    writer put in the store meanwhile is seen when the decision is checked
    against the store, and the request goes elsewhere (the log says so)."""
    from datetime import datetime, timezone

    from gpupool.hub_plugin.db import Store
    from gpupool.hub_plugin.models import Lease, LeaseGPU

    register(service, "node-s", gpus=2)
    first = service.client().create_lease(LeaseRequest(fraction=0.25))  # the view now exists
    assert first.gpus[0]["uuid"] == "GPU-node-s-0"
    store, now = Store(f"sqlite:///{service.state_dir}/gpupool.sqlite"), datetime.now(timezone.utc)
    with store.write() as session:
        session.add(Lease(id="L-0000000000cc", owner="other", state="active", fraction=1.0, gpu_count=1,
                          memory=70 * GiB, node_name="node-s", idle_timeout=1800, heartbeat_ttl=60,
                          created_at=now, started_at=now, usage_gpu_seconds=0.0, groups=[],
                          gpus=[LeaseGPU(gpu_uuid="GPU-node-s-1", name="A100", index=1)]))
    store.close()
    # GPU 1 still looks idle to the view: the one place a whole GPU fits.
    with pytest.raises(GPUPoolError) as refused:
        service.client().create_lease(LeaseRequest(fraction=1.0))
    assert refused.value.code == "pool_full"
    assert "disagreed with the store on GPU-node-s-1" in service.log.read_text()
    assert [lease["id"] for lease in all_leases(service)] == [first.id]  # ours; "other" is not ours to see


def register_t4(service, name: str, url: str | None = None) -> None:
    """Register ``name`` with one T4 (its agent ``service.silent_url`` unless given)."""
    body = {"name": name, "url": url or service.silent_url, "inventory": "simulated", "enforcement": "none",
            "whole_gpus": False, "workers": [], "gpus": [{"uuid": f"GPU-{name}-0", "name": "Tesla T4", "index": 0,
                                                          "memory_total": 16 * GiB, "memory_reserved": 0}]}
    assert http(service, "POST", "/nodes", body, token="agent")[0] == 200


def test_pool_full_says_why(service):
    register(service, "node-1", gpus=2)
    register_t4(service, "node-t")
    taken = service.client().create_lease(LeaseRequest(fraction=1.0, model="T4"))  # starting: its agent is silent
    with pytest.raises(GPUPoolError) as refused:
        service.client().create_lease(LeaseRequest(fraction=0.5, model="T4"))
    assert (refused.value.status, refused.value.code) == (409, "pool_full")
    assert refused.value.message == ("no GPU can take 0.50 of model T4 now: 3 GPUs in the pool, the most free "
                                     "is 1.00 (node-1 GPU 0, NVIDIA A100-SXM4-80GB); 2 GPUs ruled out: "
                                     "model mismatch; 1 GPU ruled out: not enough free fraction")
    assert refused.value.extra["reasons"] == {"model mismatch": 2, "not enough free fraction": 1}
    assert [lease["id"] for lease in all_leases(service)] == [taken.id]


@pytest.mark.parametrize("wait", [None, 60])
def test_a_model_the_pool_has_none_of_is_refused_at_once(service, wait):
    """No wait brings a GPU of a model no node has: 400 saying the pool's models, nothing queued."""
    register(service, "node-1", gpus=2)
    register_t4(service, "node-t")
    body = assert_error(http(service, "POST", "/leases", {"fraction": 0.5, "model": "H100", "wait": wait}),
                        400, "bad_request")
    assert body["message"] == ("the pool has no GPU of model H100; its models: NVIDIA A100-SXM4-80GB, Tesla T4; "
                               "ask for one of those (--model matches any part of the name), or for no model")
    assert body["limit"] == "model"
    assert all_leases(service) == [] and gpu_allocations(service) == [0.0] * 3  # nothing queued or held


def test_whole_gpus_count_on_every_registered_node_lost_or_not():
    from gpupool.hub_plugin.admission import more_gpus_than_any_node
    from gpupool.hub_plugin.rules.scheduler import Demand, GPUState
    gpus = [GPUState(f"{node}-{i}", node, name, i, 80 * GiB, 79 * GiB, node_up=node != "lost")
            for node, count, name in (("a", 2, "A100"), ("lost", 4, "A100"), ("t", 3, "T4")) for i in range(count)]
    assert more_gpus_than_any_node(Demand(gpu_count=4), gpus) is None  # the lost node may come back
    assert "the biggest, lost, has 4 GPUs" in more_gpus_than_any_node(Demand(gpu_count=5), gpus)
    assert more_gpus_than_any_node(Demand(gpu_count=4, model="t4"), gpus) == (
        "4 whole GPUs of model t4 is more than any node has (a lease's GPUs are all on one node): the biggest, t, "
        "has 3 GPUs of model t4; ask for at most 3")
    assert more_gpus_than_any_node(Demand(gpu_count=2, model="H100"), gpus) is None  # the scheduler says why
    assert more_gpus_than_any_node(Demand(gpu_count=9), []) is None  # empty: a node may yet register


def test_a_model_counts_on_every_registered_node_lost_or_not():
    from gpupool.hub_plugin.admission import no_gpu_of_model
    from gpupool.hub_plugin.rules.scheduler import Demand, GPUState
    gpus = [GPUState("a-0", "a", "NVIDIA A100-SXM4-80GB", 0, 80 * GiB, 79 * GiB),
            GPUState("t-0", "t", "Tesla T4", 0, 16 * GiB, 15 * GiB, node_up=False)]
    assert no_gpu_of_model(Demand(model="t4"), gpus) is None  # the lost node may come back: the queue may wait
    assert no_gpu_of_model(Demand(model="a100"), gpus) is None and no_gpu_of_model(Demand(), gpus) is None
    assert no_gpu_of_model(Demand(model="H100"), gpus) == (
        "the pool has no GPU of model H100; its models: NVIDIA A100-SXM4-80GB, Tesla T4; ask for one of those "
        "(--model matches any part of the name), or for no model")
    assert no_gpu_of_model(Demand(model="H100"), []) is None  # empty: a node may yet register


@pytest.mark.parametrize("wait", [None, 60])
def test_more_whole_gpus_than_any_node_has_are_refused_at_once(service, wait):
    register(service, "node-1", gpus=2)
    register(service, "node-2", gpus=1)
    reply = http(service, "POST", "/leases", {"gpu_count": 3, "wait": wait})
    body = assert_error(reply, 400, "bad_request")
    assert body["message"] == ("3 whole GPUs is more than any node has (a lease's GPUs are all on one node): the "
                               "biggest, node-1, has 2 GPUs; ask for at most 2")
    assert all_leases(service) == [] and gpu_allocations(service) == [0.0] * 3  # nothing queued or held


def test_a_count_above_the_wire_bound_names_the_biggest_node_where_there_is_one(service):
    """The wire takes at most 64 whole GPUs; above that a pool of smaller nodes says its own limit,
    as for any count no node has (what to ask for), the other fields checked as ever; an empty
    pool, which no node's size bounds yet, says the wire's."""
    assert assert_error(http(service, "POST", "/leases", {"gpu_count": 99}), 400, "bad_request")["message"] == \
        "'gpu_count' must be a whole number from 1 to 64, got 99"
    register(service, "node-1", gpus=2)
    for count in (99, 99.0, 65):
        body = assert_error(http(service, "POST", "/leases", {"gpu_count": count, "wait": 60}), 400, "bad_request")
        assert body["message"] == (f"{int(count)} whole GPUs is more than any node has (a lease's GPUs are all on one "
                                   "node): the biggest, node-1, has 2 GPUs; ask for at most 2")
        assert body["limit"] == "gpu_count"
    body = assert_error(http(service, "POST", "/leases", {"gpu_count": 99, "idle_timeout": 0}), 400, "bad_request")
    assert body["message"].startswith("'idle_timeout' must be seconds from 1 to"), body
    assert all_leases(service) == [] and gpu_allocations(service) == [0.0] * 2  # nothing queued or held


def test_gpu_memory_counts_every_registered_gpu_of_the_model():
    from gpupool.hub_plugin.admission import more_memory_than_any_gpu
    from gpupool.hub_plugin.rules.scheduler import Demand, GPUState
    gpus = [GPUState("a-0", "a", "A100", 0, 80 * GiB, 79 * GiB), GPUState("t-0", "t", "T4", 0, 16 * GiB, 15 * GiB,
                                                                          node_up=False)]
    assert more_memory_than_any_gpu(Demand(memory=79 * GiB), gpus) is None
    assert more_memory_than_any_gpu(Demand(memory=80 * GiB), gpus) == (
        "80.0 GiB of GPU memory is more than any GPU offers: the largest, A100 on a, lets a lease have 79.0 GiB; "
        "ask for at most that (--memory)")
    assert "any GPU of model t4 offers: the largest, T4 on t" in more_memory_than_any_gpu(
        Demand(memory=16 * GiB, model="t4"), gpus)  # a lost node's GPUs count: it may come back
    assert more_memory_than_any_gpu(Demand(memory=2**40, model="H100"), gpus) is None  # the scheduler says why
    assert more_memory_than_any_gpu(Demand(), gpus) is None and more_memory_than_any_gpu(Demand(memory=1), []) is None


@pytest.mark.parametrize("wait", [None, 60])
def test_more_gpu_memory_than_any_gpu_has_is_refused_at_once(service, wait):
    register(service, "node-1", gpus=2)
    body = assert_error(http(service, "POST", "/leases", {"fraction": 0.5, "memory": 81 * GiB, "wait": wait}),
                        400, "bad_request")
    assert body["message"].startswith("81.0 GiB of GPU memory is more than any GPU offers") and body["limit"] == "memory"
    assert all_leases(service) == [] and gpu_allocations(service) == [0.0] * 2  # nothing queued or held


def test_refusals_by_the_pools_hardware_count_under_their_own_codes_not_as_quotas(service):
    """No quota is set: a request no node or GPU could ever take (the 400 naming the biggest) counts as the misfit
    that rules out even the biggest node, as docs/api.md lists them, never as ``quota_*`` (a new-user trial)."""
    body = {"name": "node-h", "url": service.silent_url, "inventory": "simulated", "enforcement": "none",
            "whole_gpus": False, "workers": [], "host_cpus": 8.0, "host_memory": 64 * GiB,
            "gpus": [{"uuid": f"GPU-h-{i}", "name": "NVIDIA A100-SXM4-80GB", "index": i, "memory_total": 80 * GiB,
                      "memory_reserved": 0} for i in range(2)]}
    assert http(service, "POST", "/nodes", body, token="agent")[0] == 200
    asks = {"few_on_node": ({"gpu_count": 3}, "gpu_count"), "no_memory": ({"fraction": 0.5, "memory": 100 * GiB}, "memory"),
            "model_mismatch": ({"fraction": 0.5, "model": "H100"}, "model"),
            "no_host_cpus": ({"fraction": 0.5, "cpus": 64}, "cpus"),
            "no_host_memory": ({"fraction": 0.5, "host_memory": 128 * GiB}, "host_memory")}
    for ask, limit in asks.values():
        assert assert_error(http(service, "POST", "/leases", ask), 400, "bad_request")["limit"] == limit
    status, text = http(service, "GET", "/metrics", prefix="")
    assert status == 200
    counted = dict(re.findall(r'^gpupool_lease_refusals_total\{reason="(\w+)"\} (\S+)$', text, re.M))
    assert {code: n for code, n in counted.items() if n != "0.0"} == {code: "1.0" for code in asks}, counted
    assert all_leases(service) == []


def test_metrics(service):
    assert_error(http(service, "GET", "/metrics", token=None, prefix=""), 401, "unauthorized")
    register(service, "node-m", gpus=1)
    service.client().create_lease(LeaseRequest(fraction=0.25))
    with pytest.raises(GPUPoolError):
        service.client().create_lease(LeaseRequest(fraction=1.0))
    status, text = http(service, "GET", "/metrics", prefix="")
    assert status == 200
    assert re.search(r'gpupool_gpu_allocated_ratio\{[^}]*node="node-m"[^}]*\} 0\.25', text)
    assert re.search(r'gpupool_gpu_allocated_memory_bytes\{[^}]*node="node-m"[^}]*\} [1-9]', text)
    assert 'gpupool_leases{state="starting"} 1.0' in text or 'gpupool_leases_ended_total{state="failed"} 1.0' in text
    assert 'gpupool_lease_refusals_total{reason="no_fraction"} 1.0' in text  # a code, not the words
    assert 'gpupool_nodes{node="node-m",state="up"} 1.0' in text


def test_metrics_of_a_fresh_service_list_every_refusal_reason_at_zero_and_no_created_series(service):
    """Before the first refusal each reason the service counts has its series at 0, as parks do, so
    ``increase()`` sees the first one after a restart; and no ``NAME_created`` series, which docs/api.md
    does not list (prometheus_client adds one per counter and histogram)."""
    from gpupool.hub_plugin.metrics import REFUSAL_REASONS
    from gpupool.hub_plugin.rules.misfits import Misfit

    status, text = http(service, "GET", "/metrics", prefix="")
    assert status == 200
    counted = dict(re.findall(r'^gpupool_lease_refusals_total\{reason="(\w+)"\} (\S+)$', text, re.M))
    assert counted == {reason: "0.0" for reason in REFUSAL_REASONS}, counted
    assert {*map(str, Misfit), "quota_max_gpus", "quota_gpu_hours_per_day", "quota_max_active_per_user"} <= set(counted)
    assert "_created" not in text, [line for line in text.splitlines() if "_created" in line]
    assert 'gpupool_parks_total{reason="idle",tier="memory"} 0.0' in text  # the counters themselves are there
    assert "gpupool_queue_wait_seconds_count 0.0" in text and "gpupool_resume_seconds_count 0.0" in text


def test_lost_node_takes_no_new_leases(tmp_path):
    svc = start_service(tmp_path, config={"node_ttl": 0.5})
    try:
        register(svc, "node-l", gpus=1, url="http://127.0.0.1:9")
        wait_for(lambda: svc.client().pool()["nodes"][0]["state"] == "lost", 10, "node marked lost")
        with pytest.raises(GPUPoolError, match="1 GPU ruled out: node lost"):
            svc.client().create_lease(LeaseRequest(fraction=0.5))
        with pytest.raises(GPUPoolError, match="1 GPU ruled out: node lost"):  # its model is the pool's still
            svc.client().create_lease(LeaseRequest(fraction=0.5, model="A100"))
        with pytest.raises(GPUPoolError, match="the pool has no GPU of model H100; its models: NVIDIA A100"):
            svc.client().create_lease(LeaseRequest(fraction=0.5, model="H100"))
        assert http(svc, "POST", "/nodes/node-l/heartbeat", {}, token="agent")[0] == 200
        assert svc.client().pool()["nodes"][0]["state"] == "up"
    finally:
        svc.stop()


# -- with a real agent and workers ------------------------------------------------------------------------------

def test_lease_lifecycle(pool):
    svc, agent = pool
    lease = svc.client().create_lease(LeaseRequest(fraction=0.5, kernel_id="k-1"))
    assert (lease.state, lease.node, lease.fraction, lease.owner) == (LeaseState.starting, "node-1", 0.5, "tester")
    assert re.fullmatch(r"L-[0-9a-f]{12}", lease.id) and lease.connection is None
    lease = wait_state(svc, lease.id, "starting")
    assert lease.state is LeaseState.active, lease.reason
    assert lease.worker["pid"] > 0 and lease.connection["key"] and lease.connection["shell_port"]
    gpu0 = svc.client().pool()["nodes"][0]["gpus"][0]
    assert gpu0["memory_usable"] <= gpu0["memory_total"] - 512 * 1024**2  # the context overhead is kept back
    assert lease.memory == int(0.5 * gpu0["memory_usable"])
    assert gpu_allocations(svc) == [0.5, 0.0]
    # Listing: own leases, by kernel.
    client = svc.client()
    assert [x.id for x in client.list_leases()] == [lease.id]
    assert [x.id for x in client.list_leases(kernel_id="k-1")] == [lease.id]
    assert client.list_leases(kernel_id="k-2") == []
    assert client.heartbeat(lease.id).state is LeaseState.active
    # Release: usage recorded, every transition kept, capacity freed; idempotent.
    time.sleep(0.5)
    ended = client.release(lease.id, reason="done for today")
    assert (ended.state, ended.reason) == (LeaseState.released, "released by its owner: done for today")
    assert ended.usage_gpu_seconds > 0.2 and ended.ended_at and ended.connection is None
    assert [e["state"] for e in ended.events] == ["starting", "active", "releasing", "released"]
    assert gpu_allocations(svc) == [0.0, 0.0]
    again = client.release(lease.id)
    assert (again.state, again.usage_gpu_seconds, again.ended_at) == (ended.state, ended.usage_gpu_seconds,
                                                                     ended.ended_at)
    assert client.heartbeat(lease.id).state is LeaseState.released
    assert client.list_leases() == [] and [x.id for x in client.list_leases(active=False)] == [lease.id]
    wait_for(lambda: not _agent_workers(svc, agent), 10, "worker gone from the agent")


def test_start_wait_answers_the_started_lease_with_its_connection(pool):
    """``POST /leases?start_wait=`` (what %gpu acquire sends): the answer is the lease once its worker
    started, no long poll needed; without the argument it is ``starting`` at once, as before."""
    svc, agent = pool
    lease = svc.client().create_lease(LeaseRequest(fraction=0.5), start_wait=60)  # at most 10 s are waited
    assert lease.state is LeaseState.active, lease.reason
    assert lease.worker["pid"] > 0 and lease.connection["key"] and lease.connection["shell_port"]
    assert [e["state"] for e in lease.events] == ["starting", "active"]
    svc.client().release(lease.id)


def test_a_listing_of_ended_leases_carries_no_connection_key(pool):
    """Only a lease that is active has a worker to reach: once ended (released, reclaimed for idle,
    failed) neither its own answer nor ``GET /leases?active=0`` carries its connection or HMAC key."""
    svc, agent = pool
    client = svc.client()
    keys = {}
    for idle in (None, 1.0):
        request = LeaseRequest(fraction=0.25, idle_timeout=idle, on_idle="release")  # reclaimed, not parked
        lease = wait_state(svc, client.create_lease(request).id, "starting")
        assert lease.state is LeaseState.active and lease.connection["key"], lease.reason
        keys[lease.id] = lease.connection["key"]
    released, idle = keys
    client.release(released)
    assert wait_ended(svc, idle, timeout=60).state is LeaseState.reclaimed
    kept = wait_state(svc, client.create_lease(LeaseRequest(fraction=0.25)).id, "starting")
    status, body = http(svc, "GET", "/leases?active=0")
    assert status == 200
    listed = {lease["id"]: lease for lease in body["leases"]}
    for lease_id, key in keys.items():
        assert listed[lease_id]["state"] in ("released", "reclaimed") and listed[lease_id]["connection"] is None
        assert key not in json.dumps(body), f"the key of ended lease {lease_id} is listed"
        status, one = http(svc, "GET", f"/leases/{lease_id}")
        assert status == 200 and key not in json.dumps(one)
    assert listed[kept.id]["connection"]["key"] == kept.connection["key"]  # the active one keeps its own
    client.release(kept.id)


def _agent_workers(svc, agent) -> list[dict[str, Any]]:
    request = urllib.request.Request(agent.url + "/workers")
    request.add_header("Authorization", f"token {svc.agent_token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["workers"]


def test_users_see_only_their_own_leases(tmp_path, users):
    agent = start_agent(tmp_path, users)
    try:
        lease = acquire(users, 0.25)
        for user in ("bob",):
            client = users.client(user)
            for call in (lambda: client.get_lease(lease.id), lambda: client.heartbeat(lease.id),
                         lambda: client.release(lease.id)):
                with pytest.raises(GPUPoolError) as denied:
                    call()
                assert (denied.value.status, denied.value.code) == (404, "not_found")
            assert client.list_leases(active=False) == []
        # An admin may look and release, but never gets the connection key.
        seen = users.client("ann").get_lease(lease.id)
        assert seen.state is LeaseState.active and seen.connection is None
        assert users.client().get_lease(lease.id).connection is not None
        ended = users.client("ann").release(lease.id)
        assert (ended.state, ended.reason) == (LeaseState.released, "released by admin ann")
    finally:
        agent.stop()


def test_release_while_starting_leaves_no_worker(pool):
    svc, agent = pool
    lease = svc.client().create_lease(LeaseRequest(fraction=0.5))
    ended = svc.client().release(lease.id)
    assert ended.state is LeaseState.released and ended.usage_gpu_seconds == 0
    assert gpu_allocations(svc) == [0.0, 0.0]
    time.sleep(3)  # long enough for the worker start to finish and be undone
    wait_for(lambda: not _agent_workers(svc, agent), 20, "the late worker stopped")
    assert svc.client().get_lease(lease.id).state is LeaseState.released


def test_a_worker_that_starts_too_slowly_fails_its_lease_and_is_stopped(tmp_path):
    """The service waits ``worker_start_timeout`` for a worker (a cold one takes
    seconds): past it the lease ends ``failed`` with the bound in its words, no
    usage is charged, the capacity comes back, and the late worker is stopped."""
    svc = start_service(tmp_path, config={"worker_start_timeout": 0.2})
    agent = start_agent(tmp_path, svc, extra_args=["--warm-workers=0"])
    try:
        lease = svc.client().create_lease(LeaseRequest(fraction=0.5))
        ended = wait_ended(svc, lease.id, timeout=30)
        assert ended.state is LeaseState.failed
        assert ended.reason.startswith("the worker could not start on node-1"), ended.reason
        assert "did not answer within 0.2s" in ended.reason, ended.reason  # the bound, named
        assert ended.usage_gpu_seconds == 0 and ended.started_at is None
        assert gpu_allocations(svc) == [0.0, 0.0]
        wait_for(lambda: not _agent_workers(svc, agent), 30, "the late worker stopped")
        wait_for(lambda: processes_mentioning(str(agent.state_dir)) == [agent.proc.pid], 30,
                 "no worker process left beside the agent")
    finally:
        agent.stop()
        svc.stop()


def test_whole_gpus(pool):
    svc, _ = pool
    lease = svc.client().create_lease(LeaseRequest(gpu_count=2))
    assert len(lease.gpus) == 2 and lease.fraction == 1.0
    lease = wait_state(svc, lease.id, "starting")
    assert lease.state is LeaseState.active, lease.reason
    with pytest.raises(GPUPoolError, match="2 GPUs ruled out: not enough free fraction"):
        svc.client().create_lease(LeaseRequest(fraction=0.1))
    ended = svc.client().release(lease.id)
    assert ended.usage_gpu_seconds > 0


def test_idle_lease_is_parked_or_reclaimed_as_it_asked(pool):
    """At its idle deadline a lease is parked in place (docs/parking.md); one asked with
    ``on_idle: release`` is reclaimed. Either way its share is back in the pool."""
    svc, _ = pool
    kept = acquire(svc, 0.5, idle_timeout=1)
    lease = acquire(svc, 0.5, idle_timeout=1, on_idle="release")
    lease = wait_ended(svc, lease.id, timeout=30)
    assert lease.state is LeaseState.reclaimed
    assert re.fullmatch(r"idle for \d+s \(idle timeout 1s\)", lease.reason), lease.reason
    kept = wait_state(svc, kept.id, "active", timeout=30)
    kept = wait_state(svc, kept.id, "parking", timeout=30) if kept.state is LeaseState.parking else kept
    assert kept.state is LeaseState.parked and re.match(r"idle for \d+s \(idle timeout 1s\)", kept.parked["reason"])
    assert gpu_allocations(svc) == [0.0, 0.0]
    status, text = http(svc, "GET", "/metrics", prefix="")
    assert status == 200 and re.search(r'gpupool_reclaims_total\{reason="idle"\} [1-9]', text)  # its code, kept


def test_lease_without_heartbeats_is_reclaimed(tmp_path):
    svc = start_service(tmp_path, config={"heartbeat_ttl": 1})
    agent = start_agent(tmp_path, svc)
    try:
        lease = acquire(svc, 0.5)
        assert lease.heartbeat_ttl == 1
        lease = wait_ended(svc, lease.id, timeout=30)
        assert lease.state is LeaseState.reclaimed
        assert lease.reason.startswith("the notebook kernel stopped sending heartbeats for "), lease.reason
        status, text = http(svc, "GET", "/metrics", prefix="")
        assert status == 200 and 'gpupool_reclaims_total{reason="heartbeat"} 1.0' in text
    finally:
        agent.stop()
        svc.stop()


def test_running_cell_is_never_reclaimed(tmp_path):
    from gpupool.remote import RemoteKernel

    svc = start_service(tmp_path, config={"heartbeat_ttl": 1})
    agent = start_agent(tmp_path, svc)
    try:
        lease = acquire(svc, 0.5, idle_timeout=1)
        # The notebook's own client (a CurveZMQ client of an encrypting worker); the cell is sent, not awaited.
        kernel = RemoteKernel(lease.connection)
        try:
            kernel.session.send(kernel.shell, "execute_request", {
                "code": "import time; time.sleep(6)", "silent": False, "store_history": True,
                "user_expressions": {}, "allow_stdin": False})
            # The notebook's heartbeat keeps the lease until the agent reports the cell; then it stops.
            wait_for(lambda: (svc.client().heartbeat(lease.id).worker or {}).get("execution_state") == "busy",
                     30, "the worker reported busy")
            time.sleep(3)  # well past both the idle timeout and the heartbeat TTL
            assert svc.client().get_lease(lease.id).state is LeaseState.active
            lease = wait_ended(svc, lease.id, timeout=30)
            assert lease.state is LeaseState.reclaimed
        finally:
            kernel.close()
    finally:
        agent.stop()
        svc.stop()


def test_dead_worker_fails_its_lease(pool):
    svc, _ = pool
    lease = acquire(svc, 0.5)
    os.kill(lease.worker["pid"], signal.SIGKILL)
    lease = wait_ended(svc, lease.id, timeout=30)
    assert lease.state is LeaseState.failed
    assert lease.reason == "the worker process was killed by signal 9 (SIGKILL)"
    assert gpu_allocations(svc) == [0.0, 0.0]


def test_leases_survive_a_service_restart(tmp_path):
    svc = start_service(tmp_path)
    agent = start_agent(tmp_path, svc)
    try:
        lease = acquire(svc, 0.5)
        assert svc.stop() == 0
        svc = start_service(tmp_path)
        kept = svc.client().get_lease(lease.id)
        assert kept.state is LeaseState.active and kept.connection == lease.connection
        assert gpu_allocations(svc) == [0.5, 0.0]
    finally:
        agent.stop()
        svc.stop()


def test_an_outage_longer_than_the_heartbeat_ttl_reclaims_nothing(tmp_path):
    svc = start_service(tmp_path, config={"heartbeat_ttl": 3.0})
    agent = start_agent(tmp_path, svc)
    try:
        lease = acquire(svc, 0.5)
        svc.client().heartbeat(lease.id)
        assert svc.stop() == 0
        time.sleep(4)  # longer than the TTL: no client could have reached the service
        svc = start_service(tmp_path, config={"heartbeat_ttl": 3.0})
        time.sleep(1)  # a few reclaim sweeps
        assert svc.client().heartbeat(lease.id).state is LeaseState.active
    finally:
        agent.stop()
        svc.stop()


# -- concurrency ---------------------------------------------------------------------------------------------------

def race(services, n: int = 100, fraction: float = 0.25) -> Counter:
    """``n`` threads ask for ``fraction`` at the same moment, spread over
    ``services`` (one or several sharing a store); counts outcomes."""
    barrier = threading.Barrier(n)
    outcomes: Counter = Counter()
    lock = threading.Lock()

    def ask(svc) -> None:
        client = svc.client()
        barrier.wait()
        try:
            client.create_lease(LeaseRequest(fraction=fraction))
            outcome = "granted"
        except GPUPoolError as exc:
            outcome = exc.code
        with lock:
            outcomes[outcome] += 1

    threads = [threading.Thread(target=ask, args=(services[i % len(services)],)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return outcomes


def assert_exactly_full(svc, outcomes: Counter) -> None:
    """Two GPUs take eight 0.25 slices: eight granted, the rest refused, none over."""
    assert outcomes == Counter({"granted": 8, "pool_full": 92})
    assert gpu_allocations(svc) == [1.0, 1.0]
    leases = svc.client().list_leases()
    assert len(leases) == 8
    per_gpu = Counter(lease.gpus[0]["uuid"] for lease in leases)
    assert sorted(per_gpu.values()) == [4, 4]


def test_concurrent_requests_never_overallocate(pool):
    svc, _ = pool
    assert_exactly_full(svc, race([svc]))


def test_concurrent_requests_never_overallocate_on_postgresql(tmp_path, postgres_url):
    svc = start_service(tmp_path, config={"db_url": postgres_url})
    agent = start_agent(tmp_path, svc)
    try:
        assert_exactly_full(svc, race([svc]))
    finally:
        agent.stop()
        svc.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_store(request, tmp_path):
    """A store URL that two services share."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/shared.sqlite"
    return request.getfixturevalue("postgres_url")


def test_a_second_service_on_the_same_store_is_refused_until_the_first_stops(tmp_path, shared_store):
    """Each service decides in memory too (its queue, the nodes it clears): a second one on a store
    another serves, from a state directory of its own, is refused in one line, and starts once the
    first has stopped (PostgreSQL: an advisory lock of the first's session; SQLite: a lock file)."""
    import subprocess
    import sys

    config = {"db_url": shared_store}
    first = start_service(tmp_path / "a", config=config)
    try:
        (tmp_path / "b").mkdir()
        (tmp_path / "b" / "gpupool_config.py").write_text(f"c.GPUPool.db_url = {shared_store!r}\n")
        second = subprocess.run([sys.executable, "-m", "gpupool.cli", "service", "--port=0",
                                 f"--state-dir={tmp_path / 'b' / 'service'}",
                                 f"--config={tmp_path / 'b' / 'gpupool_config.py'}"],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr
        assert "another gpupool service serves the store at " in second.stderr, second.stderr
        assert http(first, "GET", "/health", token=None)[0] == 200  # the first one is untouched
    finally:
        first.stop()
    again = start_service(tmp_path / "b", config=config)
    try:
        assert again.client().list_leases() == []
    finally:
        again.stop()


def test_a_store_a_newer_gpupool_upgraded_is_refused_in_one_line(tmp_path):
    """Rolled back after a schema upgrade, the service finds a revision it does not know: one line
    naming it, the newest this gpupool knows and the way out (exit 1), and the store is left as it was."""
    import subprocess
    import sys

    from alembic.script import ScriptDirectory
    from sqlalchemy import text

    from gpupool.hub_plugin.db import Store
    from gpupool.hub_plugin.migrations import config

    url = f"sqlite:///{tmp_path}/store.sqlite"
    store = Store(url)
    store.migrate()
    with store.engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    (tmp_path / "gpupool_config.py").write_text(f"c.GPUPool.db_url = {url!r}\n")
    done = subprocess.run([sys.executable, "-m", "gpupool.cli", "service", "--port=0",
                           f"--state-dir={tmp_path / 'service'}", f"--config={tmp_path / 'gpupool_config.py'}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    newest = ScriptDirectory.from_config(config()).get_current_head()
    refusal = [line for line in done.stderr.splitlines() if line.startswith("gpupool service:")]
    assert len(refusal) == 1 and done.stderr.endswith(refusal[0] + "\n"), done.stderr
    assert (f"the store's schema is at revision 9999, which this gpupool does not know; the newest it knows is "
            f"{newest}. A newer gpupool upgraded it: run that release, or restore the database backup taken before "
            "the upgrade") in refusal[0] and "check c.GPUPool.db_url" not in refusal[0], done.stderr
    with store.engine.connect() as connection:
        assert connection.execute(text("SELECT version_num FROM alembic_version")).scalar() == "9999"
    store.close()


# -- the store itself ------------------------------------------------------------------------------------------------

@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    """A migrated :class:`~gpupool.hub_plugin.db.Store` with one node and one GPU."""
    from datetime import datetime, timezone

    from gpupool.hub_plugin.db import Store
    from gpupool.hub_plugin.models import GPU, Node

    url = f"sqlite:///{tmp_path}/store.sqlite" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    store = Store(url)
    store.migrate()
    now = datetime.now(timezone.utc)
    with store.write() as session:
        session.add(Node(name="n", url="http://127.0.0.1:9", inventory="simulated", state="up",
                         registered_at=now, last_heartbeat_at=now,
                         gpus=[GPU(uuid="G-0", name="L4", index=0, memory_total=GiB, memory_reserved=0, healthy=True)]))
    yield store
    store.close()


def test_migrations_match_the_models(store):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from gpupool.hub_plugin.models import Base

    store.migrate()  # again: a no-op
    with store.engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []


def test_capacity_decisions_are_serialized(store):
    """A second capacity decision waits until the first has committed, in
    another connection as in another process."""
    from sqlalchemy import select

    from gpupool.hub_plugin.models import GPU

    holding = threading.Event()
    order: list[str] = []

    def first() -> None:
        with store.write() as session:
            store.lock_capacity(session)
            session.execute(select(GPU)).all()
            holding.set()
            time.sleep(0.5)
            order.append("first committed")

    def second() -> None:
        holding.wait(10)
        with store.write() as session:
            store.lock_capacity(session)
            order.append("second decided")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert order == ["first committed", "second decided"]


def test_an_agent_that_refuses_connections_makes_its_node_lost_at_once(service):
    """A worker start whose agent refuses the connection (nothing listens: the agent is not running,
    though its node has not yet passed node_ttl) fails that lease with the words, and the node is
    ``lost`` at once, so the next request is not sent there; its next heartbeat brings it back."""
    from procs import free_port

    gone = f"http://127.0.0.1:{free_port()}"
    register(service, "node-gone", url=gone)
    client = service.client()
    first = wait_ended(service, client.create_lease(LeaseRequest(fraction=0.5)).id)
    assert first.state == LeaseState.failed, first
    assert first.reason.startswith(f"the worker could not start on node-gone: the node agent at {gone}/workers "
                                   "could not be reached"), first.reason
    node, = [n for n in client.pool()["nodes"] if n["name"] == "node-gone"]
    assert (node["state"], node["state_reason"]) == (
        "lost", f"its agent at {gone} refused a connection (it is not running)"), node
    with pytest.raises(GPUPoolError) as refused:
        client.create_lease(LeaseRequest(fraction=0.5))
    assert refused.value.status == 409, refused.value.message
    assert http(service, "POST", "/nodes/node-gone/heartbeat", {"workers": []}, token="agent")[0] == 200
    assert [n["state"] for n in client.pool()["nodes"] if n["name"] == "node-gone"] == ["up"]
