"""Operations polish of the ``gpupool`` command: ``--version``, ``--json`` on ``status``,
``pool`` and ``quota`` against a real service, ``--generate-config`` for the service and the
agent, and one line naming the extra when a role's packages are missing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpupool import __version__
from gpupool.wire.leases import LeaseRequest


def gpupool(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpupool.cli", *args], capture_output=True, text=True, timeout=120,
                          **kwargs)


def test_version():
    result = gpupool("--version")
    assert (result.returncode, result.stdout) == (0, f"gpupool {__version__}\n")


@pytest.mark.parametrize("command, traits", [
    ("service", ["c.GPUPool.db_url", "c.PoolLeases.idle_timeout", "c.PoolQuotas.quotas"]),
    ("agent", ["c.AgentWorkers.environments", "c.SlurmLauncher.partition", "c.KubernetesLauncher.image"])])
def test_generate_config_is_a_config_file_of_every_setting(command, traits, tmp_path):
    result = gpupool(command, "--generate-config")
    assert result.returncode == 0, result.stderr
    for trait in traits:
        assert f"# {trait} =" in result.stdout
    path = tmp_path / "gpupool_config.py"
    path.write_text(result.stdout)
    compile(path.read_text(), str(path), "exec")  # every line commented out or valid Python


def test_missing_extra_is_named_not_a_traceback():
    blocker = ("import sys, runpy; sys.modules['sqlalchemy'] = None; sys.argv = ['gpupool', 'service'];"
               "runpy.run_module('gpupool.cli', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == ("gpupool service needs the 'hub' extra: pip install 'gpupool[hub]' "
                                     "(missing module: sqlalchemy)")
    from gpupool.cli import missing_extra

    assert missing_extra("agent", ModuleNotFoundError(name="pynvml")).endswith("'gpupool[agent]' (missing module: pynvml)")
    assert missing_extra("status", ModuleNotFoundError(name="no_such_thing")) is None  # a bug: re-raised


def test_json_output_of_status_pool_and_quota(pool):
    service, agent = pool
    lease = service.client().create_lease(LeaseRequest(fraction=0.5))
    common = ["--url", service.url, "--token", service.user_token]
    status = json.loads(gpupool("status", "--json", *common).stdout)
    assert [l["id"] for l in status["leases"]] == [lease.id]
    assert status["leases"][0]["state"] in ("starting", "active") and status["leases"][0]["owner"] == "tester"
    assert "connection" not in status["leases"][0]  # the worker's key stays out of scripts' output
    assert [n["name"] for n in status["pool"]["nodes"]] == [agent.name]
    pool_json = json.loads(gpupool("pool", "--json", *common).stdout)
    assert pool_json["totals"]["gpus"] == 2
    node, = pool_json["nodes"]  # a preemption's words in gpupool status read whether its node freezes a running cell
    assert node["freezes_running_cell"] is (node["checkpointer"] in ("simulated", "cuda-checkpoint")), node
    table = gpupool("pool", *common)
    assert table.returncode == 0 and agent.name in table.stdout
    quota = gpupool("quota", "show", "--json", *common)
    assert quota.returncode == 0 and isinstance(json.loads(quota.stdout), dict)
    service.client().release(lease.id)
