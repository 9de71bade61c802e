"""An agent with ``c.AgentWorkers.worker_launcher = "slurm"`` against a real Slurm
(tests/support/slurm.py): a lease placed through the service runs its cells in a Slurm
job that holds its GPUs (squeue shows the lease in the job's name and comment,
and another user's ``sbatch --gres=gpu:1`` waits meanwhile); its release ends
the job; a slice is a step of a share job, and an admin's ``scancel`` of the
step ends the lease with Slurm's words, its share job with it; an agent
started again cancels the jobs the one before it left, so no GPU stays held.

Skipped, saying why, where Slurm cannot run (no root, Slurm or munge not installed).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest
from procs import cluster_pool, start_agent, wait_for
# Fixtures: a real Slurm, a second user, an empty queue after each test.
from slurm_fixtures import cluster, halted, no_jobs_left, other, queue  # noqa: F401
from workercell import run_worker_cell

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def pool(cluster, tmp_path):  # noqa: F811
    """A service and one agent whose workers are Slurm jobs on the cluster's node (two GPUs)."""
    with cluster_pool(tmp_path, slurm_args(cluster)) as pair:
        yield pair


def slurm_args(cluster) -> list[str]:  # noqa: F811
    return ["--worker-launcher=slurm", "--transport-encryption=none", f"--SlurmLauncher.node={cluster.name}",
            f"--SlurmLauncher.slurm_conf={cluster.conf}", "--SlurmLauncher.start_timeout=30",
            "--AgentEnforcement.worker_pids_max=96"]


def active(service, request: LeaseRequest):
    lease = service.client().create_lease(request)
    return wait_for(lambda: (got := service.client().get_lease(lease.id)).state is LeaseState.active and got, 90,
                    "the lease active")


def cell(lease, code: str) -> str:
    return asyncio.run(run_worker_cell(lease.connection, code, timeout=60))


def test_a_lease_runs_in_a_slurm_job_that_holds_its_gpus_until_released(cluster, other, pool):  # noqa: F811
    service, _ = pool
    node, = service.client().pool()["nodes"]
    assert (node["host_cpus"], node["host_memory"]) == (8.0, 8000 * 2**20), "the Slurm node's, not this host's"
    lease = active(service, LeaseRequest(fraction=1.0, gpu_count=2))
    rows = [row for row in queue(cluster, "--format=%i|%j|%k|%b|%T") if row[1] == f"gpupool-{lease.id}"]
    assert len(rows) == 1, queue(cluster, "--format=%i|%j|%k|%b|%T")
    job, _, comment, gres, state = rows[0]
    assert (comment, gres, state) == (f"gpupool:lease={lease.id}", "gres:gpu:2", "RUNNING")
    seen = cell(lease, "import os; print(os.environ['SLURM_JOB_ID'], os.environ['GPUPOOL_LEASE_ID'], 6 * 7)")
    assert seen.split() == [job, lease.id, "42"]

    waiting = cluster.sbatch("--gres=gpu:1", "--mem=64M", user=other)
    time.sleep(3)  # scheduling passes: both GPUs are the worker's
    assert (cluster.job_field(waiting, "JobState"), cluster.job_field(waiting, "Reason")) == ("PENDING", "Resources")
    service.client().release(lease.id)
    wait_for(lambda: service.client().get_lease(lease.id).state.ended, 60, "the lease ended")
    assert cluster.wait_job(waiting, ["RUNNING"]) == "RUNNING"
    assert not [row for row in queue(cluster, "--format=%i|%j") if row[1].startswith("gpupool-")], "its job ended"


def test_an_admin_scancel_of_a_slice_ends_the_lease_with_slurms_words(cluster, pool):  # noqa: F811
    service, _ = pool
    lease = active(service, LeaseRequest(fraction=0.5))
    names = {row[1] for row in queue(cluster, "--format=%i|%j")}
    assert f"gpupool-share-{cluster.name}" in names, names
    step = cell(lease, "import os; print(os.environ['SLURM_JOB_ID'] + '.' + os.environ['SLURM_STEP_ID'])").strip()
    cluster.run("scancel", step)  # root: the cluster's admin
    ended = wait_for(lambda: (got := service.client().get_lease(lease.id)).state.ended and got, 90, "the lease ended")
    assert f"Slurm ended the worker's job {step}: it was cancelled in Slurm" in ended.reason, ended.reason
    # The lease's end stops its worker: the share job, with no slice left, goes too.
    wait_for(lambda: not queue(cluster, "--format=%i"), 60, "no job left in Slurm")


