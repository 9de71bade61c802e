"""A node pressure clears for a person's request is that request's while it waits: another person's new
request is not placed on the room left there (``Placer.for_person``; the queue and the replay keep to the
same rule: tests/rules/test_cleared_room.py). Real service and agent, simulated GPUs."""

from __future__ import annotations

import pytest

from gpupool.errors import GPUPoolError
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest
from procs import start_agent, start_service, wait_for

LONG_GRACE = 60.0  # far longer than the test: ann's idle lease is not parked during it
TOKENS = {"ann": "ann-token-" + "6" * 16, "carl": "carl-token-" + "9" * 16, "zoe": "zoe-token-" + "8" * 16}


def test_a_new_request_is_not_placed_on_a_node_cleared_for_another(tmp_path):
    """One node of two GPUs: ann idles on one, zoe waits for both, so pressure clears the node for
    zoe (ann's lease to be parked after the grace). carl's one-GPU request does not take the free GPU
    there: it queues, and without ``wait`` it is refused naming why."""
    service = start_service(tmp_path, tokens=TOKENS,
                            config={"heartbeat_ttl": 120.0, "pressure_grace": LONG_GRACE,
                                    "pressure_clears_nodes": True})
    agent = None
    try:
        agent = start_agent(tmp_path, service, name="node-1", simulate="2xA100-80GB")
        ann = service.client("ann").create_lease(LeaseRequest(fraction=1.0))
        wait_for(lambda: service.client("ann").get_lease(ann.id).state is LeaseState.active, 60, "ann's lease")
        zoe = service.client("zoe").create_lease(LeaseRequest(fraction=1.0, gpu_count=2, wait=120))
        assert zoe.state is LeaseState.queued, zoe
        wait_for(lambda: service.client("ann").get_lease(ann.id).pressure, 30, "the node cleared for zoe")
        carl = service.client("carl").create_lease(LeaseRequest(fraction=1.0, wait=120))
        assert carl.state is LeaseState.queued, carl
        with pytest.raises(GPUPoolError) as refused:
            service.client("carl").create_lease(LeaseRequest(fraction=1.0))
        assert "being cleared for a request that waits for it" in refused.value.message
        assert service.client("carl").get_lease(carl.id).state is LeaseState.queued
    finally:
        if agent is not None:
            agent.stop()
        service.stop()
