"""What the workers of a node are asked for: the node's settings
(:class:`WorkerLaunch`, built once by the agent from ``c.AgentWorkers.*``,
``c.AgentEnforcement.*`` and its own ``c.NodeAgent.*``), one lease's worker
(:class:`WorkerSpec`), the environment a worker gets, and the errors a start,
a binding or a stop ends with."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from gpupool.kernelcmd import WORKER_EXTENSION
from gpupool.wire.nodes import GPUInfo

from ..enforcement import EnforcementMode, Timeslice
from ..process_limits import ProcessBudget
from ..worker_user import WorkerUser, WorkerUserPool

# Lease ids become file names under the state dir.
_LEASE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")

# Agent-side secrets a worker must never see: user code runs there.
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|PRIVATE_?KEY", re.IGNORECASE)
_PRIVATE_PREFIXES = ("GPUPOOL_", "JUPYTERHUB_", "JPY_API_")
#: Agent settings of ours a worker needs as they are: where simulated GPU memory lives (:mod:`..simgpu_store`).
_PASSED = ("GPUPOOL_SIMGPU_ROOT",)


class WorkerStartError(Exception):
    """A worker did not come up; the message says why (exit code, the tail of
    its log). The agent answers 502 ``worker_start_failed`` with it."""


class WorkerStopError(Exception):
    """A worker's processes survived SIGKILL (e.g. stuck in the GPU driver)."""


class WorkerBindError(Exception):
    """A warm worker refused or failed its binding (e.g. CUDA was already
    initialised in it); it is stopped and the lease's worker starts cold."""


@dataclass(frozen=True)
class WarmSettings:
    """The warm pool of one node (``c.AgentWorkers.warm_workers`` and friends):
    ``size`` workers kept started (0: none), each with the modules ``preload``
    imported, replaced after waiting ``max_age`` seconds."""

    size: int = 0
    preload: tuple[str, ...] = ()
    max_age: float = 1800.0


@dataclass(frozen=True)
class WorkerLaunch:
    """How the workers of one node are started and stopped.

    ``state_dir``: the agent's state directory; connection files and worker
    logs go under ``state_dir/workers`` (so every worker's command line names
    the state dir). ``node``: the node's name (``GPUPOOL_NODE``). ``ip``:
    where workers listen, the address clients reach them at, unless
    ``advertise_ip`` (for a wildcard ``ip``) says otherwise. ``start_timeout``
    and ``stop_timeout``: seconds. ``extensions``: IPython extensions each
    worker loads. ``environ``: the environment workers inherit, minus secrets
    (default: ``os.environ`` when the settings are made). ``cwd``: the
    workers' working directory (default the home directory).

    ``warm``: the warm pool (:class:`WarmSettings`; size 0, the default:
    every worker starts cold).

    ``encryption``: ``"curve"`` (each worker binds its sockets as CurveZMQ
    servers with a fresh key pair, jupyter_client's ``transport_encryption =
    "required"``; its connection info carries the public key) or ``"none"``.

    ``user``: the account workers run as (:class:`~..worker_user.WorkerUser`;
    None: the agent's own). Their connection files are then handed to it,
    ``workers_dir`` may be entered (not listed) by others, and the working
    directory defaults to its home, or to ``state_dir/worker-home`` (made
    for it) when it has none. ``users``: a pool of accounts
    (:class:`~..worker_user.WorkerUserPool`, shared: it tracks which are in
    use), instead of ``user``: each worker, warm ones too, runs as an account
    no other live worker has, and works in ``state_dir/worker-homes/NAME``
    (emptied when the account goes back to the pool); a start fails with
    WorkerStartError when every account is in use. ValueError for both.

    ``pids``: the node's task budget (:mod:`..process_limits`), which gives
    each lease's worker its ``pids.max``; None: no task limit (the host's
    cgroups cannot hold one).

    ``config``: the agent's traitlets config, where a launcher reads its own
    settings (``c.SlurmLauncher.*``); None: their defaults.

    ``templates``: whether the local launcher forks cold workers from a
    template of their interpreter (:mod:`.launchers.local.template`).
    """

    state_dir: Path
    node: str
    ip: str = "127.0.0.1"
    advertise_ip: str | None = None
    start_timeout: float = 60.0
    stop_timeout: float = 10.0
    extensions: tuple[str, ...] = (WORKER_EXTENSION,)
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    cwd: str | os.PathLike | None = None
    warm: WarmSettings = WarmSettings()
    encryption: str = "none"
    user: WorkerUser | None = None
    users: WorkerUserPool | None = None
    enforcement: EnforcementMode = field(default_factory=Timeslice)
    pids: ProcessBudget | None = None
    config: Any = None
    templates: bool = True

    def __post_init__(self) -> None:
        if self.user is not None and self.users is not None:
            raise ValueError("workers run as one worker user or as a pool of them, not both")
        # Frozen: normalize once, here.
        object.__setattr__(self, "state_dir", Path(self.state_dir))
        object.__setattr__(self, "advertise_ip", self.advertise_ip or self.ip)
        object.__setattr__(self, "extensions", tuple(self.extensions))
        object.__setattr__(self, "environ", dict(self.environ))

    @property
    def workers_dir(self) -> Path:
        """Where the workers' connection files, logs and records live."""
        return self.state_dir / "workers"


