"""deploy/systemd: the units pass ``systemd-analyze verify`` (where it runs) and score low on
``systemd-analyze security``, their command lines and config file parse with the real
gpupool, they are hardened as the README says (the agent's capability bounding set, its
device list, the MPS pipe outside PrivateTmp, containment required), and the addresses line
up (the agents reach the service's port over TLS)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from deploy_parse import SYSTEMD, check_command, check_config_sections, config_assignments, environment_names_read, unit

UNITS = ("gpupool-service.service", "gpupool-agent.service")


def exec_start(name: str) -> list[str]:
    words = shlex.split(unit(name)["Service"]["ExecStart"][0])
    assert words[0] == "/opt/gpupool/bin/gpupool"  # the README's install location
    return ["gpupool", *words[1:]]


def option(argv: list[str], name: str) -> str:
    values = [w.split("=", 1)[1] for w in argv if w.startswith(f"--{name}=")]
    assert len(values) == 1, f"{argv}: expected one --{name}="
    return values[0]


def test_units_pass_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    gpupool = Path(sys.executable).with_name("gpupool")
    for name in UNITS:  # the same unit, with the gpupool this test runs instead of /opt/gpupool's
        (tmp_path / name).write_text((SYSTEMD / name).read_text().replace("/opt/gpupool/bin/gpupool", str(gpupool)))
    result = subprocess.run([analyze, "verify", *(str(tmp_path / n) for n in UNITS)], capture_output=True, text=True)
    if result.returncode != 0 and "Failed to" in result.stderr and "bus" in result.stderr.lower():
        pytest.skip(f"systemd-analyze cannot run here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert not [line for line in result.stderr.splitlines() if "gpupool" in line], result.stderr
    (tmp_path / "broken.service").write_text("[Service]\nExecStart=/no/such/gpupool service\nRestart=sometimes\n")
    broken = subprocess.run([analyze, "verify", str(tmp_path / "broken.service")], capture_output=True, text=True)
    assert broken.returncode != 0  # it does check


#: The most exposure ``systemd-analyze security`` may find (0 best, 10 worst; "OK" is below 4).
EXPOSURE = {"gpupool-service.service": 2.5, "gpupool-agent.service": 4.0}


def test_units_score_low_on_systemd_analyze_security(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    for name, most in EXPOSURE.items():
        (tmp_path / name).write_text((SYSTEMD / name).read_text())
        result = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(tmp_path / name)],
                                capture_output=True, text=True)
        if "offline" in result.stderr and "unrecognized" in result.stderr:
            pytest.skip(f"this systemd-analyze has no --offline: {result.stderr.strip()}")
        level = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
        assert level, result.stdout[-2000:] + result.stderr
        assert float(level.group(1)) <= most, f"{name}: exposure {level.group(1)} (at most {most})\n{result.stdout}"


def test_unit_commands_and_config_parse_with_the_real_cli():
    from gpupool.hub_plugin.app import ServiceApp
    from gpupool.node.agent import NodeAgent

    for name in UNITS:
        check_command(exec_start(name))
    settings = config_assignments((SYSTEMD / "gpupool_config.py").read_text())
    for app in (ServiceApp(), NodeAgent()):
        classes = {c.__name__: c for c in app._classes_inc_parents()}
        mine = {cls: traits for cls, traits in settings.items() if cls in classes}
        assert mine
        check_config_sections(app, mine, "deploy/systemd/gpupool_config.py")
    assert set(settings) == {"GPUPool", "PoolQuotas", "AgentWorkers"}


def test_units_are_hardened_and_keep_state():
    service, agent = unit(UNITS[0])["Service"], unit(UNITS[1])["Service"]
    for section in (service, agent):
        assert section["Restart"] == ["on-failure"] and section["StateDirectory"][0].startswith("gpupool/")
        assert section["ProtectSystem"][0] in ("strict", "full") and section["PrivateTmp"] == ["yes"]
    assert service["NoNewPrivileges"] == ["yes"] and service["User"] == ["gpupool"]
    assert service["CapabilityBoundingSet"] == [""]  # no capability at all
    # The agent makes a cgroup per lease in its own subtree and re-adopts workers after a crash.
    assert agent["Delegate"] == ["yes"] and agent["KillMode"] == ["process"]
    # Root cut down to starting workers as their accounts; the NVIDIA devices and no others.
    assert agent["CapabilityBoundingSet"] == ["CAP_SETUID CAP_SETGID CAP_CHOWN CAP_FOWNER CAP_DAC_OVERRIDE CAP_KILL"]
    assert agent["NoNewPrivileges"] == ["yes"] and agent["AmbientCapabilities"] == [""]
    assert agent["DevicePolicy"] == ["closed"]
    assert {"char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps rw"} <= set(agent["DeviceAllow"])
    # CUDA MPS's pipe is outside the unit's private /tmp, where a host daemon and admins find it.
    env = dict(a.partition("=")[::2] for a in agent["Environment"])
    assert not env["CUDA_MPS_PIPE_DIRECTORY"].startswith(("/tmp", "/var/tmp"))
    assert not env["CUDA_MPS_LOG_DIRECTORY"].startswith(("/tmp", "/var/tmp"))
    # Every Documentation= is a page an install or the project has (tests/deploy/test_deploy_images.py checks the file).
    for section in (unit(UNITS[0])["Unit"], unit(UNITS[1])["Unit"]):
        assert [d.split(":", 1)[0] for d in section["Documentation"]] == ["file", "https"]
    argv = exec_start(UNITS[1])
    assert "--require-containment" in argv
    assert option(argv, "state-dir") == "/var/lib/" + agent["StateDirectory"][0]
    assert option(exec_start(UNITS[0]), "state-dir") == "/var/lib/" + service["StateDirectory"][0]
    for section in (service, agent):
        for assignment in section.get("Environment", []):
            assert assignment.partition("=")[0] in environment_names_read()


def test_addresses_line_up_over_tls():
    service_argv, agent_argv = exec_start(UNITS[0]), exec_start(UNITS[1])
    text = (SYSTEMD / "gpupool_config.py").read_text()
    public = [line.split('"')[1] for line in text.splitlines() if line.startswith("c.GPUPool.public_url")][0]
    target = urlsplit(option(agent_argv, "service-url"))
    assert target.scheme == urlsplit(public).scheme == "https"  # TLS is the default across hosts
    assert (target.hostname, target.port) == (urlsplit(public).hostname, urlsplit(public).port)
    assert target.port == int(option(service_argv, "port")) and option(service_argv, "ip") == "0.0.0.0"
    for argv in (service_argv, agent_argv):
        assert option(argv, "ssl-cert") and option(argv, "ssl-key")


def test_readme_walks_through_three_gpu_hosts_and_a_hub():
    text = (SYSTEMD / "README.md").read_text()
    assert "## Three GPU hosts and a hub" in text
    for name in (*UNITS, "gpupool_config.py"):
        assert name in text


def test_the_service_account_is_an_admin_and_the_readme_uses_its_token():
    """The shipped config's ``admin_users`` names the account the service's unit runs as (``User=``):
    without ``c.GPUPool.api_tokens`` that account's is the only token (STATE_DIR/user_token), which
    the README's quota step uses, so ``gpupool quota set`` works as shipped."""
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("gpupool_config.py", path=str(SYSTEMD)).load_config()
    service_user = unit(UNITS[0])["Service"]["User"][0]
    assert service_user in config.GPUPool.admin_users, (service_user, config.GPUPool.admin_users)
    assert "api_tokens" not in config.GPUPool  # else the service writes no user_token
    state_dir = option(exec_start(UNITS[0]), "state-dir")
    readme = (SYSTEMD / "README.md").read_text()
    [quota] = [line for line in readme.splitlines() if line.strip().startswith("gpupool quota set ")]
    assert quota.strip().endswith("\\")
    assert f"--token-file {state_dir}/user_token" in readme.split(quota, 1)[1].splitlines()[1]
