"""Host CPU and memory in a slice: the pure fit and fragmentation rule
(tables), and end to end with real agents, workers and cgroups."""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path

import pytest

from procs import start_agent, start_service

from gpupool.errors import GPUPoolError
from gpupool.hub_plugin.rules.hosts import (NO_CPUS, NO_HOST_MEMORY, HostState, beyond_every_node, host_aware_delta,
                                            share_of)
from gpupool.hub_plugin.rules.placement_index import PlacementIndex
from gpupool.hub_plugin.rules.scheduler import Demand, GPUState, Placement, Refusal, place
from gpupool.hub_plugin.rules.workload import DEFAULT_WORKLOAD, slice_delta
from gpupool.node.cgroups.mounts import own_cgroups, read_mounts
from gpupool.node.cgroups.none import GroupOnly
from gpupool.node.host_limits import out_of_memory
from workercell import run_worker_cell
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest
from gpupool.tables import lease_table, pool_table
from gpupool.tables import host_words

G = 2**30
MIB = 2**20


def node_gpus(node: str, taken: tuple[float, ...] = (0.0, 0.0)) -> list[GPUState]:
    return [GPUState(f"{node}-{i}", node, "A100", i, 80 * G, 79 * G, allocated_fraction=f,
                     allocated_memory=int(f * 79 * G)) for i, f in enumerate(taken)]


# -- the pure rule -------------------------------------------------------------------------------------------

HOSTS = {"a": HostState("a", 8, 16 * G, 2), "b": HostState("b", 32, 256 * G, 2)}


@pytest.mark.parametrize("demand, hosts, expected", [
    (Demand(0.5), HOSTS, ("a", 2.0, 4 * G)),  # the default: the GPU share's part of the node (a first by name)
    (Demand(0.5, host_memory=64 * G), HOSTS, ("b", 8.0, 64 * G)),  # GPU fits both, host memory only b
    (Demand(0.5, cpus=16), HOSTS, ("b", 16, 64 * G)),  # cores only on b
    (Demand(1.0, gpu_count=2, cpus=12), HOSTS, ("b", 12, 256 * G)),  # whole GPUs: the node's host counts too
    (Demand(0.5, cpus=4, host_memory=8 * G), {"a": HostState("a", 8, 16 * G, 2, 5.0, 0), "b": HOSTS["b"]},
     ("b", 4, 8 * G)),  # a has the cores in total, not free
    (Demand(0.5, host_memory=300 * G), HOSTS, NO_HOST_MEMORY),
    (Demand(0.5, cpus=40), HOSTS, NO_CPUS),
    (Demand(0.5, cpus=40), {}, ("a", 40, None)),  # no node reports a host: nothing checked or reserved
])
def test_placement_fits_every_dimension(demand, hosts, expected):
    decision = place(demand, node_gpus("a") + node_gpus("b"), hosts=hosts)
    if isinstance(expected, str):
        assert isinstance(decision, Refusal) and set(decision.reasons) == {expected}
        assert "the most free host is b: 32 CPUs, 256.0 GiB" in decision.message
    else:
        assert isinstance(decision, Placement)
        assert (decision.node, decision.cpus, decision.host_memory) == expected


def test_default_shares_never_add_up_to_more_than_the_host():
    host = HostState("n", 2, 23 * G + 12345, 3)
    cpus, memory = share_of(1 / 3, host, 1.0)
    assert cpus * 9 <= 2 and memory * 9 <= host.memory  # nine thirds of GPUs on three GPUs fit
    assert share_of(0.5, HostState("n", 64, 512 * G, 8), 1.0) == (4.0, 32 * G)
    assert share_of(0.5, HostState("n", 64, 512 * G, 8), 0.5) == (2.0, 16 * G)


@pytest.mark.parametrize("free, position", [
    ([1.0, 1.0, 1.0, 1.0], 0), ([0.5, 1.0, 1.0, 0.25], 0), ([0.5, 1.0, 1.0, 0.25], 3), ([0.5, 1.0, 1.0, 0.25], 1),
    ([0.75, 0.5, 1.0, 0.0], 1), ([0.75, -1.0, 1.0, 1.0], 2),
])
def test_every_dimension_measure_is_the_gpu_only_one_where_the_host_has_room(free, position):
    roomy = HostState("n", 1000, 10**6 * G, len(free))
    idle = sum(f >= 1 for f in free)
    gpu_only = slice_delta(free[position], free[position] >= 1, idle, 0.25, DEFAULT_WORKLOAD)
    every = host_aware_delta(Demand(0.25, cpus=1, host_memory=G), roomy, free, {position: 0.25}, DEFAULT_WORKLOAD)
    assert every == pytest.approx(gpu_only, abs=1e-9)


