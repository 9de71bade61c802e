"""Workers: one ipykernel per lease, confined to the lease's slice.

The agent's HTTP handlers call :class:`WorkerManager`; it starts each worker
with jupyter_client's ``AsyncKernelManager`` (so ports, HMAC key, connection
file and signals are Jupyter's own), watches its IOPub for activity, notices
when it dies, and stops it so that no process outlives its lease (DESIGN.md,
Promises).

With ``warm_workers`` > 0 it also keeps that many workers started ahead of
any lease (:mod:`.warmpool`): a lease then takes one and the agent *binds* it
to the slice (the slice's variables put into the worker's ``os.environ`` by
:func:`gpupool.provisioner.worker_extension.bind`, before CUDA initialises there)
instead of booting a kernel. docs/enforcement.md, "Binding a worker to its
GPUs", says why that holds the worker to its GPUs as a cold start does.

Workers do not die with the agent: a restarted agent re-adopts the lease
workers that still run and stops every other process it started before
(:mod:`.adoption`, :meth:`WorkerManager.recover`). With a worker user
(:mod:`.worker_user`) every worker runs as that account, not the agent's.

Every worker lives in a cgroup of its own (:mod:`.cgroups`): ``lease-ID``
for a cold start, ``warm-HEX`` for a warm one (kept when it is bound; the
lease's record names it). Its first process joins it before it runs a line
of Python: the kernel command is prefixed with a shell *start gate* that
waits on its stdin until the agent has put its pid into the cgroup, then
execs the kernel (same pid). So nothing the worker starts, not even
during ipykernel's own start, can be outside the cgroup; a ``preexec_fn``
would do the same but is unsafe in a process with threads (the agent has
ZMQ's and asyncio's), and runs after the switch to the worker user, who may
not move processes between cgroups. Release, a worker's death and agent
stop kill the whole cgroup.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import psutil
import zmq.asyncio
from jupyter_client.kernelspec import NATIVE_KERNEL_NAME, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from gpupool.kernelcmd import WORKER_EXTENSION, WORKER_KERNEL_APP, with_launcher
from gpupool.schema import GPUInfo, WorkerReport

from .activity import WorkerActivity, watch_iopub
from .adoption import (AdoptedProcess, WorkerRecord, create_time, kill_all, left_behind, read_records, record_path,
                       stray_workers)
from .cgroups import CgroupError, Containment, GroupOnly, LeaseCgroup, containment
from .enforcement import slice_environment
from .host_limits import enforce as enforce_host_limits
from .warmpool import WarmPool
from .worker_user import NoFreeWorkerUser, WorkerUser, WorkerUserPool

# Lease ids become file names under the state dir.
_LEASE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")

# Agent-side secrets a worker must never see: user code runs there.
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|PRIVATE_?KEY", re.IGNORECASE)
_PRIVATE_PREFIXES = ("GPUPOOL_", "JUPYTERHUB_", "JPY_API_")

_CONNECTION_KEYS = ("ip", "transport", "shell_port", "iopub_port", "stdin_port", "control_port", "hb_port",
                    "signature_scheme")


class WorkerStartError(Exception):
    """A worker did not come up; the message says why (exit code, the tail of
    its log). The agent answers 502 ``worker_start_failed`` with it."""


class WorkerStopError(Exception):
    """A worker's processes survived SIGKILL (e.g. stuck in the GPU driver)."""


class WorkerBindError(Exception):
    """A warm worker refused or failed its binding (e.g. CUDA was already
    initialised in it); it is stopped and the lease's worker starts cold."""


#: Seconds a warm worker gets to answer its binding.
BIND_TIMEOUT_S = 10.0

#: Seconds a worker left by an earlier run of the agent gets to answer on its
#: control channel (which answers while a cell runs) before it is stopped.
ADOPT_TIMEOUT_S = 10.0

#: The start gate (see the module's docstring): the kernel command follows
#: it; it runs the kernel only once the agent wrote ``go`` to its stdin,
#: which it then replaces with /dev/null.
START_GATE = ["/bin/sh", "-c", 'IFS= read -r go && [ "$go" = go ] && exec "$@" </dev/null', "gpupool-start-gate"]

#: The environment of a warm worker before it is bound: no GPU visible, so
#: nothing that initialises CUDA early can use a GPU no lease holds.
UNBOUND_ENVIRONMENT = {"CUDA_VISIBLE_DEVICES": ""}


@dataclass(frozen=True)
class WarmSettings:
    """The warm pool of one node (``c.NodeAgent.warm_workers`` and friends):
    ``size`` workers kept started (0: none), each with the modules ``preload``
    imported, replaced after waiting ``max_age`` seconds."""

    size: int = 0
    preload: tuple[str, ...] = ()
    max_age: float = 1800.0


@dataclass(frozen=True)
class WorkerSpec:
    """What the service asks for with ``POST /workers``: the lease, its owner,
    its GPUs (in the order the worker sees them), the compute ``fraction`` in
    (0, 1] and the ``memory`` limit in bytes per GPU. ``python``: the
    interpreter of the environment the lease names (:mod:`.environments`;
    None: the agent's own, and a warm worker may serve it). ``user``: the
    account of this lease's worker when ``c.NodeAgent.worker_user`` is a
    template such as ``"{username}"`` (None: the manager's ``user``).
    ``cpus`` (cores) and ``host_memory`` (bytes): the host limits its cgroup
    gets (None: no limit; :mod:`.host_limits`)."""

    lease_id: str
    owner: str
    gpus: tuple[GPUInfo, ...]
    fraction: float
    memory: int
    python: str | None = None
    user: WorkerUser | None = None
    cpus: float | None = None
    host_memory: int | None = None

    def __post_init__(self) -> None:
        if not _LEASE_ID.match(self.lease_id):
            raise ValueError(f"lease id {self.lease_id!r} must be 1-100 letters, digits, '.', '_' or '-'")


