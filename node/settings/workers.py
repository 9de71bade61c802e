"""``c.AgentWorkers``: how the node's workers run: their launcher, start and
stop, the warm pool and worker templates, their accounts, their environments
and their transport encryption."""

from __future__ import annotations

from typing import Any

import zmq
from traitlets import Bool, Dict, Enum, Integer, List, TraitError, Unicode, default, validate
from traitlets.config import Configurable

from gpupool.traits import Duration

from ..workers import launchers
from .choices import one_of


class AgentWorkers(Configurable):
    """The node's workers: how they start, stop, wait warm, and what they run as and in."""

    worker_launcher = Unicode(
        "local",
        help=f"""How this node starts its workers; installed here: {", ".join(launchers.available())}.
        ``local`` (the default) starts an ipykernel process on this host, in a cgroup of its own;
        another name is a launcher of the ``gpupool.worker_launchers`` entry point group (a subclass of
        ``gpupool.node.workers.launchers.WorkerLauncher``, e.g. one that starts each
        worker in a container). A worker an earlier run of the agent left running is
        re-adopted from its record, whichever launcher started it.
        ``c.AgentWorkers.worker_launcher = "local"``.""",
    ).tag(config=True)

    @validate("worker_launcher")
    def _worker_launcher_valid(self, proposal: Any) -> str:
        return one_of(proposal, launchers.available())

    worker_start_timeout = Duration(
        60.0, help="""Seconds a worker may take to answer its first ``kernel_info`` before its
        start fails. Default: 60. ``c.AgentWorkers.worker_start_timeout = "2m"``.""",
    ).tag(config=True)

    worker_stop_timeout = Duration(
        10.0, help="""Seconds a worker gets to shut down cleanly before SIGTERM, then SIGKILL.
        Default: 10. ``c.AgentWorkers.worker_stop_timeout = 20``.""",
    ).tag(config=True)

    warm_workers = Integer(
        1, help="""Workers kept started ahead of any lease, bound to a lease's GPUs when one
        takes them: a lease then attaches in milliseconds instead of waiting for a kernel
        to start (docs/enforcement.md, "Binding a worker to its GPUs"). Each is handed out
        once; 0 starts every worker when its lease asks. Default: 1. ``c.AgentWorkers.warm_workers = 2``.""",
    ).tag(config=True)

    @validate("warm_workers")
    def _warm_workers_valid(self, proposal: Any) -> int:
        if proposal["value"] < 0:
            raise TraitError(f"c.AgentWorkers.warm_workers must be 0 or more, got {proposal['value']}")
        return proposal["value"]

    preload_modules = List(
        Unicode(), help="""Modules each warm worker imports before a lease takes it, so the
        user's first ``import`` is instant, e.g. ``["torch"]``. They must not initialise
        CUDA (importing ``torch`` does not): a worker where CUDA is initialised cannot be
        bound and is replaced by a cold start. Default: none.
        ``c.AgentWorkers.preload_modules = ["torch", "numpy"]``.""",
    ).tag(config=True)

    worker_templates = Bool(
        True, help="""Whether a cold worker is forked from a template of its interpreter (a process
        that has imported ipykernel, the worker extension and ``preload_modules`` once) instead of
        booting a new interpreter: a cold attach then skips those imports. The forked worker joins
        its cgroup and takes its account, environment and folder before it runs a line of its own.
        A worker whose PYTHONPATH or LD_LIBRARY_PATH differs from the template's boots. Default:
        True. ``c.AgentWorkers.worker_templates = False``.""",
    ).tag(config=True)

    warm_worker_max_age = Duration(
        1800.0, help="""Seconds a warm worker may wait for a lease before it is stopped and
        replaced by a fresh one. Default: 30 minutes. ``c.AgentWorkers.warm_worker_max_age = "1h"``.""",
    ).tag(config=True)

    @validate("warm_worker_max_age")
    def _warm_worker_max_age_valid(self, proposal: Any) -> float:
        if proposal["value"] <= 0:
            raise TraitError(f"c.AgentWorkers.warm_worker_max_age must be positive, got {proposal['value']}")
        return proposal["value"]

    transport_encryption = Enum(
        ["curve", "none"],
        help="""Whether the traffic between notebook kernels and this node's workers is
        encrypted. ``curve``: every worker binds its ZeroMQ sockets as CurveZMQ servers with a
        key pair of its own (jupyter_client's ``transport_encryption``); its owner gets the
        public key, and the secret key never leaves the node. ``none``: plain ZeroMQ, signed
        but readable by anyone on the network path. Default: ``curve`` when libzmq has CURVE
        (``zmq.has("curve")``), else ``none``. ``c.AgentWorkers.transport_encryption = "curve"``.""",
    ).tag(config=True)

    @default("transport_encryption")
    def _transport_encryption_default(self) -> str:
        return "curve" if zmq.has("curve") else "none"

    @validate("transport_encryption")
    def _transport_encryption_valid(self, proposal: Any) -> str:
        if proposal["value"] == "curve" and not zmq.has("curve"):
            raise TraitError("transport_encryption='curve' needs a libzmq built with CURVE (libsodium); this "
                             "pyzmq's has none: install the pyzmq wheel, or set --transport-encryption=none")
        return proposal["value"]

    worker_user = Unicode(
        None, allow_none=True, help="""Linux user every worker (and so every user's code) runs
        as, instead of the agent's own user: it can then read neither the agent's token file
        nor its state. The agent must run as root for this; the state directory must be
        reachable (``x``) by that user, who gets its own connection file there and works in
        its home directory (or ``STATE_DIR/worker-home`` when it has none). None (default):
        workers run as the agent's user. ``c.AgentWorkers.worker_user = "gpupool-worker"``
        (create it with ``useradd --system --no-create-home gpupool-worker``).
        A template with ``{username}`` names an account per lease from its owner:
        ``"{username}"`` runs each worker as the notebook user's own account, where
        the node knows the users (LDAP/NSS) and shares their homes; a lease whose
        owner has no account here is refused.""",
    ).tag(config=True)

    worker_users = List(
        Unicode(), help="""A pool of Linux users for workers, instead of one ``worker_user``:
        every worker (warm ones included) runs as an account that no other live worker has,
        so two users' workers on one node cannot read each other's files, environment or
        memory; an account is used again only once no process runs as it, after its files in
        /tmp, /var/tmp, /dev/shm and its work directory are removed (docs/security.md,
        "Containment"). Needs root and accounts of their own (never a person's): as many as
        leases may run on the node at once, plus ``warm_workers``; a start fails, naming this
        setting, when all are in use. Default: empty.
        ``c.AgentWorkers.worker_users = [f"gpupool-w{i}" for i in range(8)]``.""",
    ).tag(config=True)

    environments = Dict(
        key_trait=Unicode(), value_trait=Unicode(),
        help="""Worker environments a lease may name: name -> a Python interpreter, or a
        conda/venv prefix (``PREFIX/bin/python``). Each needs ipykernel and gpupool's
        worker part (``pip install 'gpupool[worker]'`` in it); the agent checks each
        at start and reports which are usable (``gpupool pool``). The agent's own
        Python is there too, as ``default``. Default: none besides it.
        ``c.AgentWorkers.environments = {"torch": "/opt/conda/envs/torch", "py311": "/usr/bin/python3.11"}``.""",
    ).tag(config=True)

    default_environment = Unicode(
        "", help="""The environment of a lease that names none. Default: empty, meaning
        ``default`` (the agent's own Python). ``c.AgentWorkers.default_environment = "torch"``.""",
    ).tag(config=True)
