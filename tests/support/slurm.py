"""A real one-node Slurm for tests: munged, slurmctld and slurmd (Debian's
``slurm-wlm`` 22.05 and ``munge``) on private ports, with a private state
folder, munge socket and key, so nothing of the host's own Slurm (if any) is
used or touched.

GPUs are GRES over device files made for the cluster: character devices
``dev/nvidiaN`` with NVIDIA's major number 195 (as the real ``/dev/nvidiaN``),
which no driver backs here, so opening an allowed one fails with ENXIO and a
device Slurm's cgroup denies fails with EPERM. Each GPU also carries
``shards_per_gpu`` ``shard`` GRES (Slurm requires a ``gpu`` record for the
device a shard names). ``srun --gres=gpu:1`` then sets ``CUDA_VISIBLE_DEVICES``
as on a real cluster.

What this host needed (docs/launchers.md, "Slurm on this host"): the cgroup/v1
plugin (the v1 controllers are mounted under /sys/fs/cgroup, cgroup2 only at
/sys/fs/cgroup/unified; 22.05's cgroup/v2 stops with "Hybrid mode is not
supported"), device nodes with numbers of
their own (denying one GPU that shares /dev/null's numbers denies /dev/null
too, and every step fails), and ``SlurmdParameters=config_overrides`` so the
node may declare more CPUs than this 2-core machine has (then
``ConstrainCores=no``: a cpuset cannot name CPUs that do not exist).

:func:`unavailable` says why Slurm cannot run here (None when it can);
:class:`SlurmCluster` starts and stops one. Start and stop times are kept in
:attr:`SlurmCluster.timings` (seconds).
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

DAEMONS = ("munged", "slurmctld", "slurmd")
#: NVIDIA's character-device major number (/dev/nvidiaN).
NVIDIA_MAJOR = 195


def unavailable() -> str | None:
    """Why a private Slurm cannot run on this host, in words; None when it can."""
    if os.geteuid() != 0:
        return "the Slurm tests need root (slurmd runs each job as its user, and makes device nodes)"
    missing = [name for name in (*DAEMONS, "sbatch", "scontrol", "squeue", "scancel", "srun") if _which(name) is None]
    if missing:
        return (f"{', '.join(missing)} not installed: install Debian's slurmctld, slurmd, slurm-client and munge "
                "(make install does, as root, where apt-get is available)")
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cgroup_plugin(mounts: str | None = None) -> str | None:
    """The Slurm cgroup plugin this host's cgroups fit (``/proc/mounts``
    text): ``cgroup/v1`` where the v1 controllers Slurm's task and proctrack
    plugins use are mounted (freezer, memory, devices, cpuset), ``cgroup/v2``
    where /sys/fs/cgroup is a unified hierarchy; None when neither."""
    if mounts is None:
        mounts = Path("/proc/mounts").read_text()
    v1: set[str] = set()
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        if parts[1] == "/sys/fs/cgroup" and parts[2] == "cgroup2":
            return "cgroup/v2"
        if parts[2] == "cgroup":
            v1.update(parts[3].split(","))
    return "cgroup/v1" if {"freezer", "memory", "devices", "cpuset"} <= v1 else None


@dataclass
class SlurmCluster:
    """One Slurm node (and its controller) under ``root``; :meth:`start`,
    then :meth:`stop`. ``gpus`` GPUs with ``shards_per_gpu`` shards each,
    ``cpus`` CPUs and ``memory_mb`` MiB declared."""

    root: Path
    gpus: int = 2
    shards_per_gpu: int = 8
    cpus: int = 8
    memory_mb: int = 8000
    name: str = field(default_factory=lambda: f"gp{secrets.token_hex(3)}")
    #: The cgroup plugin in use ("cgroup/v1", "cgroup/v2"), or None: no cgroups (proctrack/linuxproc, task/none).
    cgroups: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    _pids: dict[str, int] = field(default_factory=dict)

    # -- paths and environment -----------------------------------------------------------------------------

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    @property
    def env(self) -> dict[str, str]:
        """The environment Slurm's commands need to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def devices(self) -> list[Path]:
        return [self.root / "dev" / f"nvidia{index}" for index in range(self.gpus)]

    @property
    def confined(self) -> bool:
        """True when Slurm's task/cgroup plugin confines jobs (devices, memory)."""
        return self.cgroups is not None

    # -- commands --------------------------------------------------------------------------------------------

    def run(self, *args: str, user: str | None = None, check: bool = True, timeout: float = 30,
            input: str | None = None) -> subprocess.CompletedProcess:
        """Run a Slurm command against this cluster, as ``user`` (default: root)."""
        kwargs = {}
        if user is not None:
            entry = pwd.getpwnam(user)
            kwargs = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": [], "cwd": "/tmp"}
        return subprocess.run(list(args), env=self.env, check=check, capture_output=True, text=True,
                              timeout=timeout, input=input, **kwargs)

    def sbatch(self, *args: str, user: str | None = None, script: str = "sleep 600") -> int:
        """Submit ``script`` (``--wrap``) as ``user``; returns the job id."""
        out = self.run("sbatch", "--parsable", "--output=/dev/null", *args, f"--wrap={script}", user=user).stdout
        return int(out.strip().split(";")[0])

    def job_field(self, job_id: int | str, key: str) -> str:
        """One ``KEY=value`` of ``scontrol show job -d`` ('' when the job is unknown)."""
        out = self.run("scontrol", "--oneliner", "--details", "show", "job", str(job_id), check=False).stdout
        for token in out.split():
            name, _, value = token.partition("=")
            if name == key:
                return value
        return ""

    def wait_job(self, job_id: int | str, states: Sequence[str], timeout: float = 30) -> str:
        """Wait until the job's state is one of ``states``; returns it. AssertionError after ``timeout``."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_field(job_id, "JobState")
            if state in states:
                return state
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} stayed {state or 'unknown'}, not {'/'.join(states)}")

    # -- start -----------------------------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> None:
        """Write the configuration, start munged, slurmctld and slurmd, and wait
        until the node is idle. Tries cgroups first (:func:`cgroup_plugin`),
        then without them. RuntimeError (with the daemons' logs) when the node
        never comes up; nothing is left running then."""
        began = time.monotonic()
        self._prepare()
        self._start_munge()
        plugin = cgroup_plugin()
        for attempt in ([plugin, None] if plugin else [None]):
            self.cgroups = attempt
            self._write_config()
            try:
                self._start_slurm(timeout)
                break
            except RuntimeError:
                self._stop_slurm()
                if attempt is None:
                    self._stop_munge()
                    self._remove_cgroups()
                    shutil.rmtree(self.root, ignore_errors=True)
                    raise
        self.timings["start"] = time.monotonic() - began

    def _prepare(self) -> None:
        # Others (the second user of the tests) read the configuration and reach munge's socket.
        self.root.mkdir(parents=True, exist_ok=True)
        for folder, mode in (("", 0o755), ("etc", 0o755), ("munge", 0o755), ("munge-key", 0o700), ("dev", 0o755),
                             ("state", 0o700), ("spool", 0o755), ("log", 0o755)):
            path = self.root / folder
            path.mkdir(exist_ok=True)
            path.chmod(mode)
        for index, device in enumerate(self.devices()):
            if not device.exists():
                os.mknod(device, 0o666 | 0o020000, os.makedev(NVIDIA_MAJOR, index))
        key = self.root / "munge-key" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)

    def _write_config(self) -> None:
        host = socket.gethostname().split(".")[0]
        root = self.root
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "MailProg=/bin/true",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "KillWait=5",
            "InactiveLimit=0",
            "GresTypes=gpu,shard",
        ]
        if self.cgroups:
            lines += ["ProctrackType=proctrack/cgroup", "TaskPlugin=task/cgroup"]
        else:
            lines += ["ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none"]
        lines += [
            f"NodeName={self.name} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={self.cpus} "
            f"RealMemory={self.memory_mb} Gres=gpu:{self.gpus},shard:{self.gpus * self.shards_per_gpu} State=UNKNOWN",
            f"PartitionName=gpu Nodes={self.name} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        gres = [f"Name=gpu File={device}" for device in self.devices()]
        gres += [f"Name=shard Count={self.shards_per_gpu} File={device}" for device in self.devices()]
        (self.conf.parent / "gres.conf").write_text("\n".join(gres) + "\n")
        cgroup = [f"CgroupPlugin={self.cgroups or 'autodetect'}", "ConstrainDevices=yes", "ConstrainRAMSpace=yes",
                  "ConstrainCores=no"]
        if self.cgroups == "cgroup/v1":
            cgroup.insert(1, "CgroupMountpoint=/sys/fs/cgroup")
        (self.conf.parent / "cgroup.conf").write_text("\n".join(cgroup) + "\n")

    def _start_munge(self) -> None:
        folder = self.root / "munge"
        # -f: munged refuses a socket under /tmp (a world-writable parent) without it.
        subprocess.run([_which("munged"), "-f", f"--socket={self.munge_socket}",
                        f"--key-file={self.root / 'munge-key' / 'munge.key'}", f"--pid-file={folder / 'munged.pid'}",
                        f"--log-file={self.root / 'log' / 'munged.log'}", f"--seed-file={folder / 'munged.seed'}"],
                       check=True, capture_output=True, timeout=30)
        self._pids["munged"] = int((folder / "munged.pid").read_text())

    def _start_slurm(self, timeout: float) -> None:
        env = self.env
        for command in ([_which("slurmctld"), "-f", str(self.conf)],
                        [_which("slurmd"), "-f", str(self.conf), "-N", self.name]):
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
            if done.returncode:
                daemon = Path(command[0]).name
                said = done.stderr.strip()[-500:] or self.log_tail(daemon, 3)
                raise RuntimeError(f"{daemon} did not start (cgroups: {self.cgroups}): {said}")
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.run("sinfo", "--noheader", f"--nodes={self.name}", "--format=%T", check=False).stdout.strip()
            if state == "idle":
                for daemon in ("slurmctld", "slurmd"):
                    self._pids[daemon] = int((self.root / f"{daemon}.pid").read_text())
                return
            if state.startswith(("drain", "inval", "down")) or not self._daemons_alive():
                break
            time.sleep(0.2)
        logs = "\n".join(self.log_tail(name) for name in ("slurmctld", "slurmd"))
        raise RuntimeError(f"the Slurm node {self.name} is {state or 'not registered'} (cgroups: {self.cgroups}):\n"
                           f"{logs}")

    def _daemons_alive(self) -> bool:
        """False once slurmctld or slurmd wrote its pid file and exited (a plugin it could not load, say)."""
        for daemon in ("slurmctld", "slurmd"):
            pid = _pid_from(self.root / f"{daemon}.pid")
            if pid is not None:
                try:
                    os.kill(pid, 0)
                except OSError:
                    return False
        return True

    def log_tail(self, daemon: str, lines: int = 15) -> str:
        try:
            text = (self.root / "log" / f"{daemon}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- stop ------------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job, stop the daemons, remove the node's cgroups and
        every file under ``root``."""
        began = time.monotonic()
        self.run("scancel", "--full", "--partition=gpu", check=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            left = self.run("squeue", "--noheader", "--states=PD,R,S,CG,CF", "--format=%i", check=False)
            if left.returncode or not left.stdout.strip():
                break
            time.sleep(0.2)
        self._stop_slurm()
        self._stop_munge()
        self._remove_cgroups()
        shutil.rmtree(self.root, ignore_errors=True)
        self.timings["stop"] = time.monotonic() - began

    def _stop_slurm(self) -> None:
        self.run("scontrol", "shutdown", check=False)
        for daemon in ("slurmctld", "slurmd"):
            pid = self._pids.pop(daemon, None) or _pid_from(self.root / f"{daemon}.pid")
            if pid:
                _wait_gone(pid, 15)

    def _stop_munge(self) -> None:
        pid = self._pids.pop("munged", None)
        if pid:
            subprocess.run([_which("munged"), "-s", f"--socket={self.munge_socket}"], capture_output=True, timeout=15)
            _wait_gone(pid, 10)

    def _remove_cgroups(self) -> None:
        """slurmd leaves its ``slurm_NODE`` folder in each v1 controller (and
        killed steps' leftovers in it): kill what is there, remove them."""
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 3 or parts[2] not in ("cgroup", "cgroup2"):
                continue
            top = Path(parts[1]) / f"slurm_{self.name}"
            if not top.is_dir():
                continue
            for folder in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
                for pid in (folder / "cgroup.procs").read_text().split() if (folder / "cgroup.procs").exists() else ():
                    try:
                        os.kill(int(pid), 9)
                    except OSError:
                        pass
                for _ in range(50):
                    try:
                        folder.rmdir()
                        break
                    except OSError:
                        time.sleep(0.1)


def _pid_from(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, 9)
    except OSError:
        pass


def other_user(name: str = "gpupool-slurm-other") -> tuple[str, bool]:
    """A second account, for jobs of "someone else": ``(name, made)``,
    made with ``useradd --system`` when missing (``made`` True: remove it after)."""
    try:
        pwd.getpwnam(name)
        return name, False
    except KeyError:
        pass
    if shutil.which("useradd") is None:
        raise RuntimeError("useradd is not available to make a second user")
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                   capture_output=True)
    return name, True


def remove_user(name: str) -> None:
    subprocess.run(["userdel", name], capture_output=True)