def test_fragmentation_keeps_host_room_where_the_workload_needs_it():
    # Same GPUs; b's host already lacks the 8 cores a 2-GPU request takes there (1 of its 8 is held), a's has
    # them: 3 cores on a would leave a unable to take one, which Weng et al.'s measure counts as all of a's
    # free GPUs turned fragment; on b nothing the workload could use is lost. So the slice goes to b.
    hosts = {"a": HostState("a", 8, 64 * G, 2), "b": HostState("b", 8, 64 * G, 2, cpus_allocated=1.0)}
    demand = Demand(0.25, cpus=3)
    assert place(demand, node_gpus("a") + node_gpus("b"), hosts=hosts).node == "b"
    assert PlacementIndex(node_gpus("a") + node_gpus("b"), hosts=hosts).place(demand).node == "b"
    assert place(demand, node_gpus("a") + node_gpus("b")).node == "a"  # the GPU alone: a first by name


def test_the_index_places_in_every_dimension_like_place():
    rng = random.Random(7)
    for _ in range(30):
        names = [f"n{i}" for i in range(6)]
        gpus = [g for name in names for g in node_gpus(name, tuple(rng.choice((0.0, 0.25, 0.5, 1.0))
                                                                   for _ in range(4)))]
        hosts = {name: HostState(name, 64, 512 * G, 4, cpus_allocated=rng.choice((0, 8, 40))) for name in names}
        index = PlacementIndex(gpus, DEFAULT_WORKLOAD, hosts)
        for demand in (Demand(0.25, cpus=rng.choice((1, 8, 30))), Demand(0.5), Demand(1.0, gpu_count=2, cpus=10)):
            got, scan = index.place(demand), place(demand, gpus, DEFAULT_WORKLOAD, hosts=hosts)
            assert type(got) is type(scan)
            if isinstance(got, Placement):  # fits in every dimension; the same choice as a full scan here
                assert got == scan


def test_asks_beyond_every_node_name_the_biggest():
    assert beyond_every_node(Demand(0.5, cpus=33), HOSTS) == (
        "33 host CPUs is more than any node has: the biggest, b, has 32 cores and 256.0 GiB; ask for at most "
        "that (--cpus)")
    assert "the biggest, b, has 256.0 GiB and 32 cores" in beyond_every_node(Demand(host_memory=257 * G), HOSTS)
    assert beyond_every_node(Demand(0.5, cpus=32, host_memory=256 * G), HOSTS) is None


class Counted(GroupOnly):
    def __init__(self, kills: int | None) -> None:
        super().__init__("lease-L-1")
        self.kills = kills

    def oom_kills(self) -> int | None:
        return self.kills


@pytest.mark.parametrize("kills, memory, exit_code, words", [
    (1, G, -9, "the worker was killed: it ran out of its 1.0 GiB of host memory (--host-memory); acquire again "
               "with a larger --host-memory"),
    (2, 512 * MIB, None, "it ran out of its 512.0 MiB of host memory"),  # re-adopted: its exit code is unknown
    (1, None, -9, "the node ran out of host memory (the kernel's OOM killer ended it)"),  # no limit of its own
    (1, G, 0, None),  # a child was OOM-killed, the worker itself exited: not what ended it
    (1, G, -15, None),
    (0, G, -9, None),  # killed by someone else
    (None, G, -9, None),  # the cgroup cannot tell (no memory controller, no cgroup)
])
def test_an_oom_kill_is_told_with_the_limit_and_the_way_out(kills, memory, exit_code, words):
    said = out_of_memory(Counted(kills), memory, exit_code)
    assert said == words if words is None else words in said


