"""``c.AgentWorkers.worker_launcher = "kubernetes"``: lease workers as pods,
through the real ``kubernetes`` client against a stand-in API server and
kubelet (tests/support/kubelet_standin.py: every pod's container is a local process
at a loopback IP of its own). No cluster runs here: what this shows and what
needs one is docs/launchers.md's ("Kubernetes").

Through a real agent and service: a lease's worker starts as a pod with the
lease's labels and GPU resource, its cells run there, its release deletes
the pod and its Secret; a pod killed as OOMKilled ends its lease with those
words; after ``kill -9`` of the agent a new one re-adopts the running pod
and deletes a stray one. Through the node's WorkerManager: an unschedulable
pod fails the start with the scheduler's words and leaves nothing; the
words of pods' states; park cannot freeze a pod.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys

import pytest
from traitlets.config import Config

from gpupool.node.workers import WorkerLaunch, WorkerManager, WorkerSpec, WorkerStartError
from gpupool.node.workers.launchers import launcher_class
from gpupool.node.workers.launchers.kubernetes.pods import pod_name
from gpupool.node.workers.launchers.kubernetes.status import end_words, exit_code, pending_words, running_ip
from gpupool.node.inventory.simulated import SimulatedInventory
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest
from kubelet_standin import KubeletStandin
from procs import cluster_pool, start_agent, wait_for
from workercell import run_worker_cell

pytest.importorskip("kubernetes")
pytestmark = pytest.mark.timeout(120)

NAMESPACE = "gpupool-agents"
NODE = "standin-node"
GiB = 2**30


def free_first_port() -> int:
    """A first port whose six ports (shell .. transfer) are free on every address of this host now."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", 0))
            first = probe.getsockname()[1]
        if first > 65000:
            continue
        try:
            socks = []
            for port in range(first, first + 6):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("0.0.0.0", port))
            return first
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no six free ports in a row")


@pytest.fixture
def standin(tmp_path):
    kubelet = KubeletStandin(tmp_path / "kubelet")
    kubelet.start()
    yield kubelet
    kubelet.stop()


def settings(standin: KubeletStandin) -> dict[str, object]:
    """``c.KubernetesLauncher.*`` for the stand-in (the container's python is this venv's)."""
    return {"api_url": standin.url, "namespace": NAMESPACE, "node_name": NODE, "image": "standin/singleuser:test",
            "python": sys.executable, "first_port": free_first_port(), "poll_interval": 0.5, "memory": 2 * GiB}


def agent_args(standin: KubeletStandin) -> list[str]:
    return ["--worker-launcher=kubernetes", "--warm-workers=0", "--AgentWorkers.worker_start_timeout=40",
            *(f"--KubernetesLauncher.{name}={value}" for name, value in settings(standin).items())]


def cell(lease, code: str) -> str:
    return asyncio.run(run_worker_cell(lease.connection, code, timeout=60))


def active(service, request: LeaseRequest):
    lease = service.client().create_lease(request)
    return wait_for(lambda: (got := service.client().get_lease(lease.id)).state is LeaseState.active and got, 60,
                    "the lease active")


def ended(service, lease_id: str):
    return wait_for(lambda: (got := service.client().get_lease(lease_id)).state.ended and got, 60, "the lease ended")


@pytest.fixture
def pool(standin, tmp_path):
    with cluster_pool(tmp_path, agent_args(standin)) as pair:
        yield pair


# -- through a real agent and service ---------------------------------------------------------------------------

