"""A new worker launcher from tests/ alone: tests/support/launcher_demo.py, made known
by one entry point, is picked by name (``--worker-launcher=demo``) by a real
agent, which starts a real lease's worker with it.

The entry point is registered the way an installed plugin package registers
it, with a ``*.dist-info/entry_points.txt`` on ``sys.path``; nothing in
gpupool names the launcher.
"""

from __future__ import annotations

import asyncio

import pytest
from traitlets import TraitError

from gpupool.node.workers.launchers import available, launcher_class
from gpupool.node.workers.launchers.local import LocalLauncher
from gpupool.wire.leases import LeaseRequest
from plugins import install_plugin, use_plugin
from procs import start_agent, start_service
from workercell import run_worker_cell

GROUP = "gpupool.worker_launchers"


@pytest.fixture
def demo_plugin(tmp_path, monkeypatch):
    """``demo`` in the ``gpupool.worker_launchers`` group, in this process and in its children."""
    yield from use_plugin(monkeypatch, install_plugin(tmp_path, GROUP, "demo = launcher_demo:DemoLauncher"),
                          "launcher_demo")


def test_the_local_launcher_is_the_default_and_slurm_and_kubernetes_the_other_built_ins():
    from gpupool.node.settings import AgentWorkers

    assert available() == ("local", "slurm", "kubernetes")
    assert launcher_class("local") is LocalLauncher
    assert launcher_class("slurm").__name__ == "SlurmWorkers" and not launcher_class("slurm").keeps_warm
    assert launcher_class("kubernetes").__name__ == "KubernetesWorkers" and not launcher_class("kubernetes").keeps_warm
    assert AgentWorkers().worker_launcher == "local"
    with pytest.raises(ValueError, match="unknown worker launcher 'pod'; choose one of local, slurm, kubernetes"):
        launcher_class("pod")
    with pytest.raises(TraitError, match=r"'worker_launcher' .* any of \['local', 'slurm', 'kubernetes'\], not 'pod'"):
        AgentWorkers(worker_launcher="pod")


def test_a_plugin_is_listed_and_selected_by_name(demo_plugin):
    from gpupool.node.settings import AgentWorkers

    assert available() == ("local", "slurm", "kubernetes", "demo")
    assert launcher_class("demo").__name__ == "DemoLauncher"
    assert AgentWorkers(worker_launcher="demo").worker_launcher == "demo"
    help_text = " ".join(AgentWorkers.class_traits()["worker_launcher"].help.split())
    assert "installed here: local" in help_text and "gpupool.worker_launchers" in help_text


def test_an_entry_point_that_names_no_launcher_is_refused(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(install_plugin(tmp_path, GROUP, "broken = os.path:join")))
    with pytest.raises(TypeError, match="names no WorkerLauncher subclass"):
        launcher_class("broken")


def test_an_agent_starts_a_leases_worker_with_the_plugin(tmp_path, demo_plugin):
    service = start_service(tmp_path)  # knows nothing of the plugin: the node starts workers as it likes
    agent = start_agent(tmp_path, service, name="node-demo", simulate="1xA100-80GB",
                        extra_args=["--worker-launcher=demo"])  # a warm worker too (the default 1)
    try:
        client = service.client()
        lease = client.get_lease(client.create_lease(LeaseRequest(fraction=0.5)).id, wait=60, state="starting")
        assert lease.state.value == "active" and lease.node == "node-demo"
        pid = int(asyncio.run(run_worker_cell(lease.connection, "import os; print(os.getpid())")))
        # started by the plugin: cold for the lease, or warm ahead of it (then bound to it)
        notes = [line.split() for line in (agent.state_dir / "demo-launcher.log").read_text().splitlines()]
        assert str(pid) in {noted_pid for _, noted_pid, _ in notes}, notes
        client.release(lease.id)
    finally:
        agent.stop()
        service.stop()
