"""Multi-host: the service, two agents and a notebook kernel each on
a host of its own (a network namespace, tests/support/netns.py), talking over a
bridge; links are cut and healed mid-cell and while idle.

Hosts: ``svc`` (the service), ``node1`` (agent ``node-1``, one simulated
H100), ``node2`` (agent ``node-2``, one simulated A100), ``nb`` (the notebook
kernel, a real ipykernel with the gpupool provisioner and magics). The test
process is on the bridge too and checks everything through the REST API.
Short TTLs (config below) keep each wait to seconds; every wait has a bound.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from tornado.httpclient import HTTPClient
from tornado.simple_httpclient import HTTPTimeoutError

import netns
from frontend import Cell, remote_value, run
from gpupool.errors import GPUPoolError
from gpupool.magics.kernelspec import kernel_json
from gpupool.wire.leases import LeaseRequest
from procs import AgentProcess, ServiceProc, start_agent, start_service, wait_for

HEARTBEAT_TTL = 3.0  # a lease lives this long without its kernel's heartbeat (while idle)
NODE_TTL = 2.0  # a node is lost after this long without its agent's heartbeat
CONFIG = {"heartbeat_ttl": HEARTBEAT_TTL, "node_ttl": NODE_TTL, "node_heartbeat_interval": 0.2,
          "reclaim_interval": 0.2}
# The agent's calls to the service give up after 1 s, so it beats again soon after a heal.
AGENT_ARGS = ["--NodeAgent.service_timeout=1", "--warm-workers=0"]
SERVICE_PORT, AGENT_PORT = 8765, 8766  # free by construction: each host is a fresh namespace


@dataclass
class Site:
    """The hosts and what runs on them (module docstring)."""

    net: netns.Network
    svc: netns.Host
    node1: netns.Host
    node2: netns.Host
    nb: netns.Host
    service: ServiceProc
    agents: dict[str, AgentProcess]
    kernels: Path  # a kernels dir whose "gpupool-nb" spec starts kernels on nb


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The network, its hosts and the pool on them, shared by this module;
    at the end, every process is stopped and nothing may be left running in
    the namespaces. Skipped, with the reason, where namespaces cannot be made."""
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("netns")
    with ExitStack() as cleanup:  # in reverse: agents, service, then the network
        net = netns.Network()
        cleanup.callback(_close, net)
        svc, node1, node2, nb = (net.add_host(role) for role in ("svc", "node1", "node2", "nb"))
        service = start_service(root, config=CONFIG, tokens={"bob": "bob-token-" + os.urandom(8).hex()},
                                ip=svc.ip, port=SERVICE_PORT, launcher=svc.launcher)
        cleanup.callback(service.stop)
        agents = {}
        for host, name, gpu in ((node1, "node-1", "1xH100-80GB"), (node2, "node-2", "1xA100-80GB")):
            agents[name] = start_agent(root, service, name=name, simulate=gpu, ip=host.ip, port=AGENT_PORT,
                                       launcher=host.launcher, extra_args=AGENT_ARGS)
            cleanup.callback(agents[name].stop)  # raises if a worker of the agent survived it
        yield Site(net, svc, node1, node2, nb, service, agents,
                   _kernelspec(root / "kernels", nb, service.url, service.user_token))


def _close(net: netns.Network) -> None:
    leaked = net.close()
    assert leaked == [], f"processes were left running in the namespaces: {leaked}"


def _kernelspec(kernels: Path, nb: netns.Host, url: str, token: str) -> Path:
    """The gpupool kernelspec (as ``gpupool kernelspec install`` writes it) with
    its command run inside ``nb``."""
    spec_dir = kernels / "gpupool-nb"
    spec_dir.mkdir(parents=True)
    token_file = kernels / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    spec = kernel_json("Python 3 (gpupool, nb host)", url, str(token_file))
    spec["argv"] = [*nb.launcher, *spec["argv"]]
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return kernels