def test_a_leases_worker_is_a_pod_its_cells_run_there_and_release_deletes_it(standin, pool):
    service, agent = pool
    lease = active(service, LeaseRequest(fraction=1.0, gpu_count=2))
    said = f"lease {lease.id}: its tasks are limited by the kubelet"
    log = wait_for(lambda: (text := agent.log.read_text()) and said in text and text, 10, "the agent's log line")
    assert " tasks\n" not in log, "the agent claims no task limit of its own (it logged: lease L limited to N tasks)"
    [pod] = standin.pods()
    meta, container = pod["metadata"], pod["spec"]["containers"][0]
    assert meta["name"] == pod_name(lease.id) and meta["namespace"] == NAMESPACE
    assert meta["labels"]["gpupool.io/lease"] == lease.id and meta["labels"]["gpupool.io/node"] == NODE
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2" and pod["spec"]["nodeName"] == NODE
    assert lease.connection["ip"] == pod["status"]["podIP"] != "127.0.0.1", "clients reach the kernel at the pod's IP"
    [secret] = standin.secrets()
    assert secret["metadata"]["ownerReferences"][0]["uid"] == meta["uid"], "the Secret goes with its pod"
    mounted = json.loads(secret["stringData"]["kernel.json"])
    assert mounted["ip"] == "0.0.0.0" and mounted["key"] and mounted["curve_secretkey"], "every address, encrypted"
    assert [mounted[f"{c}_port"] for c in ("shell", "iopub", "stdin", "control", "hb", "transfer")] == \
        [lease.connection[f"{c}_port"] for c in ("shell", "iopub", "stdin", "control", "hb", "transfer")] == \
        [p["containerPort"] for p in container["ports"]], "the fixed ports"
    assert lease.connection["curve_publickey"] == mounted["curve_publickey"] and "curve_secretkey" not in lease.connection
    seen = cell(lease, "import os; print(os.environ['GPUPOOL_LEASE_ID'], os.getpid(), 6 * 7)").split()
    assert seen[0] == lease.id and seen[2] == "42"
    assert int(seen[1]) == standin.process(meta["name"]).pid, "the cell ran in the pod's container"
    assert "PATH" not in {e["name"] for e in container["env"]}, "the agent's environment stays out of the pod"

    service.client().release(lease.id)
    ended(service, lease.id)
    wait_for(lambda: not standin.pods() and not standin.secrets(), 30, "the pod and its Secret deleted")


def test_a_pod_killed_out_of_memory_ends_its_lease_with_those_words(standin, pool):
    service, _ = pool
    lease = active(service, LeaseRequest(fraction=0.5))
    assert cell(lease, "print(1 + 1)").strip() == "2"
    standin.oom_kill(pod_name(lease.id))
    gone = ended(service, lease.id)
    assert f"the worker's pod {pod_name(lease.id)} ended (Failed): its container was OOMKilled (exit code 137)" \
        in gone.reason, gone.reason
    wait_for(lambda: not standin.pods(), 30, "the ended pod deleted")


def test_after_kill_9_of_the_agent_a_new_one_re_adopts_its_pod_and_deletes_a_stray(standin, pool, tmp_path):
    service, agent = pool
    lease = active(service, LeaseRequest(fraction=1.0))
    cell(lease, "kept = 41")
    [pod] = standin.pods()
    stray = {k: v for k, v in pod.items() if k != "status"}
    stray["metadata"] = {"name": "gpupool-worker-stray", "labels": pod["metadata"]["labels"]}
    os.kill(agent.proc.pid, signal.SIGKILL)
    agent.proc.wait()
    standin.add_pod(NAMESPACE, stray)  # an earlier agent's, whose record is gone
    again = start_agent(tmp_path, service, simulate="2xA100-80GB", extra_args=agent_args(standin))
    try:
        assert f"re-adopted its worker in pod {pod['metadata']['name']}" in again.log.read_text()
        wait_for(lambda: [p["metadata"]["name"] for p in standin.pods()] == [pod["metadata"]["name"]], 30,
                 "the stray pod deleted")
        assert service.client().get_lease(lease.id).state is LeaseState.active
        assert cell(lease, "print(kept + 1)").strip() == "42"
        service.client().release(lease.id)
        wait_for(lambda: not standin.pods(), 30, "the pod deleted")
    finally:
        again.stop()


# -- through the node's WorkerManager ---------------------------------------------------------------------------

