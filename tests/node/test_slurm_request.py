"""The Slurm launcher's pure parts: the sbatch/srun command lines built for a
lease from the site's settings, scontrol's output read back, the words a
lease ends with, the worker's record, and the settings as traits
(``c.SlurmLauncher.partition = "gpu"``). The same builders run against a real
Slurm in tests/node/test_slurm.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from traitlets import TraitError
from traitlets.config import Config

from gpupool.node.workers import WorkerSpec
from gpupool.node.workers.launchers.slurm import (JobSettings, SlurmJob, SlurmLauncher, SlurmStep,
                                                         SlurmWorkerRecord, end_reason)
from gpupool.node.workers.launchers.slurm.request import (gres, job_environment, lease_job, share_job,
                                                                 slice_step)
from gpupool.node.workers.launchers.slurm.state import end_line, gpu_indices, parse_pairs
from gpupool.node.workers.launchers.slurm.tasks import _job_folder
from gpupool.wire.nodes import GPUInfo

GiB = 2**30
GPUS = tuple(GPUInfo(f"GPU-{i}", "NVIDIA A100-SXM4-80GB", i, 80 * GiB) for i in range(4))
SITE = JobSettings(node="gpu07", partition="gpu", account="jupyter", qos="interactive", time_limit="7-00:00:00",
                   extra_args=("--constraint=a100",))
COMMAND = ["/opt/py/bin/python", "-m", "gpupool.kernelapp", "-f", "/state/workers/kernel-1.json"]


def whole(n: int = 2, **kw) -> WorkerSpec:
    return WorkerSpec("L-whole", "ann", GPUS[:n], 1.0, 80 * GiB, cpus=kw.get("cpus", 3.5),
                      host_memory=kw.get("host_memory", 16 * GiB))


def piece(fraction: float = 0.5) -> WorkerSpec:
    return WorkerSpec("L-slice", "bob", GPUS[:1], fraction, 40 * GiB, cpus=1.0, host_memory=8 * GiB + 1)


# -- what is asked of Slurm --------------------------------------------------------------------------------

def test_a_whole_gpu_lease_is_a_batch_job_of_its_own():
    job = lease_job(whole(2), SITE, COMMAND, "/state/workers/L-whole.log", "/home/ann")
    assert job.command() == [
        "sbatch", "--parsable", "--job-name=gpupool-L-whole", "--comment=gpupool:lease=L-whole",
        "--nodelist=gpu07", "--nodes=1", "--partition=gpu", "--account=jupyter", "--qos=interactive",
        "--time=7-00:00:00", "--ntasks=1", "--cpus-per-task=4", "--gres=gpu:2", "--output=/state/workers/L-whole.log",
        "--chdir=/home/ann", "--export=ALL", "--no-requeue", "--mem=16384M", "--constraint=a100"]
    assert job.script.splitlines()[-1] == "exec /opt/py/bin/python -m gpupool.kernelapp -f /state/workers/kernel-1.json"
    assert job.script.startswith("#!/bin/sh\n")


def test_defaults_leave_partition_account_qos_time_and_memory_to_slurm():
    job = lease_job(WorkerSpec("L1", "ann", GPUS[:1], 1.0, 80 * GiB), JobSettings(node="n1"), ["python"], "/l", "/w")
    assert not any(a.startswith(("--partition", "--account", "--qos", "--time", "--mem")) for a in job.args)
    assert "--cpus-per-task=1" in job.args and "--gres=gpu:1" in job.args


def test_a_command_with_spaces_and_quotes_stays_one_argument_each():
    job = lease_job(whole(1), SITE, ["python", "-c", "print('a b')"], "/l", "/w")
    assert job.script.splitlines()[-1] == """exec python -c 'print('"'"'a b'"'"')'"""


def test_a_slice_is_a_step_of_a_share_job_that_holds_a_whole_gpu():
    share = share_job(SITE, cpus=8, memory=64 * GiB, log_path="/state/workers/share.log", workdir="/state/workers")
    assert "--gres=gpu:1" in share.args and "--job-name=gpupool-share-gpu07" in share.args
    assert "--comment=gpupool:share" in share.args and "--mem=65536M" in share.args and "--no-requeue" in share.args
    assert share.script.splitlines()[-1] == "exec sleep infinity"
    step = slice_step(41, piece(), SITE, COMMAND, "/state/workers/L-slice.log", "/home/bob")
    assert step[:11] == ["srun", "--jobid=41", "--overlap", "--ntasks=1", "--cpus-per-task=1", "--gres=gpu:1",
                         "--job-name=gpupool-L-slice", "--output=/state/workers/L-slice.log", "--input=none",
                         "--chdir=/home/bob", "--export=ALL"]
    assert step[11] == "--mem=8193M"  # rounded up: never less than the lease's host memory
    assert step[12:] == COMMAND


@pytest.mark.parametrize(("fraction", "shards"), [(0.5, 4), (0.25, 2), (0.3, 3), (0.125, 1), (0.01, 1), (0.999, 8)])
def test_shards_round_a_fraction_up(fraction, shards):
    settings = JobSettings(node="n", slice_gres="shard", shards_per_gpu=8)
    assert gres(piece(fraction), settings) == f"shard:{shards}"
    assert f"--gres=shard:{shards}" in lease_job(piece(fraction), settings, ["python"], "/l", "/w").args
    assert gres(piece(fraction), JobSettings(node="n")) == "gpu:1"
    assert gres(whole(3), settings) == "gpu:3"


def test_the_job_environment_leaves_the_devices_to_slurm():
    env = job_environment({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "GPU-0", "SLURM_JOB_ID": "7",
                           "GPUPOOL_LEASE_ID": "L1", "NVIDIA_VISIBLE_DEVICES": "all"}, "/etc/slurm/site.conf")
    assert env == {"PATH": "/bin", "GPUPOOL_LEASE_ID": "L1", "SLURM_CONF": "/etc/slurm/site.conf"}


@pytest.mark.parametrize("bad", [["--gres=gpu:8"], ["--mem=1T"], ["-p", "debug"], ["--partition=debug"],
                                 ["constraint=a100"], ["--"], ["--job-name=x"], ["--nodelist=other"]])
def test_extra_args_that_would_override_gpupool_are_refused(bad):
    with pytest.raises(ValueError, match="extra sbatch argument"):
        JobSettings(node="n", extra_args=tuple(bad))
    with pytest.raises(TraitError, match="extra sbatch argument"):
        SlurmLauncher(extra_args=bad)


@pytest.mark.parametrize("limit", ["60", "30:00", "12:00:00", "2-12", "2-12:30", "7-00:00:00", "UNLIMITED", ""])
def test_slurm_time_formats_are_taken(limit):
    assert SlurmLauncher(time_limit=limit).time_limit == limit


@pytest.mark.parametrize("limit", ["8h", "1 day", "-5", "12:00:00:00"])
def test_other_time_limits_are_refused_with_the_formats(limit):
    with pytest.raises(TraitError, match="Slurm's format"):
        SlurmLauncher(time_limit=limit)


def test_settings_come_from_config_as_c_slurmlauncher():
    config = Config()
    config.SlurmLauncher.partition = "gpu"
    config.SlurmLauncher.account = "jupyter"
    config.SlurmLauncher.node = "gpu07"
    config.SlurmLauncher.share_memory = "64GiB"
    config.SlurmLauncher.start_timeout = "5m"
    launcher = SlurmLauncher(config=config)
    settings = launcher.job_settings()
    assert (settings.partition, settings.account, settings.node) == ("gpu", "jupyter", "gpu07")
    assert launcher.share_memory == 64 * GiB and launcher.start_timeout == 300.0
    for name, trait in SlurmLauncher.class_own_traits(config=True).items():
        assert "c.SlurmLauncher." in trait.help, name


def test_an_unknown_slice_gres_is_refused():
    with pytest.raises(TraitError):
        SlurmLauncher(slice_gres="mps")
    with pytest.raises(ValueError, match="slice_gres"):
        JobSettings(node="n", slice_gres="mps")
    with pytest.raises(ValueError, match="c.SlurmLauncher.node"):
        JobSettings(node="")


# -- what Slurm says -----------------------------------------------------------------------------------------

# Trimmed from a real `scontrol --oneliner --details show job` of Slurm 22.05.8 (tests/support/slurm.py's cluster).
RUNNING = ("JobId=2 JobName=gpupool-abc UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901758 Nice=0 "
           "Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=0 Restarts=0 BatchFlag=1 "
           "ExitCode=0:0 RunTime=00:00:05 TimeLimit=UNLIMITED BatchHost=gpdev NumNodes=1 NumCPUs=1 NumTasks=1 "
           "CPUs/Task=1 TRES=cpu=1,mem=100M,node=1,billing=1 JOB_GRES=gpu:2 Nodes=gpdev CPU_IDs=1 Mem=100 "
           "GRES=gpu:2(IDX:0-1) MinMemoryNode=100M Command=(null) WorkDir=/work/my dir Comment=gpupool:lease=abc  "
           "StdErr=/tmp/k.out StdIn=/dev/null StdOut=/tmp/k.out Power= TresPerNode=gres:gpu:2 ")


def test_a_job_is_read_from_scontrol():
    job = SlurmJob.parse(RUNNING)
    assert (job.job_id, job.name, job.comment, job.state, job.reason) == (2, "gpupool-abc", "gpupool:lease=abc",
                                                                         "RUNNING", "")
    assert (job.user, job.node, job.gres, job.gpus) == ("root", "gpdev", "gpu:2(IDX:0-1)", (0, 1))
    assert job.running and not job.ended
    pairs = parse_pairs(RUNNING)
    assert pairs["TRES"] == "cpu=1,mem=100M,node=1,billing=1" and pairs["WorkDir"] == "/work/my dir"
    assert pairs["Power"] == ""
    with pytest.raises(ValueError, match="not a Slurm job"):
        SlurmJob.parse("slurm_load_jobs error: Invalid job id specified")


@pytest.mark.parametrize(("gres_text", "indices"), [("gpu:1(IDX:0)", (0,)), ("gpu:3(IDX:0,2-3)", (0, 2, 3)),
                                                    ("shard:4(IDX:1)", (1,)), ("gpu:1", ()), ("", ())])
def test_gpu_indices(gres_text, indices):
    assert gpu_indices(gres_text) == indices


def test_a_step_is_read_from_scontrol():
    step = SlurmStep.parse("StepId=26.0 UserId=0 StartTime=2026-12-02T15:19:19 TimeLimit=UNLIMITED State=RUNNING "
                           "Partition=gpu NodeList=vm Nodes=1 CPUs=1 Tasks=1 Name=gpupool-L-a Network=(null) "
                           "TRES=cpu=1,mem=200M,node=1 SrunHost:Pid=vm:27421 TresPerStep=cpu:1 "
                           "TresPerNode=gres:gpu:1 TresPerTask=cpu:1")
    assert (step.step_id, step.name, step.state, step.gres, step.srun_host, step.srun_pid) == (
        "26.0", "gpupool-L-a", "RUNNING", "gres:gpu:1", "vm", 27421)


def ended(state: str, reason: str = "None", limit: str = "UNLIMITED", code: str = "0:15") -> SlurmJob:
    text = RUNNING.replace("JobState=RUNNING Reason=None", f"JobState={state} Reason={reason}")
    return SlurmJob.parse(text.replace("TimeLimit=UNLIMITED", f"TimeLimit={limit}")
                          .replace("ExitCode=0:0", f"ExitCode={code}"))


@pytest.mark.parametrize(("job", "words"), [
    (ended("TIMEOUT", "TimeLimit", "00:01:00"), "it reached its time limit of 00:01:00 (c.SlurmLauncher.time_limit"),
    (ended("NODE_FAIL", "NodeDown"), "its node gpdev failed"),
    (ended("CANCELLED"), "it was cancelled in Slurm (scancel, by an administrator or the job's owner)"),
    (ended("PREEMPTED"), "a job of higher priority preempted it"),
    (ended("OUT_OF_MEMORY"), "it ran out of its memory"),
    (ended("FAILED", "NonZeroExitCode", code="3:0"), "the worker exited with code 3"),
])
def test_a_job_slurm_ended_gives_the_lease_words(job, words):
    said = end_reason(2, job)
    assert said.startswith("Slurm ended the worker's job 2: ") and words in said


# Real slurmstepd lines (Slurm 22.05.8).
TIME_LINE = "slurmstepd-gpdev: error: *** JOB 5 ON gpdev CANCELLED AT 2026-12-02T15:25:05 DUE TO TIME LIMIT ***"
NODE_LINE = ("slurmstepd-gpdev: error: *** JOB 4 ON gpdev CANCELLED AT 2026-12-02T15:23:59 DUE TO NODE FAILURE, "
             "SEE SLURMCTLD LOG FOR DETAILS ***")
STEP_LINE = "slurmstepd-vm: error: *** STEP 26.0 ON vm CANCELLED AT 2026-12-02T15:19:26 ***"


def test_once_slurm_forgot_the_job_its_output_says_why():
    assert end_line(f"some output\n{TIME_LINE}\n").cause == "TIME LIMIT"
    assert end_line(NODE_LINE).cause == "NODE FAILURE" and end_line(NODE_LINE).node == "gpdev"
    assert (end_line(STEP_LINE).what, end_line(STEP_LINE).ident, end_line(STEP_LINE).cause) == ("STEP", "26.0", "")
    assert "reached its time limit" in end_reason(5, None, TIME_LINE)
    assert "its node gpdev failed" in end_reason(4, None, NODE_LINE)
    assert "cancelled in Slurm (scancel" in end_reason("26.0", None, STEP_LINE)
    assert "no longer knows it" in end_reason(9, None, "just the worker's own output")
    aborted = "srun: Job step aborted: Waiting up to 7 seconds for job step to finish.\nsrun: error: n1: task 0: Killed"
    assert end_reason("26.0", None, aborted) == ("Slurm ended the worker's job 26.0: it aborted the step (scancel, a "
                                                 "time limit or a node failure; slurmstepd wrote no reason)")
    assert "cancelled in Slurm (scancel" in end_reason("26.0", None, f"{aborted}\n{STEP_LINE}"), "the end line first"


# -- the record ------------------------------------------------------------------------------------------------

def test_the_record_round_trips_as_json_and_refuses_anything_else():
    record = SlurmWorkerRecord("L1", 41, "gpupool-L1", "/w/L1.log", "/w/kernel-x.json", step_id=3, gpus=(1,))
    again = SlurmWorkerRecord.loads(record.dumps())
    assert again == record and again.ident == "41.3"
    assert SlurmWorkerRecord.loads(SlurmWorkerRecord("L2", 7, "n", "/l", "/c").dumps()).ident == "7"
    for bad in ("[]", "{}", '{"version": 2}', "not json", '{"version": 1, "lease_id": "L", "job_id": "x"}',
                '{"version": 1, "lease_id": "L", "job_id": 0, "name": "n", "log_path": "l", "connection_file": "c"}'):
        with pytest.raises(ValueError, match="not a Slurm worker record"):
            SlurmWorkerRecord.loads(bad)


def test_a_task_limit_goes_on_slurms_job_or_on_a_slices_step():
    """Where Slurm's hierarchy has the pids controller (cgroup/v2), the limit goes on the job's
    cgroup for a whole-GPU lease and on the step's for a slice (tasks._job_folder)."""
    task = Path("/sys/fs/cgroup/system.slice/slurmstepd.scope/job_12/step_3/user/task_0")
    assert _job_folder(task, 12, None) == Path("/sys/fs/cgroup/system.slice/slurmstepd.scope/job_12")
    assert _job_folder(task, 12, 3) == Path("/sys/fs/cgroup/system.slice/slurmstepd.scope/job_12/step_3")
    assert _job_folder(task, 13, None) is None and _job_folder(task, 12, 4) is None
