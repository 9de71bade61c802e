"""What the Slurm tests share: the one-node cluster and a second account as
fixtures, an empty queue after each test, and a lease's worker files."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from jupyter_client.connect import write_connection_file

import slurm
from gpupool.node.enforcement.base import slice_environment
from gpupool.node.workers import WorkerSpec, worker_environment
from gpupool.node.workers.launchers.slurm import SlurmLauncher, SlurmWorkerRecord
from gpupool.node.workers.launchers.slurm.launcher import kernel_command
from gpupool.node.workers.launchers.slurm.request import job_environment
from gpupool.wire.nodes import GPUInfo
from workercell import run_worker_cell

GiB = 2**30


GPUS = tuple(GPUInfo(f"GPU-{i}", "NVIDIA A100-SXM4-80GB", i, 80 * GiB) for i in range(2))


@pytest.fixture(scope="module")
def cluster():
    why = slurm.unavailable()
    if why:
        pytest.skip(why)
    # Not under pytest's own (0700) folders: the second user reads the configuration there.
    node = slurm.SlurmCluster(Path(tempfile.mkdtemp(prefix="gpupool-slurm-")))
    try:
        node.start()
    except (RuntimeError, OSError, FileNotFoundError) as exc:
        pytest.skip(f"Slurm could not start here: {exc}")
    yield node
    node.stop()


@pytest.fixture(scope="module")
def other(cluster):
    """A second account, whose batch jobs compete with the workers."""
    try:
        name, made = slurm.other_user()
    except (RuntimeError, OSError) as exc:
        pytest.skip(str(exc))
    yield name
    if made:
        slurm.remove_user(name)


@pytest.fixture(autouse=True)
def no_jobs_left(cluster):
    """Each test starts and ends with an empty queue."""
    yield
    cluster.run("scancel", "--full", "--partition=gpu", check=False)
    deadline = time.monotonic() + 30
    while cluster.run("squeue", "--noheader", "--format=%i", check=False).stdout.strip():
        assert time.monotonic() < deadline, "jobs were left in the queue"
        time.sleep(0.2)


def end_sruns(cluster, launcher: SlurmLauncher, timeout: float = 30) -> None:
    """After a test that used ``launcher``: cancel the jobs it left (a failed test's workers), then reap
    the sruns of its slices, which end with their steps; one still running after ``timeout`` seconds is
    killed. So no srun outlives its test, to be collected, still running, during a later test (a
    ResourceWarning there)."""
    cluster.run("scancel", "--full", "--partition=gpu", check=False)
    for srun in launcher._sruns.values():  # the launcher's own: it keeps them to reap when it stops a step
        try:
            srun.wait(timeout)
        except subprocess.TimeoutExpired:
            srun.kill()
            srun.wait()


class Worker:
    """A lease's worker files and the calls on it."""

    def __init__(self, folder: Path, spec: WorkerSpec, fresh: bool = True) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.connection_file = folder / f"kernel-{spec.lease_id}.json"
        if fresh:  # else: the files of a worker that runs already
            write_connection_file(str(self.connection_file), ip="127.0.0.1",
                                  key=secrets.token_hex(16).encode())
        self.log_path = folder / f"{spec.lease_id}.log"
        self.command = kernel_command(sys.executable, self.connection_file, history=folder / f"{spec.lease_id}.sqlite")
        self.env = job_environment(worker_environment(os.environ, slice_environment(
            spec.gpus, spec.fraction, spec.memory, spec.lease_id, spec.owner, "node1")))
        self.workdir = str(folder)

    async def start(self, launcher: SlurmLauncher, gpu_index: int | None = None) -> SlurmWorkerRecord:
        return await launcher.start(self.spec, self.command, self.connection_file, self.log_path, self.workdir,
                                    self.env, gpu_index)

    async def run(self, code: str, timeout: float = 60) -> str:
        """Run ``code`` on the worker as a notebook client would; returns its stdout. The first cell also
        waits for the kernel to start. AssertionError after ``timeout`` seconds, with what the worker and
        its srun wrote."""
        try:
            return await run_worker_cell(json.loads(self.connection_file.read_text()), code, timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"the worker of lease {self.spec.lease_id} did not run {code!r} within {timeout:g} s "
                                 f"(its kernel's start included); what it wrote:\n{self.output()}") from None

    async def answers(self, timeout: float) -> bool:
        """True when the kernel runs an empty cell within ``timeout`` seconds."""
        try:
            await run_worker_cell(json.loads(self.connection_file.read_text()), "pass", timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def output(self, lines: int = 15) -> str:
        """The last lines of the worker's log and of its srun's (a slice's), for a failure's message."""
        said = []
        for path in (self.log_path, self.log_path.with_suffix(".srun.log")):
            if path.exists():
                said.append(f"{path.name}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(said) or "(nothing)"


def spec(lease_id: str, gpus: int = 1, fraction: float = 1.0) -> WorkerSpec:
    return WorkerSpec(lease_id, "ann", GPUS[:gpus], fraction, 40 * GiB, cpus=1.0, host_memory=GiB)


def queue(cluster, *extra: str) -> list[list[str]]:
    out = cluster.run("squeue", "--noheader", *extra, check=False).stdout
    return [line.split("|") for line in out.splitlines() if line.strip()]


def halted(pid: int) -> bool:
    """True when ``pid`` is stopped (SIGSTOP) or its v1 freezer cgroup is frozen: Slurm's suspend does either."""
    if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
        return True
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "freezer" in controllers.split(","):
            state = Path("/sys/fs/cgroup/freezer", path.lstrip("/"), "freezer.state")
            return state.exists() and state.read_text().strip() == "FROZEN"
    return False
