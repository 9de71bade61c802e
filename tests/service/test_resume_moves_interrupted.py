"""A move a cell stopped waiting for (Ctrl-C during the move): the next cell says the resume, timed
as the service timed it (the move's placement to the new worker), not the moment it reconnected.
A real service, two agents on simulated A100s and a gpupool kernel (the fixtures of
tests/support/two_nodes.py)."""

from __future__ import annotations

import re
import time

import pytest
from interrupting import interrupted_cell
from two_nodes import BIG_STATE, acquire, notebook, simgpu_root, two_nodes, until  # noqa: F401 (fixtures)

from gpupool.schema import LeaseState
from gpupool.magics.park import resume_seconds  # noqa

pytestmark = pytest.mark.timeout(300)


def test_a_move_interrupted_in_its_cell_is_said_with_its_own_time_atop_the_next_cell(two_nodes, tmp_path):
    svc, _, _ = two_nodes
    client = svc.client()
    with notebook(svc, tmp_path) as (km, comm):
        assert comm.run("%gpu acquire 1").ok
        lease_id = client.list_leases()[0].id
        assert comm.run(BIG_STATE, timeout=120).ok
        assert comm.run("%gpu park").ok
        elsewhere, taker = acquire(svc), acquire(svc)
        assert (elsewhere.node, taker.node) == ("node-2", "node-1")
        client.release(elsewhere.id)  # node-2 free: the next cell's resume moves there
        cell, _ = interrupted_cell(comm, km, "print(x)", once="moving to node-2")
        assert not cell.ok, cell.text()
        assert client.get_lease(lease_id).state is LeaseState.starting, "interrupted during the move"
        moved = until(svc, lease_id, "active", timeout=120)
        took = resume_seconds(moved)
        assert took is not None and took >= 0.5, moved.events
        comm.event("resumed", timeout=60)
        time.sleep(0.5)
        after = comm.run("print(x + 1)", timeout=120)
        text = after.text()
        assert after.ok and text.strip().splitlines()[-1] == "42", text
        said = re.findall(rf"gpupool: resumed {lease_id} on node-2 GPU 0 in (\d+\.\d)s", text)
        assert said == [f"{took:.1f}"], (text, took)
        client.release(taker.id)
