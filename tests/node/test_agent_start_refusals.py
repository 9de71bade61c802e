"""``gpupool agent`` refuses, at start, settings that can never work: one line naming
the setting (no traceback), exit 1, and nothing made on disk (no state folder), so
systemd's journal shows why instead of an agent that registers and then fails every
lease, retries for ever, or serves with the defaults.

Slurm is stood in for by a folder of small scripts (``c.SlurmLauncher.bin_dir``):
a ``squeue`` that answers (nothing) or says the controller is down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from procs import free_port, stop_process, wait_for


def run_agent(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``gpupool agent`` with a simulated GPU, a service nobody serves and a state folder
    under ``tmp_path`` (``tmp_path/agent``, which a refusal must not make)."""
    service = [] if any(arg.startswith("--service-url=") for arg in args) else ["--service-url=http://127.0.0.1:1"]
    return subprocess.run([sys.executable, "-m", "gpupool.cli", "agent", *service,
                           "--simulate=1xL4", f"--state-dir={tmp_path / 'agent'}", "--port=0", *args],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "GPUPOOL_AGENT_TOKEN": "t"})


def refused(tmp_path: Path, result: subprocess.CompletedProcess) -> str:
    """The one line a refusing agent printed (asserting exit 1, no traceback, no state folder)."""
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and "Bad config" not in result.stderr, result.stderr
    assert not (tmp_path / "agent").exists(), "the state folder was made before the settings were checked"
    [line] = [line for line in result.stderr.splitlines() if line.startswith("gpupool agent: ")]
    return line


def fake_slurm(folder: Path, squeue: str) -> Path:
    """A ``bin_dir`` whose ``squeue`` runs ``squeue`` (shell) and whose ``scontrol`` knows no node."""
    folder.mkdir()
    for name, body in (("squeue", squeue), ("scontrol", "echo 'scontrol: error: no node' >&2; exit 1")):
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return folder


def test_a_config_file_that_fails_to_run_stops_the_agent(tmp_path):
    config = tmp_path / "gpupool_config.py"
    config.write_text('c = get_config()\nc.AgentWorkers.worker_launcher = "slurm"\nc.AgentWorkers.environments = {\n')
    line = refused(tmp_path, run_agent(tmp_path, f"--config={config}"))
    assert line.startswith(f"gpupool agent: config file {config}: SyntaxError: ")
    assert "was never closed" in line and line.endswith("(--config)")


def test_the_service_says_a_broken_config_file_in_one_line(tmp_path):
    config = tmp_path / "gpupool_config.py"
    config.write_text("c = get_config()\nc.GPUPool.admin_users = {'root'\n")
    result = subprocess.run([sys.executable, "-m", "gpupool.cli", "service", "--port=0", f"--config={config}",
                             f"--state-dir={tmp_path / 'service'}"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"gpupool service: config file {config}: SyntaxError: "), result.stderr
    assert not (tmp_path / "service").exists()


@pytest.mark.parametrize("launcher, words", [
    ("slurm", "the Slurm launcher runs workers as the agent's account only (c.AgentWorkers.worker_user is not "
              "supported with worker_launcher = 'slurm'); drop --worker-user"),
    ("kubernetes", "(c.AgentWorkers.worker_user is not supported with worker_launcher = 'kubernetes')"),
])
def test_a_worker_user_with_a_cluster_launcher_is_refused_at_start(tmp_path, launcher, words):
    line = refused(tmp_path, run_agent(tmp_path, f"--worker-launcher={launcher}", "--worker-user=gpupool-worker"))
    assert words in line


@pytest.mark.parametrize("args, words", [
    (["--SlurmLauncher.time_limit=bogus"], "time limit 'bogus' is not in Slurm's format"),
    (["--SlurmLauncher.start_timeout=-5"], "SlurmLauncher.start_timeout: duration must be more than 0 seconds"),
    (["--SlurmLauncher.bin_dir=/nonexistent"], "cannot run squeue: [Errno 2] No such file or directory: "
                                               "'/nonexistent/squeue' (is Slurm's client installed? "
                                               "c.SlurmLauncher.bin_dir)"),
])
def test_bad_slurm_settings_are_one_line(tmp_path, args, words):
    assert words in refused(tmp_path, run_agent(tmp_path, "--worker-launcher=slurm", *args))


def test_a_slurm_controller_that_is_down_is_one_line(tmp_path):
    bin_dir = fake_slurm(tmp_path / "slurm-bin", "echo 'squeue: error: Unable to contact slurm controller "
                                                 "(connect failure)' >&2; exit 1")
    line = refused(tmp_path, run_agent(tmp_path, "--worker-launcher=slurm", f"--SlurmLauncher.bin_dir={bin_dir}",
                                       "--SlurmLauncher.node=gpu-07"))
    assert line == ("gpupool agent: worker_launcher = 'slurm', but Slurm cannot be asked for node gpu-07's jobs: "
                    "squeue --noheader failed (exit code 1): squeue: error: Unable to contact slurm controller "
                    "(connect failure)")


@pytest.mark.parametrize("args, words", [
    (["--name="], "--name='' cannot name a node"),
    (["--service-url=ftp://x"], "--service-url='ftp://x' is not an http:// or https:// URL of the pool service"),
    (["--ip=999.1.1.1"], "--ip=999.1.1.1 names no address of this host"),
    (["--spill-dir=/proc/nope"], "--spill-dir=/proc/nope cannot be made: No such file or directory"),
])
def test_settings_that_can_never_work_are_refused_before_anything_is_made(tmp_path, args, words):
    assert words in refused(tmp_path, run_agent(tmp_path, *args))


def serve(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """An agent that serves (its service is not there: it keeps retrying its registration),
    logging to ``tmp_path/agent.log``, once its start log line was written."""
    log = tmp_path / "agent.log"
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gpupool.cli", "agent", "--service-url=http://127.0.0.1:1",
                                 "--simulate=1xL4", f"--state-dir={tmp_path / 'agent'}", f"--port={free_port()}",
                                 *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "GPUPOOL_AGENT_TOKEN": "t"})
    return proc, log