def manager(tmp_path, standin: KubeletStandin, start_timeout: float = 40) -> WorkerManager:
    config = Config()
    for name, value in settings(standin).items():
        setattr(config.KubernetesLauncher, name, value)
    return WorkerManager(WorkerLaunch(tmp_path / "state", node="node-1", start_timeout=start_timeout,
                                      stop_timeout=5, config=config),
                         launcher=launcher_class("kubernetes"))


def a_lease(lease_id: str = "L-k8s-1", fraction: float = 0.5) -> WorkerSpec:
    gpu = SimulatedInventory("1xA100-80GB", "node-1").discover()[0]
    return WorkerSpec(lease_id, "ann", (gpu,), fraction, 40 * GiB)


def test_an_unschedulable_pod_fails_the_start_with_its_words_and_leaves_nothing(standin, tmp_path):
    standin.pending = {"reason": "Unschedulable",
                       "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."}

    async def scenario():
        workers = manager(tmp_path, standin, start_timeout=2)
        try:
            with pytest.raises(WorkerStartError) as failed:
                await workers.start(a_lease())
            return str(failed.value)
        finally:
            await workers.stop_all()
            workers.close()

    words = asyncio.run(scenario())
    assert f"the worker pod {pod_name('L-k8s-1')} of lease L-k8s-1 did not run within 2 s" in words, words
    assert "PodScheduled: Unschedulable: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu." in words, words
    assert standin.pods() == [] and standin.secrets() == []
    assert [p.name for p in (tmp_path / "state" / "workers").iterdir()] == []


def test_a_pod_cannot_be_frozen_and_has_no_warm_workers(standin, tmp_path):
    from gpupool.node.cgroups import CgroupError

    async def scenario():
        workers = manager(tmp_path, standin)
        try:
            worker = await workers.start(a_lease())
            assert worker.cgroup.pids() == set() and worker.pid == 0, "no host PIDs are the agent's to read"
            with pytest.raises(CgroupError, match="an unprivileged agent cannot freeze a pod's cgroup"):
                worker.cgroup.freeze()
            assert worker.record().launcher["pod"] == pod_name("L-k8s-1")
            with pytest.raises(WorkerStartError, match="a pod's GPUs are fixed"):
                await workers._launcher.warm()
        finally:
            await workers.stop_all()
            workers.close()

    asyncio.run(scenario())
    assert standin.pods() == [] and standin.secrets() == []
    assert [p.name for p in (tmp_path / "state" / "workers").iterdir()] == [], "its files removed"


def test_the_words_of_a_pods_states():
    def pod(phase, state=None, conditions=(), **status):
        containers = [{"name": "worker", "state": state}] if state else []
        return {"metadata": {"name": "p"}, "status": {"phase": phase, "conditions": list(conditions),
                                                      "containerStatuses": containers, **status}}

    waiting = pod("Pending", {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x"'}})
    assert pending_words(waiting) == 'its container is waiting: ImagePullBackOff: Back-off pulling image "x"'
    assert pending_words(pod("Pending")) == "it is Pending"
    assert running_ip(pod("Running", {"running": {}}, podIP="10.1.2.3")) == "10.1.2.3"
    assert running_ip(pod("Running", {"waiting": {}}, podIP="10.1.2.3")) is None
    oom = pod("Failed", {"terminated": {"exitCode": 137, "reason": "OOMKilled"}})
    assert end_words("p", oom) == "the worker's pod p ended (Failed): its container was OOMKilled (exit code 137)"
    assert exit_code(oom) == -9 and exit_code(pod("Failed", {"terminated": {"exitCode": 3}})) == 3
    evicted = pod("Failed", reason="Evicted", message="The node was low on resource: memory.")
    assert end_words("p", evicted) == \
        "the worker's pod p ended (Failed): Evicted: The node was low on resource: memory."
    assert "is gone (deleted outside gpupool" in end_words("p", None)