# -- end to end ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A service and two agents of 2 simulated GPUs each: node-1 a small host (2 cores, 2 GiB), node-2 a
    bigger one (4 cores, 16 GiB)."""
    root = tmp_path_factory.mktemp("hosts")
    service = start_service(root, config={"max_wait": "10m"})
    agents = [start_agent(root, service, name="node-1", extra_args=["--AgentInventory.host_cpus=2",
                                                                     "--AgentInventory.host_memory=2GiB"]),
              start_agent(root, service, name="node-2", extra_args=["--AgentInventory.host_cpus=4",
                                                                     "--AgentInventory.host_memory=16GiB"])]
    yield service
    for agent in agents:
        agent.stop()
    service.stop()


def worker_limits(pid: int) -> tuple[float | None, int | None]:
    """``(cores, bytes)`` the cgroups of process ``pid`` allow, read from their files (v2 or v1)."""
    mounts, own = read_mounts(), own_cgroups(Path(f"/proc/{pid}/cgroup"))
    cpus = memory = None
    for mount in mounts:
        if mount.fstype == "cgroup2" and "" in own:
            path = mount.path / own[""].lstrip("/")
            if (path / "memory.max").exists() and (text := (path / "memory.max").read_text().strip()) != "max":
                memory = int(text)
            if (path / "cpu.max").exists() and (quota := (path / "cpu.max").read_text().split())[0] != "max":
                cpus = int(quota[0]) / int(quota[1])
        elif mount.fstype == "cgroup" and "memory" in mount.options and "memory" in own:
            limit = int((mount.path / own["memory"].lstrip("/") / "memory.limit_in_bytes").read_text())
            memory = limit if limit < 2**62 else memory
        elif mount.fstype == "cgroup" and "cpu" in mount.options and "cpu" in own:
            path = mount.path / own["cpu"].lstrip("/")
            quota = int((path / "cpu.cfs_quota_us").read_text())
            cpus = quota / int((path / "cpu.cfs_period_us").read_text()) if quota > 0 else cpus
    return cpus, memory


def test_the_workers_cgroup_holds_the_leases_cpus_and_host_memory(two_nodes):
    client = two_nodes.client()
    lease = client.create_lease(LeaseRequest(fraction=0.5, cpus=1, host_memory=512 * MIB))
    try:
        lease = client.get_lease(lease.id, wait=60, state="starting")
        assert lease.state == LeaseState.active, lease.reason
        assert (lease.cpus, lease.host_memory) == (1, 512 * MIB)
        assert worker_limits(lease.worker["pid"]) == (1.0, 512 * MIB)
        assert "1 CPU, 512.0 MiB" in lease_table([lease])[0]  # what %gpu status shows
        pool = pool_table(client.pool())[0]  # what %gpu pool shows: each node's host
        assert re.search(r"node-1 +\S+ +\S+ +2 CPUs, 2\.0 GiB", pool) and "4 CPUs, 16.0 GiB" in pool, pool
    finally:
        client.release(lease.id)


def test_a_worker_past_its_host_memory_ends_its_lease_in_words_that_name_the_limit(two_nodes):
    client = two_nodes.client()
    lease = client.create_lease(LeaseRequest(fraction=0.5, host_memory=512 * MIB))
    try:
        lease = client.get_lease(lease.id, wait=60, state="starting")
        assert lease.state == LeaseState.active, lease.reason
        if worker_limits(lease.worker["pid"])[1] != 512 * MIB:
            pytest.skip("this host enforces no host memory limit (no cgroup memory controller, or not root)")
        overfill = "b = bytearray(1024 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1"
        with pytest.raises((RuntimeError, TimeoutError, OSError)):  # the worker dies mid-cell
            asyncio.run(run_worker_cell(lease.connection, overfill, timeout=10))
        ended = client.get_lease(lease.id, wait=30, state="active")
        assert ended.state == LeaseState.failed
        assert ended.reason == ("the worker was killed: it ran out of its 512.0 MiB of host memory (--host-memory); "
                                "acquire again with a larger --host-memory")
    finally:
        client.release(lease.id)


def test_host_memory_decides_the_node_when_the_gpu_fits_on_both(two_nodes):
    client = two_nodes.client()
    small = client.create_lease(LeaseRequest(fraction=0.5))
    big = client.create_lease(LeaseRequest(fraction=0.5, host_memory=4 * G))
    try:
        assert small.node == "node-1" and (small.cpus, small.host_memory) == (0.5, G // 2)  # 1/4 of its host
        assert (small.cpu_limit, small.host_memory_limit) == (1, G)  # what its cgroup gets: the default's floor
        assert big.node == "node-2" and big.host_memory == 4 * G
        assert (big.cpus, big.cpu_limit, big.host_memory_limit) == (1, 1, 4 * G)  # asked for: as it is
        assert "0.5 CPU reserved, limited to 1 CPU; 512.0 MiB reserved, limited to 1.0 GiB" in lease_table([small])[0]
        assert "1 CPU, 4.0 GiB" in lease_table([big])[0]
        assert host_words(small) == (", 0.5 CPU reserved, limited to 1 CPU, 512.0 MiB of host memory reserved, "
                                     "limited to 1.0 GiB")  # what %gpu acquire says
        assert host_words(big) == ", 1 CPU and 4.0 GiB of host memory"
        listed = {lease.id: lease for lease in client.list_leases()}  # the list says the same
        assert (listed[small.id].cpu_limit, listed[small.id].host_memory_limit) == (1, G)
    finally:
        for lease in (small, big):
            client.release(lease.id)


@pytest.mark.parametrize("ask, words", [
    ({"cpus": 64}, "64 host CPUs is more than any node has: the biggest, node-2, has 4 cores and 16.0 GiB"),
    ({"host_memory": 64 * G}, "64.0 GiB of host memory is more than any node has: the biggest, node-2, has 16.0 GiB"),
    ({"cpus": 0}, "'cpus' must be host cores from 0.01"),
    ({"cpus": -2}, "'cpus' must be host cores from 0.01"),
    ({"host_memory": 0}, "'host_memory' must be a whole number of bytes from 1048576"),
])
def test_asks_beyond_every_node_or_not_positive_are_refused_and_nothing_is_held(two_nodes, ask, words):
    client = two_nodes.client()
    before = client.list_leases(active=False)
    with pytest.raises(GPUPoolError) as refused:
        client.request("POST", "/leases", {"fraction": 0.5, "wait": 60, **ask})
    assert refused.value.status == 400 and words in refused.value.message
    assert len(client.list_leases(active=False)) == len(before)