@pytest.fixture
def nb_kernel(site, tmp_path):
    """A notebook kernel on host ``nb``: ``(km, kc)``. It listens on all of its
    host's addresses (jupyter_client only launches kernels on addresses of the
    launching host, so the spec says 0.0.0.0) and the client dials ``nb``'s."""
    ksm = KernelSpecManager(kernel_dirs=[str(site.kernels)])
    km = KernelManager(kernel_name="gpupool-nb", kernel_spec_manager=ksm, ip="0.0.0.0")
    km.start_kernel(cwd=str(tmp_path), env={**os.environ})
    kc = km.client(ip=site.nb.ip)
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        yield km, kc
    finally:
        kc.shutdown()  # through the client: km's own control socket points at 0.0.0.0 of this host
        try:
            wait_for(lambda: not km.is_alive(), 15, "the notebook kernel to exit after shutdown_request")
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)  # gone already; this runs the provisioner's release of its leases


# -- helpers -------------------------------------------------------------------------------------------


def _node(service, name: str) -> dict:
    node, = [n for n in service.client().pool()["nodes"] if n["name"] == name]
    return node


def _only_lease(service):
    lease, = service.client().list_leases(active=True)
    return lease


def _assert_allocations_match(service, users=("tester", "bob")) -> dict[str, float]:
    """No double allocation: on every GPU the pool's allocated share is the sum
    of the active leases placed there, and at most 1. Returns uuid -> share."""
    placed: dict[str, float] = {}
    for user in users:
        for lease in service.client(user).list_leases(active=True):
            for gpu in lease.gpus:
                placed[gpu["uuid"]] = placed.get(gpu["uuid"], 0.0) + lease.fraction
    shares = {gpu["uuid"]: gpu["allocated_fraction"] for node in service.client().pool()["nodes"]
              for gpu in node["gpus"]}
    assert all(share <= 1.0 for share in shares.values()), shares
    assert {u: s for u, s in shares.items() if s} == pytest.approx(placed), (shares, placed)
    return shares


def _collect(kc, msg_id: str, timeout: float, *, cell: Cell | None = None, until=None) -> Cell:
    """The outputs and reply of a cell sent earlier with ``kc.execute`` (as
    frontend.run collects them), waiting up to ``timeout`` s per message.
    With ``until(cell)``, returns as soon as that holds (the cell may still
    run); pass the returned ``cell`` back to collect the rest."""
    cell = cell or Cell()
    while True:
        if until is not None and until(cell):
            return cell
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id or msg["msg_type"] == "execute_input":
            continue
        if msg["msg_type"] == "status":
            if msg["content"]["execution_state"] == "idle":
                break
            continue
        cell.outputs.append((msg["msg_type"], msg["content"]))
    while (reply := kc.get_shell_msg(timeout=timeout))["parent_header"].get("msg_id") != msg_id:
        continue
    cell.reply = reply["content"]
    return cell


def _attach(kc, line: str):
    attached = run(kc, line)
    assert attached.ok, attached.text()
    return attached


# -- the helper itself ---------------------------------------------------------------------------------------


def test_a_cut_link_drops_traffic_and_healing_restores_it(site):
    url = site.agents["node-1"].url + "/health"
    client = HTTPClient()
    try:
        assert json.loads(client.fetch(url, request_timeout=10).body)["node"] == "node-1"
        with site.net.cut(site.node1):
            with pytest.raises((HTTPTimeoutError, OSError)):  # no answer: timed out, or no route to host
                client.fetch(url, connect_timeout=1, request_timeout=1)
            assert site.service.client().pool()["nodes"], "the service, on another host, still answers"
        assert json.loads(client.fetch(url, request_timeout=10).body)["node"] == "node-1"
    finally:
        client.close()


# -- scenarios -----------------------------------------------------------------------------------------------