def worker_environment(environ: Mapping[str, str], slice_env: Mapping[str, str]) -> dict[str, str]:
    """The environment of a worker: ``environ`` (the agent's) without its
    secrets, plus ``slice_env`` (:func:`~.enforcement.slice_environment`).

    Dropped: every ``GPUPOOL_*`` (the agent token, and the agent's own
    settings, which the slice's values replace), ``JUPYTERHUB_*``, and any
    name that looks like a credential (``TOKEN``, ``SECRET``, ``PASSWORD``,
    ``API_KEY``...). Kept: ``PATH``, ``HOME``, ``CUDA_MPS_PIPE_DIRECTORY`` and
    the rest, which user code and CUDA need.
    """
    env = {name: value for name, value in environ.items()
           if not name.startswith(_PRIVATE_PREFIXES) and not _SECRET_NAME.search(name)}
    env.update(slice_env)
    return env


def bind_code(slice_env: Mapping[str, str]) -> str:
    """The code the agent runs in a warm worker (a silent ``execute_request``)
    to bind it to ``slice_env``: a call of
    :func:`gpupool.provisioner.worker_extension.bind`. Only string names and values, so
    ``repr`` is an exact Python literal."""
    env = {str(name): str(value) for name, value in slice_env.items()}
    return f"__import__({WORKER_EXTENSION!r}, fromlist=['bind']).bind({env!r})"


def preload_code(modules: Sequence[str]) -> str:
    """The code that imports ``modules`` in a warm worker without binding a
    name in the user's namespace; it fails (ImportError) on the first module
    that cannot be imported, which fails the warm start."""
    return "".join(f"__import__({name!r})\n" for name in modules)


def kernel_arguments(extensions: Sequence[str]) -> list[str]:
    """ipykernel command-line options that load ``extensions``, make the
    kernel exit when one fails to load, and leave out ipykernel's sleep before
    each reply.

    ``extra_extensions`` is IPython's option for extensions named on the
    command line; unlike ``extensions`` it adds to, rather than replaces, a
    ``c.InteractiveShellApp.extensions`` list from the user's profile. Without
    ``reraise_ipython_extension_failures`` IPython only logs a failing
    extension, and a worker without its extension would look healthy.
    """
    args = [f"--IPKernelApp.extra_extensions={name}" for name in extensions]
    # ipykernel sleeps 0.5 ms before each execute_reply so that a front end sees a cell's output
    # before its reply; a worker's front end is the gpupool kernel, which waits for its idle.
    return [*args, "--IPKernelApp.reraise_ipython_extension_failures=True", "--IPythonKernel._execute_sleep=0"]