def test_after_kill_9_of_the_agent_a_new_one_re_adopts_its_slurm_workers(cluster, pool, tmp_path):  # noqa: F811
    """A lease job and a slice's step keep running while their agent is gone (the step's srun in a
    session of its own); the agent started again finds both from their records, with their variables,
    and cancels the share job no worker of it holds any more once the slice is released."""
    service, agent = pool
    whole, piece = active(service, LeaseRequest(fraction=1.0)), active(service, LeaseRequest(fraction=0.5))
    for lease, value in ((whole, 1), (piece, 2)):
        cell(lease, f"kept = {value}")
    os.kill(agent.proc.pid, signal.SIGKILL)
    agent.proc.wait()
    again = start_agent(tmp_path, service, simulate="2xA100-80GB", extra_args=slurm_args(cluster))
    try:
        assert "re-adopted its worker in Slurm job" in again.log.read_text()
        for lease, value in ((whole, 1), (piece, 2)):
            assert service.client().get_lease(lease.id).state is LeaseState.active
            assert cell(lease, "print(kept)").strip() == str(value)
        for lease in (whole, piece):
            service.client().release(lease.id)
        wait_for(lambda: not queue(cluster, "--format=%i"), 60, "no job left in Slurm")
    finally:
        again.stop()


def test_park_stops_a_slices_step_where_it_is_and_resume_goes_on(cluster, pool):  # noqa: F811
    """A park freezes the worker through Slurm (SIGSTOP of its step) with its variables; the service's
    resume thaws it and the next cell finds them."""
    service, _ = pool
    lease = active(service, LeaseRequest(fraction=0.5))
    assert cell(lease, "x = 41; import os; print(os.getpid())").strip().isdigit()
    pid = int(cell(lease, "print(os.getpid())"))
    parked = service.client().park(lease.id)
    assert parked.state is LeaseState.parked, parked
    assert halted(pid), psutil.Process(pid).status()  # SIGSTOP, or the freezer of proctrack/cgroup
    service.client().resume(lease.id)
    wait_for(lambda: service.client().get_lease(lease.id).state is LeaseState.active, 60, "the lease resumed")
    assert cell(lease, "print(x + 1)").strip() == "42"
    service.client().release(lease.id)
    wait_for(lambda: not queue(cluster, "--format=%i"), 60, "no job left in Slurm")


def test_a_whole_gpu_lease_parks_to_disk_which_gives_slurm_its_gpus_back(cluster, other, pool):  # noqa: F811
    """Slurm keeps a suspended job's GRES, so a lease job parked in memory would hold its GPUs while the
    pool places others there: its park goes to disk instead (the job ends, said in the reason), another
    user's job takes the GPUs, and the resume loads the variables into a new job."""
    service, _ = pool
    lease = active(service, LeaseRequest(fraction=1.0, gpu_count=2))
    cell(lease, "x = 41")
    parked = service.client().park(lease.id)
    assert parked.state is LeaseState.parked and parked.parked["tier"] == "disk", parked.parked
    assert "Slurm keeps the GPU of a suspended job" in parked.parked["reason"], parked.parked
    wait_for(lambda: not [row for row in queue(cluster, "--format=%i|%j") if row[1].startswith("gpupool-")], 60,
             "the lease's job ended")
    theirs = cluster.sbatch("--gres=gpu:2", "--mem=64M", user=other)
    assert cluster.wait_job(theirs, ["RUNNING"]) == "RUNNING"
    cluster.run("scancel", str(theirs))
    service.client().resume(lease.id)
    resumed = wait_for(lambda: (got := service.client().get_lease(lease.id)).state is LeaseState.active and got, 90,
                       "the lease resumed")
    assert cell(resumed, "print(x + 1)").strip() == "42"
    service.client().release(lease.id)
    wait_for(lambda: not queue(cluster, "--format=%i"), 60, "no job left in Slurm")


def test_a_slice_that_starts_tasks_without_end_stops_at_its_own_limit(cluster, pool):  # noqa: F811
    """Slurm sets no task limit; the agent's (``worker_pids_max``, 96 here) holds the slice's step:
    a thread start beyond it fails in that worker only, and the worker goes on."""
    service, agent = pool
    lease = active(service, LeaseRequest(fraction=0.5))
    started = cell(lease, "import threading\nhold, n, why = threading.Event(), 0, ''\ntry:\n"
                          "    for _ in range(1000):\n"
                          "        threading.Thread(target=hold.wait, daemon=True).start(); n += 1\n"
                          "except RuntimeError as e:\n    why = str(e)\nhold.set()\nprint(n, why)")
    count, why = started.split(" ", 1)
    assert 48 < int(count) < 96 and "can't start new thread" in why, started
    assert cell(lease, "print(6 * 7)").strip() == "42"
    assert f"lease {lease.id} limited to 96 tasks" in agent.log.read_text()
    service.client().release(lease.id)
    wait_for(lambda: not queue(cluster, "--format=%i"), 60, "no job left in Slurm")


def test_a_worker_that_exits_by_itself_ends_its_lease_with_slurms_words(cluster, pool):  # noqa: F811
    service, _ = pool
    lease = active(service, LeaseRequest(fraction=1.0))
    with pytest.raises((TimeoutError, RuntimeError)):  # the kernel is gone before it can answer
        asyncio.run(run_worker_cell(lease.connection, "import os; os._exit(3)", timeout=5))
    ended = wait_for(lambda: (got := service.client().get_lease(lease.id)).state.ended and got, 90, "the lease ended")
    assert "Slurm ended the worker's job" in ended.reason and "exited with code 3" in ended.reason, ended.reason
    wait_for(lambda: not queue(cluster, "--format=%i"), 60, "no job left in Slurm")