def test_a_cell_runs_on_a_worker_on_another_host(site, nb_kernel):
    service, node1, nb, svc = site.service, site.node1, site.nb, site.svc
    km, kc = nb_kernel
    attached = _attach(kc, "%gpu acquire 0.5 --model H100")
    assert "on node-1" in attached.stdout and "NVIDIA H100" in attached.stdout
    worker_pid = remote_value(kc, "import os; os.getpid()")
    lease = _only_lease(service)
    assert lease.node == "node-1" and lease.worker["pid"] == worker_pid
    assert lease.connection["ip"] == node1.ip, "the worker is reached at its node's address"
    assert node1.owns(worker_pid) and nb.owns(km.provisioner.pid) and svc.owns(service.proc.pid)
    assert remote_value(kc, "sum(range(10))") == 45

    released = run(kc, "%gpu release")
    assert released.ok and f"released {lease.id}" in released.stdout, released.text()
    wait_for(lambda: not psutil.pid_exists(worker_pid), 15, "the worker to stop after release")
    assert service.client().list_leases(active=True) == []


def test_cutting_the_agents_link_mid_cell_loses_the_node_and_healing_readopts_its_lease(site, nb_kernel):
    """The node goes lost after its TTL; its GPU's free half is not handed out
    (an H100 request is refused with the reason, any-GPU goes to node-2); the
    lease is kept (its cell is running and its kernel still beats). After the
    heal the node is up again, the same worker carries on, and the cell's
    result arrives or the notebook says in words that the worker stopped
    answering."""
    net, node1, service = site.net, site.node1, site.service
    _, kc = nb_kernel
    bob = service.client("bob")
    _attach(kc, "%gpu acquire 0.5 --model H100")
    worker_pid = remote_value(kc, "import os, time; os.getpid()")
    lease = _only_lease(service)
    h100 = lease.gpus[0]["uuid"]

    msg_id = kc.execute("time.sleep(6)\nprint('slept on', os.getpid())")
    wait_for(lambda: service.client().get_lease(lease.id).worker["execution_state"] == "busy", 30,
             "the agent to report the cell running")
    with net.cut(node1):
        wait_for(lambda: _node(service, "node-1")["state"] == "lost", 30, f"node-1 lost after {NODE_TTL}s")
        with pytest.raises(GPUPoolError) as refused:
            bob.create_lease(LeaseRequest(fraction=0.5, model="H100"))
        assert refused.value.code == "pool_full" and "node lost" in refused.value.message, refused.value
        elsewhere = bob.create_lease(LeaseRequest(fraction=0.5))
        assert elsewhere.node == "node-2", "nothing new is placed on a lost node"
        shares = _assert_allocations_match(service)
        assert shares[h100] == 0.5, "node-1's GPU holds only the lease it had"
        kept = service.client().get_lease(lease.id)
        assert kept.state.value == "active" and kept.node == "node-1" and kept.node_state == "lost"
        bob.release(elsewhere.id)
        # The affected user is told, under the running cell, by the kernel's lease heartbeat.
        told = _collect(kc, msg_id, 30, until=lambda cell: "lost contact with node node-1" in cell.text())
        assert "Traceback" not in told.text()
    wait_for(lambda: _node(service, "node-1")["state"] == "up", 30, "node-1 up again after the heal")
    done = _collect(kc, msg_id, 60, cell=told)

    if done.ok:  # beside the news that the node is back (on stdout, as news is)
        said = done.stdout.splitlines()
        assert [line for line in said if not line.startswith("gpupool: node node-1 is back")] == [
            f"slept on {worker_pid}"], done.stdout
    else:  # the worker's echoes stopped for HB_TIMEOUT before the heal: the user is told so
        assert "stopped answering" in done.text() and "network may be down" in done.text(), done.text()
        assert "Traceback" not in done.text()
    back = wait_for(lambda: (got := service.client().get_lease(lease.id)).worker["execution_state"] == "idle" and got,
                    30, "node-1's reports to reach the lease again (idle after the cell)")
    assert back.state.value == "active" and back.node == "node-1" and back.worker["pid"] == worker_pid
    assert remote_value(kc, "os.getpid()") == worker_pid, "the next cell runs on the same slice"
    shares = _assert_allocations_match(service)
    assert shares[h100] == 0.5 and sum(shares.values()) == 0.5, "the lease holds its half, nothing else is held"
    assert run(kc, "%gpu release").ok
    wait_for(lambda: not psutil.pid_exists(worker_pid), 15, "the worker to stop after release")


