"""The bodies between the service and its agents (gpupool.wire): each end
reads what the other writes, older shapes still parse, bad fields are named."""

import pytest

from gpupool.errors import GPUPoolError
from gpupool.wire.leases import LeaseRequest
from gpupool.wire.nodes import (GPUInfo, GPUReading, Heartbeat, HeartbeatReply, NodeRegistration, RegistrationReply,
                                WorkerEnvironment, WorkerReport)
from gpupool.wire.parking import CheckpointerInfo, ParkRequest, WorkerParked, WorkerResumed
from gpupool.wire.quotas import Limits
from gpupool.wire.workers import WorkerRequest, WorkerStarted, WorkerStopped

GPU = GPUInfo("GPU-1", "A100", 0, 80 * 2**30, 2**30, "8.0")


def registration(**changes):
    body = NodeRegistration("n1", "http://10.0.0.5:8766", "nvml", "mps", False, (GPU,),
                            (WorkerReport("L-1", 42, "idle", "2026-01-01T00:00:00Z"),), None,
                            (WorkerEnvironment("default", "/usr/bin/python3", True, True),), 16.0, 2**36,
                            checkpointer=CheckpointerInfo("simulated", True, True), parked_memory=2**35).to_json()
    return {**body, **changes}


def test_a_registration_reads_back_as_written():
    body = registration()
    assert list(body) == ["name", "url", "inventory", "enforcement", "whole_gpus", "gpus", "workers",
                          "inventory_error", "environments", "host_cpus", "host_memory", "checkpointer", "parked_memory"]
    assert NodeRegistration.from_json(body).to_json() == body


def test_a_registration_names_a_bad_checkpointer_or_budget():
    for change, words in (({"checkpointer": {"mid_cell": True}}, "'checkpointer.name'"),
                          ({"checkpointer": "simulated"}, "'checkpointer' must be an object"),
                          ({"parked_memory": 1.5}, "'parked_memory'"), ({"parked_memory": -1}, "'parked_memory'")):
        with pytest.raises(GPUPoolError) as caught:
            NodeRegistration.from_json(registration(**change))
        assert caught.value.status == 400 and words in caught.value.message, change


def test_park_bodies_read_back_and_answers_are_lenient():
    request = ParkRequest("idle for 30m", "disk", "freeze", 2**20)
    assert ParkRequest.from_json(request.to_json()) == request
    assert ParkRequest.from_json({}) == ParkRequest("", "memory", "refuse", None)
    with pytest.raises(GPUPoolError, match="'running_cell'"):
        ParkRequest.from_json({"running_cell": "kill"})
    for bad in (-1, 1.5, "1MiB", True):
        with pytest.raises(GPUPoolError, match="'max_host_bytes'"):
            ParkRequest.from_json({"max_host_bytes": bad})
    parked = WorkerParked("disk", "simulated", 0, 2**20, 3 * 2**30, 0, False, ("a lock",), 0.25, "over the quota")
    assert WorkerParked.from_json(parked.to_json()) == parked
    assert WorkerParked.from_json({"tier": "disk", "host_bytes": "lots", "lost": ["x", 3]}).lost == ("x",)
    with pytest.raises(ValueError, match="'tier'"):
        WorkerParked.from_json({"host_bytes": 1})
    resumed = WorkerResumed(42, {"key": "k"}, "disk", 1.5, ("generator gen",))
    assert WorkerResumed.from_json(resumed.to_json()) == resumed
    with pytest.raises(ValueError, match="'connection'"):
        WorkerResumed.from_json({"pid": 1})


def test_a_worker_report_says_its_park_tier():
    report = WorkerReport("L-1", 42, "idle", parked="disk", parked_host_bytes=0, parked_lost=("a generator",))
    assert WorkerReport.from_json(report.to_json()) == report
    assert WorkerReport.from_json({"lease_id": "L-1", "execution_state": "idle", "parked": "attic"}).parked is None


def test_a_registration_without_the_optional_fields_parses():
    old = {"name": "n1", "url": "http://n1:8766/", "inventory": "simulated", "enforcement": "exclusive",
           "gpus": [GPU.to_json() | {"healthy": False}], "surprise": 1}
    node = NodeRegistration.from_json(old)
    assert (node.url, node.whole_gpus, node.environments, node.host_cpus) == ("http://n1:8766", False, None, None)
    assert node.healthy == {"GPU-1": False}
    assert node.to_json()["gpus"][0]["healthy"] is False


@pytest.mark.parametrize("change, words", [
    ({"name": "a/b"}, "'name'"), ({"url": "ftp://x"}, "'url'"), ({"inventory": "magic"}, "'inventory'"),
    ({"whole_gpus": "yes"}, "'whole_gpus'"), ({"gpus": None}, "'gpus' must be a list"),
    ({"host_cpus": None}, "'host_cpus'"), ({"environments": [{"name": "x"}]}, "'name' and 'python'"),
    ({"inventory_error": ""}, "'inventory_error'"),
])
def test_a_bad_registration_names_the_field(change, words):
    with pytest.raises(GPUPoolError) as caught:
        NodeRegistration.from_json(registration(**change))
    assert caught.value.status == 400 and words in caught.value.message