class Worker:
    """One running (or dead) worker: its kernel manager, process, connection
    info and activity. Created and owned by :class:`WorkerManager`.

    ``spec`` is None while the worker is warm (started ahead, bound to no
    lease); ``name`` is its lease id, or ``warm-N`` until it is bound.
    ``activity`` may be replaced (a warm worker's history is not its lease's):
    the IOPub watcher always feeds the current one. ``cgroup``: where all of
    its processes live (default: no cgroup, its process tree only).
    """

    def __init__(self, spec: WorkerSpec | None, manager: AsyncKernelManager, process: subprocess.Popen,
                 log_path: Path, advertise_ip: str, name: str | None = None,
                 cgroup: LeaseCgroup | None = None) -> None:
        self.spec = spec
        self.name = name or (spec.lease_id if spec is not None else "warm")
        if cgroup is None:
            cgroup = GroupOnly(self.name)
            cgroup.add(process.pid)
        self.cgroup = cgroup
        self.user: WorkerUser | None = None  # the account it runs as, when not the agent's
        self.advertise_ip = advertise_ip
        self.manager = manager
        self.process = process
        self.log_path = log_path
        self.activity = WorkerActivity()
        self.started_at = time.time()
        self.exit_code: int | None = None
        self.ended = False  # its process is gone (a re-adopted one's exit code stays unknown)
        self.stopping = False  # the agent is stopping it: its exit is no death to report
        self.watcher: asyncio.Future | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def on_message(self, msg: dict[str, Any]) -> None:
        """IOPub messages from :func:`~.activity.watch_iopub` go to the current activity."""
        self.activity.on_message(msg)

    @property
    def dead(self) -> bool:
        return self.ended

    def connection(self) -> dict[str, Any]:
        """The Jupyter connection info for ``POST /workers`` (``key`` as str)."""
        info = self.manager.get_connection_info()
        wire = {name: info[name] for name in _CONNECTION_KEYS}
        wire["ip"] = self.advertise_ip
        key = info["key"]
        wire["key"] = key.decode() if isinstance(key, bytes) else key
        if info.get("curve_publickey"):  # the public half only: the secret key stays with the worker
            wire["curve_publickey"] = info["curve_publickey"]
        port = _transfer_port(self.manager.connection_file)
        if port:  # bulk bytes of push/pull (gpupool.dataplane)
            wire["transfer_port"] = port
        return wire

    def record(self) -> WorkerRecord:
        """What a restarted agent needs to re-adopt this (bound) worker."""
        spec = self.spec
        started = self.started_at if isinstance(self.process, AdoptedProcess) else create_time(self.pid)
        return WorkerRecord(spec.lease_id, spec.owner, spec.gpus, spec.fraction, spec.memory, self.pid, started,
                            str(self.manager.connection_file), str(self.log_path),
                            self.cgroup.name if self.cgroup.kind != "none" else "",
                            self.user.name if self.user is not None else "")

    def report(self, memory_used: int | None = None) -> WorkerReport:
        """This worker as a heartbeat's WorkerReport."""
        if self.dead:
            why = None
            if isinstance(self.process, AdoptedProcess):
                why = "the worker process ended (its exit code is unknown: it was re-adopted after an agent restart)"
            return WorkerReport(self.spec.lease_id, self.pid, "dead", exit_code=self.exit_code, reason=why)
        return WorkerReport(self.spec.lease_id, self.pid, self.activity.execution_state,
                            idle_since=self.activity.idle_since_iso(), memory_used=memory_used)

    def log_tail(self, lines: int = 8) -> str:
        """The last lines the worker wrote to stdout/stderr (empty if none)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def descendants(self) -> list[psutil.Process]:
        """Processes the worker started (dataloaders, compilers...), now:
        with a cgroup, every other process in it (a double-forked daemon
        too); else its process tree. Empty once the worker was reaped
        without a cgroup: its pid may belong to another process then."""
        if self.cgroup.kind != "none":
            return _processes(self.cgroup.pids() - {self.pid})
        if isinstance(self.process, AdoptedProcess):
            return self.process.children()
        if self.process.returncode is not None:
            return []
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []


class WorkerManager:
    """Starts, tracks and stops the workers of one node.

    ``state_dir``: the agent's state directory; connection files and worker
    logs go under ``state_dir/workers`` (so every worker's command line names
    the state dir). ``ip``: where workers listen, the address clients reach
    them at, unless ``advertise_ip`` (for a wildcard ``ip``) says otherwise. ``node``: the node's name (``GPUPOOL_NODE``). ``start_timeout``
    and ``stop_timeout``: seconds. ``extensions``: IPython extensions each
    worker loads. ``environ``: the environment workers inherit, minus secrets
    (default ``os.environ``). ``cwd``: the workers' working directory (default
    the home directory).

    ``warm``: the warm pool's settings (:class:`WarmSettings`); None or size
    0 (the default): every worker starts cold. The pool starts filling on
    :meth:`start_warm_pool`.

    ``encryption``: ``"curve"`` (each worker binds its sockets as CurveZMQ
    servers with a fresh key pair, jupyter_client's ``transport_encryption =
    "required"``; its connection info carries the public key) or ``"none"``.

    ``user``: the account workers run as (:class:`~.worker_user.WorkerUser`;
    None: the agent's own). Their connection files are then handed to it,
    ``workers_dir`` may be entered (not listed) by others, and the working
    directory defaults to its home, or to ``state_dir/worker-home`` (made
    for it) when it has none.

    ``users``: a pool of accounts (:class:`~.worker_user.WorkerUserPool`),
    instead of ``user``: each worker, warm ones too, runs as an account no
    other live worker has, and works in ``state_dir/worker-homes/NAME``
    (emptied when the account goes back to the pool). A start fails with
    WorkerStartError when every account is in use.

    ``cgroups``: where workers' cgroups are made (:mod:`.cgroups`; default
    ``containment("auto", "", state_dir)``: the best this host offers).

    All methods run on the agent's event loop; calls for the same lease are
    serialized, calls for different leases run concurrently.
    """

    def __init__(self, state_dir: str | os.PathLike, *, ip: str = "127.0.0.1", advertise_ip: str | None = None,
                 node: str,
                 start_timeout: float = 60.0, stop_timeout: float = 10.0,
                 extensions: Sequence[str] = (WORKER_EXTENSION,), environ: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike | None = None, log: logging.Logger | None = None,
                 warm: WarmSettings | None = None, user: WorkerUser | None = None,
                 encryption: str = "none", cgroups: Containment | None = None,
                 users: WorkerUserPool | None = None) -> None:
        if user is not None and users is not None:
            raise ValueError("workers run as one worker user or as a pool of them, not both")
        self.workers_dir = Path(state_dir) / "workers"
        self.workers_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.user = user
        self.users = users
        self.homes_dir = Path(state_dir) / "worker-homes"
        # Not listable by anyone but the agent; with worker users, enterable:
        # each reads its own connection file there while it starts.
        self.workers_dir.chmod(0o711 if user is not None or users is not None else 0o700)
        self.ip = ip
        self.encryption = encryption
        self.advertise_ip = advertise_ip or ip
        self.node = node
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.extensions = tuple(extensions)
        self.environ = dict(os.environ if environ is None else environ)
        self.cwd = str(cwd or (_user_home(user, Path(state_dir)) if user is not None else Path.home()))
        self.log = log or logging.getLogger("gpupool.agent")
        if users is not None:
            _shared_scratch_root(self.log)
        self.cgroups = cgroups if cgroups is not None else containment("auto", "", state_dir, log=self.log)
        self.log.info("worker cgroups: %s under %s", self.cgroups.mode, self.cgroups.where)
        self._context = zmq.asyncio.Context()
        # No kernel dirs: always the native ipykernel of this interpreter, never
        # a "python3" kernelspec that a user installed elsewhere on the node.
        self._kernel_specs = KernelSpecManager(kernel_dirs=[])
        self._workers: dict[str, Worker] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._closing = False
        self.warm = warm or WarmSettings()
        self.pool: WarmPool[Worker] = WarmPool(self.warm.size, self.warm.max_age, launch=self._launch_unbound,
                                               discard=self._terminate, alive=lambda w: not _exited(w.process),
                                               log=self.log)

    # -- queries ----------------------------------------------------------------

    def get(self, lease_id: str) -> Worker:
        """The worker of ``lease_id``; KeyError when there is none."""
        return self._workers[lease_id]

    def lease_ids(self) -> list[str]:
        return list(self._workers)

    def poll(self) -> list[Worker]:
        """Notice workers that exited by themselves; returns the newly dead.

        A dead worker stays listed (reported ``dead`` with its exit code) until
        :meth:`stop` is called for its lease. Its cgroup (without one: its
        process group) is killed on the spot, so processes it started do not
        keep GPU memory.
        """
        newly_dead = []
        for worker in self._workers.values():
            if worker.dead or worker.stopping or not _exited(worker.process):
                continue
            if worker.cgroup.kind != "none":
                try:
                    worker.cgroup.kill(timeout=0.0)  # what its cells started goes with it; waited for at stop
                except CgroupError as exc:
                    self.log.error("could not kill what the dead worker of lease %s left: %s", worker.name, exc)
            elif isinstance(worker.process, AdoptedProcess):
                # Not our child: init reaped it, so find its group by start time.
                kill_all(left_behind(worker.pid, worker.started_at))
            if not isinstance(worker.process, AdoptedProcess):
                # The leader is a zombie until reaped below, so its process group id
                # cannot have been reused yet: the kill reaches only its own group.
                _kill_group(worker.pid)
            worker.exit_code, worker.ended = worker.process.wait(), True
            if worker.watcher is not None:
                worker.watcher.cancel()
            self.log.warning("the worker (pid %s) of lease %s died with exit code %s; its last output:\n%s",
                             worker.pid, worker.spec.lease_id, worker.exit_code, worker.log_tail() or "(none)")
            newly_dead.append(worker)
        return newly_dead

    def reports(self, process_memory: Mapping[int, int] | None = None) -> list[WorkerReport]:
        """A WorkerReport per worker, after :meth:`poll`. ``process_memory``
        (pid -> GPU bytes, from the inventory) gives each worker's
        ``memory_used``, summed over its process tree; None when unknown."""
        self.poll()
        result = []
        for worker in self._workers.values():
            memory = None
            if process_memory and not worker.dead:
                pids = [worker.pid, *(p.pid for p in worker.descendants())]
                if any(pid in process_memory for pid in pids):
                    memory = sum(process_memory.get(pid, 0) for pid in pids)
            result.append(worker.report(memory))
        return result

    # -- start ------------------------------------------------------------------

    async def start(self, spec: WorkerSpec) -> Worker:
        """Start the worker of ``spec.lease_id`` and wait until it answers
        ``kernel_info``; return it.

        Idempotent: a live worker of the same lease is returned as it is (a
        dead one is replaced). Raises :class:`WorkerStartError` with the reason
        when the kernel does not come up within ``start_timeout``; nothing is
        left running then.
        """
        if self._closing:
            raise WorkerStartError("the agent is shutting down")
        async with self._lock(spec.lease_id):
            if self._closing:
                raise WorkerStartError("the agent is shutting down")
            existing = self._workers.get(spec.lease_id)
            if existing is not None:
                self.poll()
                if not existing.dead:
                    if existing.spec != spec:
                        self.log.warning("lease %s already has a worker with other limits; keeping it",
                                         spec.lease_id)
                    return existing
                await self._terminate(self._workers.pop(spec.lease_id))
            began = time.monotonic()
            # Warm workers run the agent's Python as the manager's user.
            worker = await self._from_pool(spec) if spec.python is None and spec.user is None else None
            how = "warm" if worker is not None else "cold"
            if worker is None:
                worker = await self._launch(spec)
            await asyncio.to_thread(enforce_host_limits, worker.cgroup, spec.lease_id, spec.cpus, spec.host_memory,
                                    self.log)
            self._workers[spec.lease_id] = worker
            worker.record().write(self.workers_dir)
            self.log.info("worker for lease %s of %s started %s in %.0f ms: pid %s, GPUs %s, fraction %g, "
                          "memory %s bytes", spec.lease_id, spec.owner, how, 1000 * (time.monotonic() - began),
                          worker.pid, ",".join(g.uuid for g in spec.gpus), spec.fraction, spec.memory)
            return worker

    def start_warm_pool(self) -> None:
        """Start filling the warm pool in the background (no-op for size 0).
        Call once, on the agent's event loop."""
        self.pool.start()

    async def _from_pool(self, spec: WorkerSpec) -> Worker | None:
        """A warm worker bound to ``spec``, or None (pool empty, or the
        binding failed: that worker is stopped, never offered again)."""
        worker = self.pool.take()
        if worker is None:
            return None
        try:
            await self._bind(worker, spec)
        except WorkerBindError as exc:
            self.log.warning("warm worker %s (pid %s) could not be bound to lease %s (%s); stopping it and "
                             "starting a cold one", worker.name, worker.pid, spec.lease_id, exc)
            await _quietly(self._terminate(worker))
            return None
        return worker

    async def _bind(self, worker: Worker, spec: WorkerSpec) -> None:
        """Bind a warm worker to ``spec``: put the slice's variables in its
        ``os.environ`` (:func:`~gpupool.provisioner.worker_extension.bind` refuses when
        CUDA is initialised there already). From then on it is ``spec``'s
        worker, idle since now, as a cold worker is idle since it answered."""
        env = slice_environment(spec.gpus, spec.fraction, spec.memory, spec.lease_id, spec.owner, self.node)
        # A fresh activity, not ready until bound: what the warm worker did
        # before (its start, the preload) is not the lease's.
        worker.activity = WorkerActivity()
        try:
            # A healthy worker answers in milliseconds; one that does not is
            # replaced by a cold start well within the service's start timeout.
            reply = await self._execute(worker, bind_code(env), min(BIND_TIMEOUT_S, self.start_timeout))
        except Exception as exc:  # noqa: BLE001 - died, timed out: the caller falls back to a cold start
            raise WorkerBindError(f"it did not answer the binding: {exc or type(exc).__name__}") from None
        if reply.get("status") != "ok":
            raise WorkerBindError(f"{reply.get('ename', 'error')}: {reply.get('evalue', '')}")
        worker.spec, worker.name = spec, spec.lease_id
        worker.activity.mark_ready()
        # ipykernel publishes the binding's "idle" status just after its reply:
        # wait for it (a few ms), so the lease's first report says idle, as a
        # cold worker's does.
        for _ in range(250):
            if worker.activity.execution_state == "idle":
                break
            await asyncio.sleep(0.004)

    async def _execute(self, worker: Worker, code: str, timeout: float) -> dict[str, Any]:
        """Run ``code`` silently (no history, no execution count) on the
        worker; returns the ``execute_reply`` content; TimeoutError after
        ``timeout`` seconds. The agent alone holds a warm worker's key, so no
        one else can send it code meanwhile."""
        client = worker.manager.client()
        client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
        try:
            reply = await client.execute(code, silent=True, store_history=False, allow_stdin=False,
                                         reply=True, timeout=timeout)
        finally:
            client.stop_channels()
        return reply["content"]

    async def _launch_unbound(self) -> Worker:
        """Start one warm worker: no GPU visible, ``warm.preload`` imported.
        Raises WorkerStartError (nothing is left running then)."""
        # Unguessable: no one may find a warm worker's files (or cgroup) by counting.
        name = f"warm-{secrets.token_hex(8)}"
        worker = await self._launch_kernel(name, worker_environment(self.environ, UNBOUND_ENVIRONMENT), name)
        if self.warm.preload:
            try:
                reply = await self._execute(worker, preload_code(self.warm.preload), self.start_timeout)
            except Exception as exc:  # noqa: BLE001 - reported as a failed warm start
                reply = {"ename": type(exc).__name__, "evalue": str(exc)}
            if reply.get("status") != "ok":
                await _quietly(self._terminate(worker))
                raise WorkerStartError(f"preloading {', '.join(self.warm.preload)} failed: "
                                       f"{reply.get('ename')}: {reply.get('evalue')} (c.NodeAgent.preload_modules)")
        self.log.info("warm worker %s ready: pid %s", name, worker.pid)
        return worker

    async def _launch(self, spec: WorkerSpec) -> Worker:
        env = worker_environment(self.environ, slice_environment(
            spec.gpus, spec.fraction, spec.memory, spec.lease_id, spec.owner, self.node))
        worker = await self._launch_kernel(spec.lease_id, env, f"lease-{spec.lease_id}", python=spec.python,
                                           user=spec.user)
        worker.spec = spec
        return worker

    async def _launch_kernel(self, name: str, env: dict[str, str], cgroup_name: str, python: str | None = None,
                             user: WorkerUser | None = None) -> Worker:
        """Start one ipykernel with ``env`` in a new cgroup ``cgroup_name``,
        its log named after ``name``, and wait until it answers
        ``kernel_info``. ``python``: the environment's interpreter (None: the
        agent's); ``user``: the lease owner's own account (a ``worker_user``
        template), else one of the pool's, else the one worker user. Raises
        WorkerStartError."""
        log_path = self.workers_dir / f"{name}.log"
        # A random name: the cgroup and the log name the lease, the key's file does not.
        manager = self._manager(self.workers_dir / f"kernel-{secrets.token_hex(16)}.json")
        manager.python = python
        try:
            account = user or (self.users.take() if self.users is not None else self.user)
        except NoFreeWorkerUser as exc:
            raise WorkerStartError(f"could not start the worker for {name}: {exc}") from None
        pooled = user is None and self.users is not None
        manager.owner = (account.uid, account.gid) if account is not None else None
        try:
            cgroup = await asyncio.to_thread(self.cgroups.create, cgroup_name)
        except CgroupError as exc:
            if pooled:
                await self._give_back(account)
            raise WorkerStartError(f"could not make the cgroup of the worker for {name}: {exc}") from None
        if cgroup.kind != "none":
            manager.cgroup = cgroup
        as_user, cwd = {}, self.cwd
        if account is not None:
            cwd = str(_user_home(user, self.workers_dir.parent)) if user is not None else self._workdir(account)
            as_user = account.popen_kwargs()
            env = {**env, **account.environment(cwd)}
        try:
            # The child keeps its own copy of the descriptor; ours can close.
            # Independent: no ipykernel parent poller, so a worker outlives a
            # crashed agent and the restarted one re-adopts it (recover()).
            with open(log_path, "ab", opener=_private) as out:
                await manager.start_kernel(env=env, extra_arguments=kernel_arguments(self.extensions),
                                           stdout=out, stderr=subprocess.STDOUT, cwd=cwd, independent=True,
                                           **as_user)
        except Exception as exc:
            process = getattr(manager.provisioner, "process", None)
            if process is not None:  # launched, then something after it failed
                await asyncio.to_thread(_kill_and_wait, process, (), 5.0)
            await _quietly(asyncio.to_thread(_kill_and_remove, cgroup, 5.0))
            await _quietly(manager.cleanup_resources())
            await self._give_back(account)
            raise WorkerStartError(f"could not launch the worker for {name}: {exc}") from None
        if cgroup.kind == "none":
            cgroup.add(manager.provisioner.process.pid)
        worker = Worker(None, manager, manager.provisioner.process, log_path, self.advertise_ip, name, cgroup)
        worker.user = account
        # Subscribe before the kernel_info round trip, so the first cell's
        # status messages cannot be missed.
        worker.watcher = asyncio.create_task(
            watch_iopub(worker, manager.get_connection_info(), self._context, self.log))
        client = manager.client()
        client.start_channels()
        try:
            await client.wait_for_ready(timeout=self.start_timeout)
        except Exception as exc:
            client.stop_channels()
            reason = _start_failure(exc, worker)
            await _quietly(self._terminate(worker))
            raise WorkerStartError(reason) from None
        client.stop_channels()
        if manager.owner is not None:
            # Read: take the key back from the worker user, whom every worker shares.
            os.chown(manager.connection_file, os.getuid(), os.getgid())
        worker.activity.mark_ready()
        return worker

    def _workdir(self, account: WorkerUser) -> str:
        """The working directory of a worker running as ``account``: with a
        pool, ``worker-homes/NAME`` (made for it, 0700); else :attr:`cwd`."""
        if self.users is None:
            return self.cwd
        folder = self.homes_dir / account.name
        self.homes_dir.mkdir(mode=0o711, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chown(folder, account.uid, account.gid)
        return str(folder)

    async def _give_back(self, account: WorkerUser | None) -> None:
        """Return a pool account once its worker's processes are gone."""
        if self.users is not None and account is not None:
            await asyncio.to_thread(self.users.give_back, account, self.homes_dir / account.name)

    def _manager(self, connection_file: Path) -> "_WorkerKernelManager":
        return _WorkerKernelManager(
            kernel_name=NATIVE_KERNEL_NAME, kernel_spec_manager=self._kernel_specs, context=self._context,
            connection_file=str(connection_file), ip=self.ip, shutdown_wait_time=self.stop_timeout, log=self.log,
            transport_encryption="required" if self.encryption == "curve" else "disabled")

    # -- after an agent restart -------------------------------------------------

    async def recover(self) -> list[Worker]:
        """Take over what an earlier run of the agent left in ``workers_dir``;
        returns the workers re-adopted. Call once, before anything else.

        A lease's worker that still runs and answers on its control channel
        within :data:`ADOPT_TIMEOUT_S` is re-adopted as it is (variables, a
        running cell); the next report names it, and the service keeps its
        lease or says to stop it. Everything else that earlier run started is
        killed, with what it started: warm workers, workers that do not
        answer or have no record, and what the cells of dead workers left
        behind. Their files are removed.

        With cgroups, a record's worker is found in the cgroup the record
        names (its pid there, with the recorded start time), and every other
        cgroup of the agent's subtree is killed and removed: whatever its
        processes call themselves. Processes outside any cgroup (a run without
        cgroups before) are found as before, by their command line and
        process group.
        """
        records, problems = read_records(self.workers_dir)
        for problem in problems:
            self.log.warning("ignoring %s", problem)
        adopted = [worker for worker in [await self._adopt(record) for record in records] if worker is not None]
        for worker in adopted:
            self._workers[worker.spec.lease_id] = worker
        await self._kill_stray_cgroups({worker.cgroup.name for worker in adopted})
        keep = {worker.pid for worker in adopted}
        strays = stray_workers(self.workers_dir, keep)
        for record in records:
            if record.pid not in keep and not record.cgroup:
                strays += left_behind(record.pid, record.create_time)
        if strays:
            self.log.warning("stopping %d process(es) an earlier run of the agent left: pids %s", len(strays),
                             ", ".join(str(p.pid) for p in strays))
            survivors = await asyncio.to_thread(kill_all, strays)
            if survivors:
                self.log.error("processes %s survived SIGKILL", survivors)
        files = {Path(path) for worker in adopted for path in
                 (worker.manager.connection_file, worker.log_path, record_path(self.workers_dir, worker.spec.lease_id))}
        for path in self.workers_dir.iterdir():
            if path.is_file() and path not in files:
                _remove(path)
        if self.users is not None:  # what the killed workers' accounts left
            for account in self.users.free:
                await self._give_back(account)
        return adopted

    async def _kill_stray_cgroups(self, keep: set[str]) -> None:
        """Kill and remove every cgroup of the agent's subtree not in ``keep``."""
        for name in self.cgroups.names():
            if name in keep or (cgroup := self.cgroups.find(name)) is None:
                continue
            pids = sorted(cgroup.pids())
            if pids:
                self.log.warning("killing cgroup %s an earlier run of the agent left: pids %s", name,
                                 ", ".join(map(str, pids)))
            try:
                await asyncio.to_thread(_kill_and_remove, cgroup, 10.0)
            except CgroupError as exc:
                self.log.error("%s", exc)

    async def _adopt(self, record: WorkerRecord) -> Worker | None:
        """Re-adopt the worker of ``record``, or None (gone, or it does not answer: then it is stopped)."""
        try:
            spec = WorkerSpec(record.lease_id, record.owner, record.gpus, record.fraction, record.memory)
        except ValueError as exc:
            self.log.warning("ignoring the worker record of %r: %s", record.lease_id, exc)
            return None
        cgroup = self.cgroups.find(record.cgroup) if record.cgroup else None
        if record.cgroup and cgroup is None:
            self.log.warning("the cgroup %s of lease %s's worker is gone (c.NodeAgent.cgroup_root or cgroup_mode "
                             "changed?)", record.cgroup, record.lease_id)
            return None
        proc = record.process(cgroup.pids() if cgroup is not None else None)
        if proc is None:
            self.log.warning("the worker (pid %s) of lease %s ended while the agent was away", record.pid,
                             record.lease_id)
            return None
        manager = self._manager(Path(record.connection_file))
        try:
            manager.load_connection_file()
        except (OSError, ValueError) as exc:
            self.log.warning("cannot re-adopt the worker of lease %s: its connection file: %s", record.lease_id, exc)
            return None  # it is a stray now, and stopped as one
        worker = Worker(spec, manager, AdoptedProcess(proc), Path(record.log_path), self.advertise_ip,
                        cgroup=cgroup)
        worker.started_at = record.create_time
        worker.user = self.user
        if self.users is not None and record.user:
            worker.user = self.users.claim(record.user)
        watcher = asyncio.ensure_future(watch_iopub(worker, manager.get_connection_info(), self._context, self.log))
        try:
            await _control_kernel_info(worker, ADOPT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - timed out, refused: not a usable worker
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            self.log.warning("the worker (pid %s) of lease %s did not answer after the agent restarted (%s); "
                             "stopping it", record.pid, record.lease_id, str(exc) or type(exc).__name__)
            return None
        worker.watcher = asyncio.gather(watcher, _track_running_cell(worker, self.log))
        self.log.info("re-adopted the worker (pid %s) of lease %s of %s", record.pid, record.lease_id, record.owner)
        return worker

    # -- stop -------------------------------------------------------------------

    async def stop(self, lease_id: str) -> int | None:
        """Stop the worker of ``lease_id`` and verify that its processes are
        gone; returns its exit code (negative: killed by that signal).

        Graceful first (interrupt, ``shutdown_request``), SIGTERM and SIGKILL
        after ``stop_timeout``. Raises KeyError for an unknown lease and
        :class:`WorkerStopError` when a process survives SIGKILL.
        """
        lock = self._lock(lease_id)
        async with lock:
            worker = self._workers.get(lease_id)
            if worker is None:
                self._locks.pop(lease_id, None)
                raise KeyError(lease_id)
            try:
                code = await self._terminate(worker)
            finally:
                self._workers.pop(lease_id, None)
        self._locks.pop(lease_id, None)
        self.log.info("worker for lease %s stopped (exit code %s)", lease_id, code)
        return code

    async def stop_all(self) -> dict[str, int | None]:
        """Stop every worker concurrently, including those still starting,
        and refuse new starts; returns lease id -> exit code. A worker that
        could not be stopped is logged and maps to None."""
        self._closing = True
        leases = sorted(set(self._workers) | set(self._locks))
        *results, pooled = await asyncio.gather(*(self.stop(lease) for lease in leases), self.pool.close(),
                                                return_exceptions=True)
        if isinstance(pooled, BaseException):
            self.log.error("could not stop the warm workers: %s", pooled)
        codes: dict[str, int | None] = {}
        for lease, result in zip(leases, results):
            if isinstance(result, KeyError):  # its start failed meanwhile
                continue
            if isinstance(result, BaseException):
                self.log.error("could not stop the worker of lease %s: %s", lease, result)
                codes[lease] = None
            else:
                codes[lease] = result
        self.cgroups.close()  # the agent's subtree, now empty (close() tries again)
        return codes

    async def _terminate(self, worker: Worker) -> int | None:
        worker.stopping = True
        if worker.watcher is not None:
            worker.watcher.cancel()
            await asyncio.gather(worker.watcher, return_exceptions=True)
        children = worker.descendants()
        try:
            if isinstance(worker.process, AdoptedProcess):
                await asyncio.wait_for(_shutdown_adopted(worker, self.stop_timeout), self.stop_timeout + 5)
                await worker.manager.cleanup_resources()
            elif worker.process.poll() is None:
                await asyncio.wait_for(worker.manager.shutdown_kernel(), self.stop_timeout + 5)
            else:
                # Dead and reaped already: only release the manager's pipes and
                # files. Not shutdown_kernel(now=True): it would signal a process
                # group id that may belong to someone else by now.
                await asyncio.wait_for(worker.manager.provisioner.wait(), 5)
                await worker.manager.cleanup_resources()
        except Exception as exc:
            self.log.warning("worker %s did not shut down cleanly (%s); killing it",
                             worker.name, exc or type(exc).__name__)
        try:
            # The cgroup first: a daemon that left the process tree goes too.
            survivors = await asyncio.to_thread(worker.cgroup.kill, 10.0)
        except CgroupError as exc:
            self.log.error("could not kill the cgroup of worker %s: %s", worker.name, exc)
            survivors = []
        survivors += await asyncio.to_thread(_kill_and_wait, worker.process, children, 10.0)
        try:
            await asyncio.to_thread(worker.cgroup.remove)
        except CgroupError as exc:
            self.log.error("%s", exc)
        worker.exit_code, worker.ended = worker.process.returncode, True
        _remove(Path(worker.manager.connection_file), worker.log_path,
                record_path(self.workers_dir, worker.spec.lease_id if worker.spec else worker.name))
        if not survivors:
            await self._give_back(worker.user)
        if survivors:
            raise WorkerStopError(f"processes {sorted(set(survivors))} of the worker {worker.name} survived SIGKILL")
        return worker.exit_code

    def _lock(self, lease_id: str) -> asyncio.Lock:
        return self._locks.setdefault(lease_id, asyncio.Lock())

    def close(self) -> None:
        """Release the ZMQ context and the agent's empty cgroup subtree;
        call after :meth:`stop_all`."""
        self._context.destroy(linger=0)
        self.cgroups.close()


def _exited(process: subprocess.Popen) -> bool:
    """True when the child has exited, without reaping it (WNOWAIT keeps the
    zombie, and with it the process group id, until ``wait``)."""
    if isinstance(process, AdoptedProcess):
        return process.gone
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return process.poll() is not None


def _kill_group(pgid: int) -> None:
    # Workers lead their own session (jupyter_client's launcher uses
    # start_new_session), so their pid is their process group id.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _kill_and_wait(process: subprocess.Popen, children: Iterable[psutil.Process], timeout: float) -> list[int]:
    """SIGKILL what is left of a worker and wait; returns the pids still alive."""
    if isinstance(process, AdoptedProcess):
        return kill_all([process.proc, *children], timeout)
    if process.returncode is None:  # not reaped: the group id is still this worker's
        _kill_group(process.pid)
    if process.returncode is None:
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    children = list(children)
    for child in children:
        try:
            child.kill()  # psutil checks the create time: never a reused pid
        except psutil.Error:
            pass
    deadline = time.monotonic() + timeout
    alive = [child for child in children if _running(child)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [child for child in alive if _running(child)]
    survivors = [child.pid for child in alive]
    if process.returncode is None:
        survivors.insert(0, process.pid)
    return survivors


def _shared_scratch_root(log: logging.Logger) -> None:
    """Make the workers' scratch root (:func:`gpupool.provisioner.worker_extension.workdir.enter_workdir`:
    ``TMP/gpupool-scratch``) root's and sticky, as /tmp is, so that each pool
    account can make its owner's folder there; made by the first worker, it
    would be that account's alone."""
    root = Path(tempfile.gettempdir()) / "gpupool-scratch"
    try:
        root.mkdir(exist_ok=True)
        if root.stat().st_uid == os.getuid():
            root.chmod(0o1777)
        else:
            log.warning("%s belongs to uid %s: workers of the other worker users cannot make their scratch folders "
                        "there; remove it (it is made again for all)", root, root.stat().st_uid)
    except OSError as exc:
        log.warning("cannot prepare the workers' scratch folder %s: %s", root, exc)


def _kill_and_remove(cgroup: LeaseCgroup, timeout: float) -> None:
    """Kill ``cgroup`` and remove it; CgroupError when it cannot be."""
    cgroup.kill(timeout)
    cgroup.remove()


def _processes(pids: Iterable[int]) -> list[psutil.Process]:
    found = []
    for pid in sorted(pids):
        try:
            found.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return found


class _WorkerKernelManager(AsyncKernelManager):
    """jupyter_client's kernel manager; ``owner`` (uid, gid), when set, gets
    the connection file as soon as it is written, before the kernel starts.
    ``cgroup``, when set, is joined through the :data:`START_GATE` before
    the kernel runs."""

    owner: tuple[int, int] | None = None
    #: The worker environment's interpreter (None: this one, as jupyter_client picks it).
    python: str | None = None
    cgroup: LeaseCgroup | None = None

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        cmd = super().format_kernel_cmd(extra_arguments)
        cmd = with_launcher(cmd, WORKER_KERNEL_APP) or cmd  # no shell-channel thread (gpupool.kernelapp)
        if self.python:
            cmd = [self.python, *cmd[1:]]
        return [*START_GATE, *cmd] if self.cgroup is not None else cmd

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        if self.cgroup is None:
            await super()._async_launch_kernel(kernel_cmd, **kw)
            return
        gate, opener = os.pipe()
        try:
            try:
                await super()._async_launch_kernel(kernel_cmd, stdin=gate, **kw)
            finally:
                os.close(gate)
            # The gate waits on its stdin: nothing of the worker runs yet.
            self.cgroup.add(self.provisioner.process.pid)
            os.write(opener, b"go\n")
        finally:
            os.close(opener)  # without "go", the gate exits (code 1) and the start fails

    def write_connection_file(self, **kwargs: Any) -> None:
        # The data plane's port (gpupool.dataplane), picked like jupyter_client's own: free now, on ``ip``.
        kwargs.setdefault("transfer_port", _free_port(self.ip))
        super().write_connection_file(**kwargs)
        if self.owner is not None:
            os.chown(self.connection_file, *self.owner)


def _free_port(ip: str) -> int:
    """A TCP port free on ``ip`` now (the kernel binds it a moment later)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as probe:
        probe.bind((ip, 0))
        return probe.getsockname()[1]


def _transfer_port(connection_file: str) -> int | None:
    """The data plane's port in a worker's connection file (None: none, an older agent's worker)."""
    import json

    try:
        with open(connection_file, encoding="utf-8") as handle:
            return json.load(handle).get("transfer_port")
    except (OSError, ValueError):
        return None


def _private(path: str, flags: int) -> int:
    """``open`` opener: a new file readable by the agent's user only (a
    worker's output is its user's business)."""
    return os.open(path, flags, 0o600)


def _user_home(user: WorkerUser, state_dir: Path) -> Path:
    """The worker user's working directory: its home when that is its own
    directory, else ``state_dir/worker-home`` made for it."""
    home = Path(user.home)
    if home.is_dir() and home.stat().st_uid == user.uid:
        return home
    made = state_dir / "worker-home"
    made.mkdir(mode=0o700, exist_ok=True)
    os.chown(made, user.uid, user.gid)
    return made


async def _control_kernel_info(worker: Worker, timeout: float) -> None:
    """Ask the worker for ``kernel_info`` on its control channel (answered
    even while a cell runs); TimeoutError after ``timeout`` seconds."""
    client = worker.manager.client()
    client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
    msg = client.session.msg("kernel_info_request")

    async def answer() -> None:
        while (await client.control_channel.get_msg())["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
            pass

    try:
        client.control_channel.send(msg)
        await asyncio.wait_for(answer(), timeout)
    finally:
        client.stop_channels()


async def _track_running_cell(worker: Worker, log: logging.Logger) -> None:
    """Learn whether a re-adopted worker is running a cell: its shell channel
    answers ``kernel_info`` only once no cell runs. Until the answer, the
    worker counts as busy (never reclaimed for idleness); the running cell's
    own end, seen on IOPub, then counts as the end of the last cell."""
    client = worker.manager.client()
    client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)

    def status(msg_id: str, state: str) -> dict[str, Any]:
        return {"msg_type": "status", "parent_header": {"msg_id": msg_id, "msg_type": "kernel_info_request"},
                "content": {"execution_state": state}}

    msg_id = client.kernel_info()
    worker.activity.on_message(status(msg_id, "busy"))
    worker.activity.mark_ready()
    try:
        while (await client.get_shell_msg())["parent_header"].get("msg_id") != msg_id:
            pass
    except Exception as exc:  # noqa: BLE001 - its death is noticed by poll()
        log.debug("no kernel_info answer from the worker of %s: %s", worker.name, exc)
    finally:
        worker.activity.on_message(status(msg_id, "idle"))
        client.stop_channels()


async def _shutdown_adopted(worker: Worker, grace: float) -> None:
    """Ask a re-adopted worker to shut down (``shutdown_request`` on control)
    and wait up to ``grace`` seconds for it to exit; what is left is killed
    by the caller."""
    client = worker.manager.client()
    client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
    try:
        client.shutdown()
        await asyncio.to_thread(worker.process.wait, grace)
    except subprocess.TimeoutExpired:
        pass
    finally:
        client.stop_channels()


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _start_failure(exc: BaseException, worker: Worker) -> str:
    code = worker.process.poll()
    why = f"it exited with code {code}" if code is not None else f"{exc or type(exc).__name__}"
    tail = worker.log_tail()
    return f"the worker for {worker.name} did not start: {why}" + (f"; its output ends with:\n{tail}" if tail else "")


def _remove(*paths: Path) -> None:
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


async def _quietly(awaitable: Any) -> None:
    """Await, swallowing errors: for cleanup paths that must not hide the
    error being reported."""
    try:
        await awaitable
    except Exception:  # noqa: BLE001 - cleanup only
        pass
