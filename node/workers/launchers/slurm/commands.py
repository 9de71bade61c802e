"""The Slurm commands a launcher calls (sbatch, srun, scontrol, squeue,
scancel), run without blocking the agent's event loop.

Each call runs the client with the site's ``SLURM_CONF`` (when set) and a
time limit, and raises :class:`SlurmError` in words naming the command and
Slurm's own message. Slurm's clients talk to slurmctld; on a busy cluster an
answer can take seconds, which is why nothing here is called per heartbeat
for every job (docs/launchers.md, "Liveness").
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Mapping, Sequence

from .request import Submission
from .state import SlurmJob, SlurmStep, parse_pairs

# What scontrol/squeue say for an id slurmctld does not (or no longer) know.
_UNKNOWN = re.compile(r"Invalid job id|not found|does not exist", re.IGNORECASE)


class SlurmError(Exception):
    """A Slurm command failed; the message names the command and says what Slurm said."""


class SlurmCommands:
    """Slurm's command-line clients for one agent: ``slurm_conf`` (the
    site's configuration file; empty: Slurm's default, or ``SLURM_CONF`` of
    the agent's environment), ``bin_dir`` (where the clients are; empty:
    ``PATH``), ``timeout`` (seconds a call may take)."""

    def __init__(self, slurm_conf: str = "", bin_dir: str = "", timeout: float = 30.0) -> None:
        self.slurm_conf = slurm_conf
        self.bin_dir = bin_dir
        self.timeout = timeout

    def path(self, command: str) -> str:
        return str(Path(self.bin_dir) / command) if self.bin_dir else command

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        return env

    async def run(self, *args: str, stdin: str | None = None, env: Mapping[str, str] | None = None,
                  as_user: Mapping[str, Any] | None = None) -> str:
        """Run ``args`` (the command by name first); returns its stdout.
        ``env``: the command's environment (default the agent's) with
        ``SLURM_CONF``; ``as_user``: ``subprocess`` keywords (``user``,
        ``group``, ``extra_groups``) to run it as another account (root
        only). SlurmError when it exits non-zero or takes over ``timeout``."""
        command = [self.path(args[0]), *args[1:]]
        try:
            proc = await asyncio.create_subprocess_exec(
                *command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=self.environment(env), **(as_user or {}))
        except OSError as exc:
            raise _cannot_run(args, exc) from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin is not None else None),
                                              self.timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise self._no_answer(args) from None
        if proc.returncode:
            raise _failed(args, proc.returncode, err.decode(errors="replace"), out.decode(errors="replace"))
        return out.decode(errors="replace")

    def run_blocking(self, *args: str) -> str:
        """:meth:`run`, blocking (no stdin, the agent's environment): for a
        caller on a worker thread, or one that may block briefly. SlurmError."""
        try:
            done = subprocess.run([self.path(args[0]), *args[1:]], capture_output=True, text=True,
                                  env=self.environment(), timeout=self.timeout, check=False)
        except OSError as exc:
            raise _cannot_run(args, exc) from None
        except subprocess.TimeoutExpired:
            raise self._no_answer(args) from None
        if done.returncode:
            raise _failed(args, done.returncode, done.stderr, done.stdout)
        return done.stdout

    def _no_answer(self, args: Sequence[str]) -> SlurmError:
        return SlurmError(f"{args[0]} did not answer within {self.timeout:g} s (is slurmctld up? "
                          "c.SlurmLauncher.command_timeout)")

    # -- jobs ------------------------------------------------------------------------------------------------

    async def submit(self, submission: Submission, env: Mapping[str, str],
                     as_user: Mapping[str, Any] | None = None) -> int:
        """``sbatch --parsable`` the ``submission`` (its script on stdin) with
        ``env`` as the job's environment; returns the job id. SlurmError."""
        out = await self.run(*submission.command(), stdin=submission.script, env=env, as_user=as_user)
        first = out.strip().split(";")[0]
        if not first.isdigit():
            raise SlurmError(f"sbatch printed no job id: {out.strip()!r}")
        return int(first)

    async def job(self, job_id: int) -> SlurmJob | None:
        """The job ``job_id``; None when slurmctld does not know it (never
        did, or forgot it ``MinJobAge`` after its end). SlurmError."""
        try:
            out = await self.run("scontrol", "--oneliner", "--details", "show", "job", str(job_id))
        except SlurmError as exc:
            if _UNKNOWN.search(str(exc)):
                return None
            raise
        return SlurmJob.parse(out) if out.strip() else None

    async def step(self, job_id: int, step_id: int) -> SlurmStep | None:
        """The step ``job_id.step_id`` while it runs; None once it is gone. SlurmError."""
        try:
            out = await self.run("scontrol", "--oneliner", "show", "step", f"{job_id}.{step_id}")
        except SlurmError as exc:
            if _UNKNOWN.search(str(exc)):
                return None
            raise
        return SlurmStep.parse(out) if "StepId=" in out else None

    async def steps(self, job_id: int) -> list[SlurmStep]:
        """The running steps of ``job_id`` (its batch step left out)."""
        try:
            out = await self.run("scontrol", "--oneliner", "show", "step", str(job_id))
        except SlurmError as exc:
            if _UNKNOWN.search(str(exc)):
                return []
            raise
        return [SlurmStep.parse(line) for line in out.splitlines()
                if "StepId=" in line and not parse_pairs(line)["StepId"].endswith((".batch", ".extern"))]

    async def find(self, name: str, user: str = "") -> list[int]:
        """Ids of the jobs called ``name`` (of ``user``, when given) that
        slurmctld knows, in any state. SlurmError."""
        args = ["squeue", "--noheader", "--states=all", f"--name={name}", "--format=%i"]
        if user:
            args.append(f"--user={user}")
        out = await self.run(*args)
        return sorted(int(line) for line in out.split() if line.isdigit())

    async def cancel(self, job_id: int, step_id: int | None = None, signal: str = "") -> None:
        """``scancel`` the job (or step); with ``signal`` (e.g. ``STOP``) only
        signal it. A job or step already gone is no error. SlurmError."""
        try:
            await self.run(*_cancel_args(job_id, step_id, signal))
        except SlurmError as exc:
            if not _gone(exc):
                raise

    def cancel_blocking(self, job_id: int, step_id: int | None = None, signal: str = "") -> None:
        """:meth:`cancel`, blocking: for callers on a worker thread (a park's
        freeze, a kill), or that may block briefly. SlurmError."""
        try:
            self.run_blocking(*_cancel_args(job_id, step_id, signal))
        except SlurmError as exc:
            if not _gone(exc):
                raise

    async def pids(self, job_id: int, step_id: int | None = None) -> list[int]:
        """The pids of the job (or step) on this node (``scontrol listpids``;
        empty once none is left): whose GPU memory is the lease's."""
        target = f"{job_id}.{step_id}" if step_id is not None else str(job_id)
        try:
            out = await self.run("scontrol", "listpids", target)
        except SlurmError as exc:
            if re.search(r"does not exist|no steps", str(exc)) or _UNKNOWN.search(str(exc)):
                return []
            raise
        firsts = (line.split()[0] for line in out.splitlines()[1:] if line.split())  # under a header line
        return sorted({int(first) for first in firsts if first.isdigit()})

    async def suspend(self, job_id: int) -> None:
        """``scontrol suspend``: the job's processes stop (SIGSTOP; the
        freezer cgroup with proctrack/cgroup); its GRES and memory stay
        allocated, its CPUs go to other jobs. Operators and root only."""
        await self.run("scontrol", "suspend", str(job_id))

    async def resume(self, job_id: int) -> None:
        """``scontrol resume`` a suspended job."""
        await self.run("scontrol", "resume", str(job_id))

    async def node(self, name: str) -> dict[str, str]:
        """``scontrol show node -d NAME`` as pairs (CPUTot, RealMemory, Gres,
        GresUsed, State...). SlurmError (also for an unknown node)."""
        return parse_pairs(await self.run("scontrol", "--oneliner", "--details", "show", "node", name))

    # -- steps -----------------------------------------------------------------------------------------------

    def start_step(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path,
                   as_user: Mapping[str, Any] | None = None) -> subprocess.Popen:
        """Start ``srun`` (``argv``, from :func:`~.request.slice_step`) in a
        session of its own, so that it outlives the agent (a step ends with
        its srun); srun's own messages go to ``log_path``. Returns it."""
        with open(log_path, "ab") as out:
            return subprocess.Popen([self.path(argv[0]), *argv[1:]], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=self.environment(env), start_new_session=True,
                                    close_fds=True, **(as_user or {}))


def _cannot_run(args: Sequence[str], exc: OSError) -> SlurmError:
    return SlurmError(f"cannot run {args[0]}: {exc} (is Slurm's client installed? c.SlurmLauncher.bin_dir)")


def _failed(args: Sequence[str], code: int, stderr: str, stdout: str) -> SlurmError:
    said = stderr.strip() or stdout.strip()
    return SlurmError(f"{' '.join(args[:2])} failed (exit code {code}): {said or 'no message'}")


def _cancel_args(job_id: int, step_id: int | None, signal: str) -> list[str]:
    args = ["scancel"]
    if signal:
        # Without --full, scancel signals a job's steps only, not its batch script (a lease job's worker).
        args += [f"--signal={signal}", *(["--full"] if step_id is None else [])]
    return [*args, f"{job_id}.{step_id}" if step_id is not None else str(job_id)]


def _gone(exc: SlurmError) -> bool:
    """The job or step a command named is gone already (no error for a cancel)."""
    return bool(_UNKNOWN.search(str(exc))) or "already completing or completed" in str(exc)