def test_a_heartbeat_reads_back_and_leaves_out_unknown_readings():
    reading = {"uuid": "GPU-1", "memory_used": 5, "utilization": 37, "healthy": True, "memory_unattributed": 0}
    beat = Heartbeat((WorkerReport("L-1", None, "dead", exit_code=-9),),
                     (GPUReading.of(reading), GPUReading.of({"uuid": "GPU-2", "memory_used": None,
                                                             "utilization": None})), None)
    body = beat.to_json()
    assert body["gpus"] == [reading, {"uuid": "GPU-2", "memory_used": None, "utilization": None}]
    assert Heartbeat.from_json(body).gpus[0] == GPUReading("GPU-1", 5, 37.0, True, 0)
    with pytest.raises(GPUPoolError, match="'utilization'"):
        Heartbeat.from_json({"gpus": [{"uuid": "GPU-1", "utilization": 101}]})


def test_the_agent_reads_the_services_answers_leniently():
    assert RegistrationReply.from_json(RegistrationReply("n1", 2.5, ("L-1",)).to_json()) == \
        RegistrationReply("n1", 2.5, ("L-1",))
    assert RegistrationReply.from_json({"heartbeat_interval": -1, "stop": "L-1"}) == RegistrationReply("", 5.0, ())
    assert HeartbeatReply.from_json({"stop": ["L-1", 7]}).stop == ("L-1",)
    assert HeartbeatReply.from_json(None).stop == ()


def test_a_worker_request_keeps_its_shape():
    request = WorkerRequest("L-1", "ann", ("GPU-1",), 0.5, 2**30, cpus=2, env="torch")
    body = request.to_json()
    assert body == {"lease_id": "L-1", "owner": "ann", "gpus": ["GPU-1"], "fraction": 0.5, "memory": 2**30,
                    "cpus": 2, "env": "torch"}
    assert WorkerRequest.from_json(body) == request
    assert WorkerRequest.from_json({"lease_id": "L-1", "owner": "ann", "gpus": ["GPU-1"]}).memory is None


def test_a_resume_names_the_agent_holding_the_spill_only_when_it_moves_one():
    moved = WorkerRequest("L-1", "ann", ("GPU-1",), spill_from="https://node-1.example:8080")
    assert moved.to_json()["spill_from"] == "https://node-1.example:8080"
    assert WorkerRequest.from_json(moved.to_json()) == moved
    assert "spill_from" not in WorkerRequest("L-1", "ann", ("GPU-1",)).to_json()
    assert WorkerRequest.from_json({"lease_id": "L-1", "owner": "ann", "gpus": ["GPU-1"],
                                    "spill_from": None}).spill_from is None


@pytest.mark.parametrize("change, words", [
    ({"owner": ""}, "'lease_id' and 'owner'"), ({"gpus": []}, "'gpus'"), ({"fraction": True}, "'fraction'"),
    ({"memory": 1.5}, "'memory'"), ({"cpus": "2"}, "'cpus'"), ({"host_memory": True}, "'host_memory'"),
    ({"env": 3}, "'env'"), ({"spill_from": "ftp://node-1"}, "'spill_from' must be the http:// or https://"),
    ({"spill_from": "http://"}, "'spill_from'"), ({"spill_from": "http://node 1:8080"}, "'spill_from'"),
    ({"spill_from": 8080}, "'spill_from'"),
])
def test_a_bad_worker_request_names_the_field(change, words):
    body = {"lease_id": "L-1", "owner": "ann", "gpus": ["GPU-1"], **change}
    with pytest.raises(GPUPoolError) as caught:
        WorkerRequest.from_json(body)
    assert caught.value.status == 400 and words in caught.value.message


def test_the_service_reads_the_agents_answers():
    started = WorkerStarted(123, {"ip": "10.0.0.5", "key": "k"})
    assert WorkerStarted.from_json(started.to_json()) == started
    assert WorkerStarted.from_json({"pid": "x", "connection": {}}).pid is None
    with pytest.raises(ValueError):
        WorkerStarted.from_json({"pid": 1})
    assert WorkerStopped.from_json(WorkerStopped("L-1", -9).to_json()) == WorkerStopped("L-1", -9)
    assert WorkerStopped.from_json({"exit_code": "0"}).exit_code is None


# -- type confusions: a float for a count or bytes, anything but true/false for a flag --------------------------------

#: Every body the service or an agent reads from the other side or from a client.
READ_BODIES = (LeaseRequest, GPUInfo, NodeRegistration, WorkerEnvironment, CheckpointerInfo, WorkerReport, GPUReading,
               ParkRequest, WorkerRequest, Limits)


def _strict_fields(json_type: str):
    for body in READ_BODIES:
        for key, spec in (body.specs() | body.EXTRA).items():
            if spec.type == json_type and not spec.lenient:  # lenient: read as null by design (an agent's readings)
                yield pytest.param(spec, key, id=f"{body.__name__}.{key}")