def test_cutting_the_clients_link_while_idle_reclaims_its_lease_after_the_heartbeat_ttl(site, nb_kernel):
    net, nb, service = site.net, site.nb, site.service
    _, kc = nb_kernel
    local_pid = remote_value(kc, "import os; os.getpid()")
    _attach(kc, "%gpu acquire 0.5")
    worker_pid = remote_value(kc, "os.getpid()")
    lease = _only_lease(service)
    wait_for(lambda: service.client().get_lease(lease.id).worker["execution_state"] == "idle", 30,
             "the agent to report the worker idle")

    with net.cut(nb):
        ended = wait_for(lambda: (got := service.client().get_lease(lease.id)).state.ended and got,
                         30, f"the lease reclaimed after its {HEARTBEAT_TTL}s heartbeat TTL")
        assert ended.state.value == "reclaimed" and "heartbeat" in ended.reason, ended.reason
        wait_for(lambda: not psutil.pid_exists(worker_pid), 15, "the reclaimed lease's worker to stop")
        assert sum(_assert_allocations_match(service).values()) == 0, "the slice came back at once"

    told = run(kc, "1 + 1", timeout=60)
    assert not told.ok and f"lease {lease.id} was reclaimed" in told.text(), told.text()
    assert "heartbeat" in told.text() and "Traceback" not in told.text()
    assert remote_value(kc, "os.getpid()") == local_pid, "the next cell runs locally"


def test_a_cut_client_keeps_its_lease_while_a_cell_runs_and_loses_it_once_idle(site, nb_kernel, tmp_path):
    """Heartbeats stop with the link, but a running cell is never reclaimed:
    the lease outlives its heartbeat TTL while the worker is busy, and is
    reclaimed once the cell ends. After the heal the notebook says so."""
    net, nb, service = site.net, site.nb, site.service
    _, kc = nb_kernel
    local_pid = remote_value(kc, "import os; os.getpid()")
    _attach(kc, "%gpu acquire 0.5")
    worker_pid = remote_value(kc, "import os, pathlib, time; os.getpid()")
    lease = _only_lease(service)
    go = tmp_path / "go"  # the hosts share the file system: the cell waits for the test to create it
    msg_id = kc.execute(f"while not pathlib.Path({str(go)!r}).exists():\n    time.sleep(0.05)\n'done'")
    wait_for(lambda: service.client().get_lease(lease.id).worker["execution_state"] == "busy", 30,
             "the agent to report the cell running")

    with net.cut(nb):
        time.sleep(HEARTBEAT_TTL + 1.0)  # let the TTL pass with no heartbeat, the cell still running
        kept = service.client().get_lease(lease.id)
        assert kept.state.value == "active" and kept.worker["execution_state"] == "busy", kept.reason
        go.touch()
        ended = wait_for(lambda: (got := service.client().get_lease(lease.id)).state.ended and got,
                         30, "the lease reclaimed once its worker is idle")
        assert ended.state.value == "reclaimed" and "heartbeat" in ended.reason, ended.reason
        wait_for(lambda: not psutil.pid_exists(worker_pid), 15, "the reclaimed lease's worker to stop")
        assert sum(_assert_allocations_match(service).values()) == 0, "the slice came back at once"

    # After the heal the cell ends saying the lease was reclaimed; or, if the
    # worker's last messages won that race, with its result (or the words that
    # the worker stopped answering) and the next cell says it.
    told = _collect(kc, msg_id, 60)
    if f"lease {lease.id} was reclaimed" not in told.text():
        assert told.ok or "stopped answering" in told.text(), told.text()
        told = run(kc, "1 + 1", timeout=60)
    assert not told.ok and f"lease {lease.id} was reclaimed" in told.text() and "heartbeat" in told.text(), told.text()
    assert "Traceback" not in told.text()
    assert remote_value(kc, "os.getpid()") == local_pid, "the next cell runs locally"