def test_the_start_log_names_the_worker_launcher_and_the_slurm_node(tmp_path):
    bin_dir = fake_slurm(tmp_path / "slurm-bin", "exit 0")
    proc, log = serve(tmp_path, "--worker-launcher=slurm", f"--SlurmLauncher.bin_dir={bin_dir}",
                      "--SlurmLauncher.node=gpu-07", "--warm-workers=0")
    try:
        line = wait_for(lambda: next((l for l in log.read_text().splitlines() if "serving on" in l), None), 30,
                        "the agent's start log", proc, log)
    finally:
        assert stop_process(proc) == 0, log.read_text()
    assert "worker launcher: slurm on Slurm node gpu-07)" in line, line


def test_the_local_launcher_is_named_in_the_start_log(tmp_path):
    proc, log = serve(tmp_path, "--cgroup-mode=none", "--warm-workers=0")
    try:
        line = wait_for(lambda: next((l for l in log.read_text().splitlines() if "serving on" in l), None), 30,
                        "the agent's start log", proc, log)
    finally:
        assert stop_process(proc) == 0, log.read_text()
    assert "worker launcher: local)" in line, line


def test_the_containment_refusal_names_cgroup_mode_none_once(tmp_path):
    proc, log = serve(tmp_path, "--cgroup-mode=none", "--require-containment")
    try:
        line = wait_for(lambda: next((l for l in log.read_text().splitlines() if "refuses to serve" in l), None), 30,
                        "the agent's refusal", proc, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert stop_process(proc) == 0, log.read_text()
    assert "the workers' cgroups cannot be made (c.AgentEnforcement.cgroup_mode = 'none')." in line, line
    assert line.count("cgroup_mode = 'none'") == 1, line


def test_a_mode_simulated_gpus_cannot_enforce_is_said_at_start(tmp_path):
    """``mps`` on simulated GPUs: the agent enforces ``none`` there, and says so instead of serving silently."""
    proc, log = serve(tmp_path, "--AgentEnforcement.enforcement_mode=mps", "--warm-workers=0")
    try:
        wait_for(lambda: "serving on" in log.read_text(), 30, "the agent's start log", proc, log)
    finally:
        assert stop_process(proc) == 0, log.read_text()
    assert ("enforcement mode 'mps' does not run on simulated GPUs: slices are enforced with 'none' here "
            "(c.AgentEnforcement.enforcement_mode)") in log.read_text()
