"""The Slurm launcher against a real Slurm (tests/support/slurm.py: slurmctld, slurmd and
munged of Debian's slurm-wlm 22.05 on private ports, two GPUs as GRES over
device nodes): a lease's worker is a Slurm job running a real ipykernel that a
jupyter_client runs cells on; squeue shows the job with the lease in its name
and comment and the GRES it holds; another user's ``sbatch --gres=gpu:1``
waits while the worker holds the GPU and starts once it is released; an
admin's ``scancel``, a node failure and a time limit end the lease with
Slurm's words; a new launcher finds a running worker again from its record
alone; slices share one GPU as steps of a share job; park suspends the job.

Skipped, saying why, where Slurm cannot run (no root, Slurm or munge not installed).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

# Fixtures: a real Slurm, a second user, an empty queue after each test.
from slurm_fixtures import Worker, cluster, end_sruns, halted, no_jobs_left, other, queue, spec  # noqa: F401
from gpupool.node.workers.launchers.slurm import SlurmError, SlurmLauncher, SlurmWorkerRecord

GiB = 2**30
pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def launcher(cluster):
    slurm = SlurmLauncher(node=cluster.name, slurm_conf=str(cluster.conf), start_timeout=30, command_timeout=30)
    yield slurm
    end_sruns(cluster, slurm)  # a failed test's slices: their jobs cancelled, their sruns reaped


async def until(probe, timeout: float = 30, step: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(step)


def open_errno(path: Path) -> int:
    """The errno opening ``path`` read-write fails with (the devices have no driver here)."""
    try:
        os.close(os.open(path, os.O_RDWR))
    except OSError as exc:
        return exc.errno
    return 0


def memory_limit(pid: int) -> int | None:
    """The nearest finite v1 memory limit above ``pid`` (Slurm sets it on the job and on each step,
    not on the task's own folder); None without one."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory", path.lstrip("/"))
            while folder != Path("/sys/fs/cgroup/memory"):
                limit = int((folder / "memory.limit_in_bytes").read_text())
                if limit < 2**62:
                    return limit
                folder = folder.parent
    return None


# -- a whole-GPU lease ---------------------------------------------------------------------------------------

def test_a_lease_runs_its_cells_in_a_slurm_job_that_holds_its_gpu(cluster, launcher, other, tmp_path):
    worker = Worker(tmp_path, spec("L-whole-1"))

    async def scenario():
        record = await worker.start(launcher)
        job = str(record.job_id)
        rows = queue(cluster, "--format=%i|%j|%k|%b|%T|%u")
        assert [job, "gpupool-L-whole-1", "gpupool:lease=L-whole-1", "gres:gpu:1", "RUNNING", "root"] in rows
        assert cluster.job_field(job, "GRES") == f"gpu:1(IDX:{record.gpus[0]})"

        seen = await worker.run("import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['SLURM_JOB_ID'], "
                                "os.environ['SLURM_JOB_GPUS'], os.environ['GPUPOOL_LEASE_ID'])")
        # Slurm numbers the job's own devices from 0; SLURM_JOB_GPUS names the node's device.
        assert seen.split() == ["0", job, str(record.gpus[0]), "L-whole-1"]
        if cluster.confined:  # Slurm's task/cgroup: the job may open its own GPU only
            mine, theirs = cluster.devices()[record.gpus[0]], cluster.devices()[1 - record.gpus[0]]
            code = f"import os\nfor p in ({str(mine)!r}, {str(theirs)!r}):\n    try: os.open(p, os.O_RDWR)\n" \
                   "    except OSError as e: print(e.errno)"
            assert (await worker.run(code)).split() == [str(errno.ENXIO), str(errno.EPERM)]
            assert {memory_limit(p) for p in await launcher.commands.pids(record.job_id)} == {GiB}  # --mem

        # Someone else's batch jobs: the first gets the other GPU, the second waits for the worker's.
        first = cluster.sbatch("--gres=gpu:1", "--mem=64M", user=other)
        assert cluster.wait_job(first, ["RUNNING"]) == "RUNNING"
        assert cluster.job_field(first, "GRES") == f"gpu:1(IDX:{1 - record.gpus[0]})"
        second = cluster.sbatch("--gres=gpu:1", "--mem=64M", user=other)
        await asyncio.sleep(4)  # several scheduling passes
        assert (cluster.job_field(second, "JobState"), cluster.job_field(second, "Reason")) == ("PENDING", "Resources")
        node = cluster.run("scontrol", "--oneliner", "show", "node", cluster.name).stdout
        assert "CPUAlloc=2 " in node  # six CPUs idle: the GPU is what it waits for
        assert (await worker.run("print(6 * 7)")).strip() == "42"

        pids = await launcher.commands.pids(record.job_id)
        assert pids and all(psutil.pid_exists(p) for p in pids)
        await launcher.stop(record)  # release
        assert await launcher.commands.pids(record.job_id) == []
        assert not any(psutil.pid_exists(p) for p in pids)
        assert cluster.wait_job(second, ["RUNNING"]) == "RUNNING"
        assert cluster.job_field(second, "GRES") == f"gpu:1(IDX:{record.gpus[0]})"

    asyncio.run(scenario())


def test_an_admin_scancel_ends_the_lease_with_words(cluster, launcher, tmp_path):
    worker = Worker(tmp_path, spec("L-cancel"))

    async def scenario():
        record = await worker.start(launcher)
        assert await launcher.ended(record) is None
        cluster.run("scancel", str(record.job_id))  # root: the cluster's admin
        said = await until(lambda: launcher.ended(record))
        assert said == (f"Slurm ended the worker's job {record.job_id}: it was cancelled in Slurm "
                        "(scancel, by an administrator or the job's owner)")
        assert f"*** JOB {record.job_id} ON {cluster.name} CANCELLED AT" in worker.log_path.read_text()

    asyncio.run(scenario())


def test_a_new_launcher_finds_a_running_worker_from_its_record_alone(cluster, launcher, tmp_path):
    worker = Worker(tmp_path, spec("L-adopt"))

    async def scenario():
        record = await worker.start(launcher)
        await worker.run("kept = 'still here'")
        saved = record.dumps()
        del record
        # "Restart": a fresh launcher and the JSON only.
        again = SlurmLauncher(node=cluster.name, slurm_conf=str(cluster.conf))
        record = SlurmWorkerRecord.loads(saved)
        job = await again.adopt(record)
        assert job is not None and job.state == "RUNNING" and job.name == "gpupool-L-adopt"
        assert (await worker.run("print(kept)")).strip() == "still here"
        # A record of another lease under the same job id is not adopted.
        foreign = SlurmWorkerRecord.loads(saved.replace("gpupool-L-adopt", "gpupool-L-other"))
        assert await again.adopt(foreign) is None
        await again.stop(record)
        assert await again.adopt(record) is None
        assert await again.ended(record) is not None

    asyncio.run(scenario())


def test_park_suspends_the_job_and_keeps_its_gpu(cluster, launcher, other, tmp_path):
    worker = Worker(tmp_path, spec("L-park", gpus=2))

    async def scenario():
        record = await worker.start(launcher)
        await worker.run("x = 1")
        waiting = cluster.sbatch("--gres=gpu:1", "--mem=64M", user=other)
        await launcher.park(record)
        assert cluster.job_field(record.job_id, "JobState") == "SUSPENDED"
        assert not await worker.answers(2)
        pids = await launcher.commands.pids(record.job_id)
        assert pids and all(halted(p) for p in pids)
        await asyncio.sleep(3)  # Slurm keeps the suspended job's GRES: the other job still waits
        assert cluster.job_field(waiting, "JobState") == "PENDING"
        await launcher.unpark(record)
        assert (await worker.run("print(x + 1)")).strip() == "2"
        assert await launcher.adopt(record) is not None
        await launcher.stop(record)

    asyncio.run(scenario())


def test_a_job_pending_too_long_fails_the_start_and_is_cancelled(cluster, launcher, other, tmp_path):
    launcher.start_timeout = 3
    hog = cluster.sbatch("--gres=gpu:2", "--mem=64M", user=other)
    cluster.wait_job(hog, ["RUNNING"])
    worker = Worker(tmp_path, spec("L-waits"))
    with pytest.raises(SlurmError, match=r"Slurm did not start job \d+ within 3 s \(PENDING(, reason \w+)?\); "
                                        r"it was cancelled"):
        asyncio.run(worker.start(launcher))
    assert not [row for row in queue(cluster, "--format=%j") if row == ["gpupool-L-waits"]]


# -- slices -----------------------------------------------------------------------------------------------------

def test_slices_are_steps_of_one_share_job_that_holds_their_gpu(cluster, launcher, other, tmp_path):
    first, second = Worker(tmp_path / "a", spec("L-half-a", fraction=0.5)), Worker(tmp_path / "b",
                                                                                  spec("L-half-b", fraction=0.5))

    async def scenario():
        one = await first.start(launcher)
        two = await second.start(launcher, gpu_index=one.gpus[0])
        assert one.job_id == two.job_id and one.step_id != two.step_id and one.gpus == two.gpus
        steps = queue(cluster, "--steps", "--format=%i|%j|%b")
        assert [one.ident, "gpupool-L-half-a", "gres:gpu:1"] in steps
        assert [two.ident, "gpupool-L-half-b", "gres:gpu:1"] in steps
        assert [str(one.job_id), f"gpupool-share-{cluster.name}", "gpupool:share", "gres:gpu:1"] in queue(
            cluster, "--format=%i|%j|%k|%b")
        assert (await first.run("import os; print(os.environ['SLURM_STEP_ID'], os.environ['CUDA_VISIBLE_DEVICES'])"
                                )).split() == [str(one.step_id), "0"]
        assert (await second.run("print('b')")).strip() == "b"
        if cluster.confined:  # each step is held to its lease's memory (a cgroup of its own), not the share job's
            for record in (one, two):
                pids = await launcher.commands.pids(record.job_id, record.step_id)
                assert pids and {memory_limit(p) for p in pids} == {GiB}
        taken = cluster.sbatch("--gres=gpu:1", "--mem=64M", user=other)
        cluster.wait_job(taken, ["RUNNING"])
        assert cluster.job_field(taken, "GRES") == f"gpu:1(IDX:{1 - one.gpus[0]})"
        waits = cluster.sbatch("--gres=gpu:1", "--mem=64M", user=other)
        await asyncio.sleep(4)
        assert cluster.job_field(waits, "JobState") == "PENDING"

        await launcher.stop(one)  # the other slice still runs: the share job stays
        assert cluster.job_field(one.job_id, "JobState") == "RUNNING"
        assert (await second.run("print('still')")).strip() == "still"
        assert await launcher.adopt(one) is None and await launcher.adopt(two) is not None
        await launcher.stop(two)  # the last slice: the share job goes, and the GPU with it
        assert cluster.wait_job(waits, ["RUNNING"]) == "RUNNING"
        assert cluster.job_field(waits, "GRES") == f"gpu:1(IDX:{one.gpus[0]})"

    asyncio.run(scenario())


def test_an_admin_scancel_of_a_step_ends_the_slice_with_words(cluster, launcher, tmp_path):
    worker = Worker(tmp_path, spec("L-step-cancel", fraction=0.25))

    async def scenario():
        record = await worker.start(launcher)
        # The step is listed once slurmctld made it, before its task runs: cancelled then, srun says
        # "aborted before step completely launched" and slurmstepd writes no end line. The agent hands
        # a lease over once its kernel answers; so does this test.
        assert (await worker.run("print('up')")).strip() == "up"
        assert await launcher.ended(record) is None
        cluster.run("scancel", record.ident)
        said = await until(lambda: launcher.ended(record))
        assert said == (f"Slurm ended the worker's job {record.ident}: it was cancelled in Slurm (scancel, by an "
                        "administrator or the job's owner)"), _logs(record)  # from slurmstepd's end line
        await launcher.stop(record)  # the lease ends: its share job, now empty, goes
        assert await until(lambda: _gone(launcher, record.job_id))

    asyncio.run(scenario())


async def _gone(launcher, job_id):
    job = await launcher.commands.job(job_id)
    return job is None or job.ended


# -- Slurm's own ends ---------------------------------------------------------------------------------------------

def test_a_node_failure_ends_the_lease_with_words(cluster, launcher, tmp_path):
    worker = Worker(tmp_path, spec("L-node"))

    async def scenario():
        record = await worker.start(launcher)
        cluster.run("scontrol", "update", f"nodename={cluster.name}", "state=down", "reason=gpupool test")
        try:
            said = await until(lambda: launcher.ended(record))
        finally:
            cluster.run("scontrol", "update", f"nodename={cluster.name}", "state=resume", check=False)
        assert said == f"Slurm ended the worker's job {record.job_id}: its node {cluster.name} failed"
        assert cluster.job_field(record.job_id, "JobState") == "NODE_FAIL"  # not requeued: a new kernel is no lease's
        deadline = time.monotonic() + 30
        while cluster.run("sinfo", "--noheader", "--format=%T").stdout.strip() != "idle":
            assert time.monotonic() < deadline
            time.sleep(0.5)

    asyncio.run(scenario())


def test_a_slice_out_of_its_host_memory_ends_with_words_at_once(cluster, launcher, tmp_path):
    """A slice's step beyond its --mem (1 GiB) is OOM-killed by Slurm's cgroup; slurmctld forgets the
    step, but its srun and slurmstepd said why: the words say it, without waiting out END_LINE_WAIT_S."""
    if not cluster.confined:
        pytest.skip("Slurm runs without task/cgroup here: no memory limit to reach")
    worker = Worker(tmp_path, spec("L-step-oom", fraction=0.5))

    async def scenario():
        record = await worker.start(launcher)
        assert (await worker.run("print('up')")).strip() == "up"
        with pytest.raises(AssertionError):  # the kernel is killed mid-cell: no reply
            await worker.run("b = bytearray(3 * 2**30)", timeout=20)
        began = time.monotonic()
        said = await until(lambda: launcher.ended(record))
        assert said == (f"Slurm ended the worker's job {record.ident}: it ran out of its memory (the lease's host "
                        "memory, --mem)"), _logs(record)
        assert time.monotonic() - began < 10
        await launcher.stop(record)

    asyncio.run(scenario())


@pytest.mark.timeout(240)
def test_a_time_limit_ends_the_lease_with_words(cluster, launcher, tmp_path):
    launcher.time_limit = "1"  # a minute; slurmctld checks limits every 30 s
    worker = Worker(tmp_path, spec("L-time"))

    async def scenario():
        record = await worker.start(launcher)
        said = await until(lambda: launcher.ended(record), timeout=150, step=2)
        assert said == (f"Slurm ended the worker's job {record.job_id}: it reached its time limit of 00:01:00 "
                        "(c.SlurmLauncher.time_limit, or the partition's MaxTime)")
        assert "DUE TO TIME LIMIT" in worker.log_path.read_text()

    asyncio.run(scenario())


# -- the agent killed --------------------------------------------------------------------------------------------

AGENT = """
import asyncio, json, sys
sys.path.insert(0, {tests!r})
from slurm_fixtures import Worker, spec
from pathlib import Path
from gpupool.node.workers.launchers.slurm import SlurmLauncher

async def main():
    launcher = SlurmLauncher(node={node!r}, slurm_conf={conf!r}, start_timeout=30)
    whole = await Worker(Path({folder!r}) / "whole", spec("L-k9-whole")).start(launcher)
    piece = await Worker(Path({folder!r}) / "piece", spec("L-k9-slice", fraction=0.5)).start(launcher)
    print(json.dumps([whole.dumps(), piece.dumps()]), flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_after_kill_9_of_the_agent_a_new_one_re_adopts_both_kinds_of_worker(cluster, tmp_path):
    code = AGENT.format(tests=str(Path(__file__).parents[1] / "support"), node=cluster.name, conf=str(cluster.conf),
                        folder=str(tmp_path))
    agent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = agent.stdout.readline()
    finally:
        agent.kill()  # SIGKILL: nothing of it runs any more, its sruns included unless they left its session
        agent.wait()
        agent.stdout.close()
    assert line, "the agent printed no records"
    records = [SlurmWorkerRecord.loads(text) for text in json.loads(line)]
    whole, piece = (Worker(tmp_path / "whole", spec("L-k9-whole"), fresh=False),
                    Worker(tmp_path / "piece", spec("L-k9-slice", fraction=0.5), fresh=False))

    async def scenario():
        again = SlurmLauncher(node=cluster.name, slurm_conf=str(cluster.conf))
        await asyncio.sleep(2)  # a step whose srun died would be cancelled by now
        for record, worker in zip(records, (whole, piece)):
            assert await again.adopt(record) is not None, record
            assert (await worker.run("print('alive')")).strip() == "alive"
        for record in records:
            await again.stop(record)
            assert await again.adopt(record) is None

    asyncio.run(scenario())


def _logs(record) -> str:
    """What the worker's step and its srun wrote (for a failed assertion's message)."""
    log = Path(record.log_path)
    return "\n".join(p.read_text(errors="replace") for p in (log, log.with_suffix(".srun.log")) if p.exists())