@dataclass(frozen=True)
class LeaseSlice:
    """A lease's slice on this node: the lease, its owner, its GPUs (in the
    order the worker sees them), the compute ``fraction`` in (0, 1] and the
    ``memory`` limit in bytes per GPU. What a worker is started for
    (:class:`WorkerSpec`) and what its record keeps (:mod:`.records`)."""

    lease_id: str
    owner: str
    gpus: tuple[GPUInfo, ...]
    fraction: float
    memory: int


@dataclass(frozen=True)
class WorkerSpec(LeaseSlice):
    """What the service asks for with ``POST /workers``: the slice
    (:class:`LeaseSlice`) and how its worker runs. ``python``: the
    interpreter of the environment the lease names (:mod:`..environments`;
    None: the agent's own, and a warm worker may serve it). ``user``: the
    account of this lease's worker when ``c.AgentWorkers.worker_user`` is a
    template such as ``"{username}"`` (None: the settings' ``user``).
    ``cpus`` (cores) and ``host_memory`` (bytes): the host limits its cgroup
    gets (None: no limit; :mod:`..host_limits`)."""

    python: str | None = None
    user: WorkerUser | None = None
    cpus: float | None = None
    host_memory: int | None = None

    def __post_init__(self) -> None:
        if not _LEASE_ID.match(self.lease_id):
            raise ValueError(f"lease id {self.lease_id!r} must be 1-100 letters, digits, '.', '_' or '-'")


def worker_environment(environ: Mapping[str, str], slice_env: Mapping[str, str]) -> dict[str, str]:
    """The environment of a worker: ``environ`` (the agent's) without its
    secrets, plus ``slice_env`` (:meth:`~..enforcement.EnforcementMode.environment`).

    Dropped: every ``GPUPOOL_*`` (the agent token, and the agent's own
    settings, which the slice's values replace) but ``GPUPOOL_SIMGPU_ROOT``,
    ``JUPYTERHUB_*``, and any name that looks like a credential (``TOKEN``,
    ``SECRET``, ``PASSWORD``, ``API_KEY``...). Kept: ``PATH``, ``HOME``,
    ``CUDA_MPS_PIPE_DIRECTORY`` and the rest, which user code and CUDA need.
    """
    env = {name: value for name, value in environ.items()
           if name in _PASSED or not name.startswith(_PRIVATE_PREFIXES) and not _SECRET_NAME.search(name)}
    env.update(slice_env)
    return env