@pytest.mark.parametrize("spec, key", list(_strict_fields("integer")))
def test_every_integer_field_refuses_a_fraction_a_flag_and_text(spec, key):
    for bad in (1.5e9 + 0.5, 2.5, float("inf"), True, "3"):
        with pytest.raises(GPUPoolError) as caught:
            spec.read({key: bad}, key, {"uuid": "GPU-x"})
        assert caught.value.status == 400 and key in caught.value.message, (bad, caught.value.message)
    if spec.nullable:
        assert spec.read({key: None}, key) is None  # null where the field says so stays allowed


@pytest.mark.parametrize("spec, key", list(_strict_fields("boolean")))
def test_every_boolean_field_refuses_anything_but_true_or_false(spec, key):
    for bad in (1, 0, "true", "false", 0.0, [], {}):
        with pytest.raises(GPUPoolError) as caught:
            spec.read({key: bad}, key, {"uuid": "GPU-x"})
        assert caught.value.status == 400 and key in caught.value.message, (bad, caught.value.message)
    assert spec.read({key: True}, key) is True and spec.read({key: False}, key) is False
    if spec.nullable:
        assert spec.read({key: None}, key) is None


@pytest.mark.parametrize("body, words", [
    ({"fraction": 0.5, "memory": 1.5e9 + 0.5}, "'memory' must be a whole number of bytes"),
    ({"host_memory": 2.0**31 + 0.25}, "'host_memory' must be a whole number of bytes"),
    ({"gpu_count": 2.5}, "'gpu_count' must be a whole number"),
    # below the 1 MiB minimum: said so, not the range (which reads as if 1 byte were in it)
    ({"host_memory": 1}, "'host_memory' of 1 byte is below the minimum of 1 MiB (1048576 bytes)"),
    ({"fraction": 0.5, "memory": 1024.0}, "'memory' of 1024 bytes is below the minimum of 1 MiB (1048576 bytes)"),
    ({"host_memory": 0}, "'host_memory' must be a whole number of bytes from 1048576 (1 MiB) to 2**50 (more than "
                         "zero), got 0"),
])
def test_a_lease_request_with_a_fraction_for_an_integer_is_refused_in_words(body, words):
    with pytest.raises(GPUPoolError) as caught:
        LeaseRequest.from_json(body)
    assert caught.value.status == 400 and words in caught.value.message


def test_a_whole_number_written_with_a_point_or_an_exponent_is_an_integer_as_json_schema_says():
    request = LeaseRequest.from_json({"fraction": 0.5, "memory": 1.5e9, "host_memory": 2.0**31})
    assert (request.memory, request.host_memory) == (1_500_000_000, 2**31)
    assert type(request.memory) is int and type(request.host_memory) is int
    assert LeaseRequest.from_json({"gpu_count": 2.0}).gpu_count == 2


@pytest.mark.parametrize("gpu, words", [
    ({"memory_total": 8.5e10 + 0.5}, "GPU GPU-1: 'memory_total' must be whole bytes"),
    ({"memory_reserved": 1.5}, "GPU GPU-1: 'memory_reserved' must be whole bytes"),
    ({"index": 0.5}, "'index' must be a whole number"),
    ({"healthy": "no"}, "GPU GPU-1: 'healthy' must be true or false"),
    ({"healthy": None}, "'healthy' must be true or false"),
])
def test_a_registration_with_a_confused_gpu_field_is_refused(gpu, words):
    with pytest.raises(GPUPoolError) as caught:
        NodeRegistration.from_json(registration(gpus=[GPU.to_json() | gpu]))
    assert caught.value.status == 400 and words in caught.value.message


@pytest.mark.parametrize("change, words", [
    ({"environments": [{"name": "x", "python": "/p", "usable": "yes"}]}, "an environment's 'usable'"),
    ({"environments": [{"name": "x", "python": "/p", "default": 1}]}, "an environment's 'default'"),
    ({"checkpointer": {"name": "simulated", "mid_cell": "true"}}, "'checkpointer.mid_cell'"),
    ({"checkpointer": {"name": "simulated", "remap": 1}}, "'checkpointer.remap'"),
    ({"whole_gpus": 1}, "'whole_gpus' must be true or false"),
])
def test_a_registration_with_a_confused_flag_is_refused(change, words):
    with pytest.raises(GPUPoolError) as caught:
        NodeRegistration.from_json(registration(**change))
    assert caught.value.status == 400 and words in caught.value.message
    for flag in ({"whole_gpus": None}, {"checkpointer": {"name": "simulated", "mid_cell": None}}):
        assert NodeRegistration.from_json(registration(**flag))  # null where the field says nullable: absent


def test_integers_read_back_as_ints_and_numbers_as_floats():
    request = LeaseRequest.from_json({"gpu_count": 2, "memory": 2**30, "idle_timeout": 60, "host_memory": 2**31})
    assert [type(v) for v in (request.gpu_count, request.memory, request.host_memory, request.idle_timeout)] == \
        [int, int, int, float]
