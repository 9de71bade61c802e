"""The worker launcher contract: how a node starts the worker of a lease (cold)
or one kept ahead of any lease (warm).

:class:`~..manager.WorkerManager` makes one launcher per node, of the class
``c.NodeAgent.worker_launcher`` names (:mod:`.factory`), and calls only
:meth:`WorkerLauncher.cold` and :meth:`WorkerLauncher.warm`. The stock one,
``local`` (:class:`~.local.LocalLauncher`), starts an ipykernel process on
the agent's host. This is the seam where a container or pod launcher plugs
in: its :class:`~..handle.Worker` carries a :class:`~..process.WorkerProcess`
of its own kind, which the rest of the worker code watches and stops without
asking which kind it is.

Whichever launcher started it, a worker that outlives its agent is found
again by :mod:`..recovery` from its record, as an
:class:`~..process.AdoptedProcess`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

from ...cgroups import Containment
from ..accounts import WorkerAccounts
from ..handle import Worker
from ..kernel import KernelManagers
from ..spec import WorkerSettings, WorkerSpec
from ..stopping import Reaper


class WorkerLauncher(ABC):
    """Starts the workers of one node as ``settings`` says, as the accounts
    of ``accounts``, in cgroups of ``cgroups``, with kernel managers of
    ``kernels``; ``reaper`` stops what a failed start left. A subclass that
    overrides ``__init__`` takes the same arguments and calls ``super()``.

    Both methods run on the agent's event loop, concurrently for different
    workers, and return a :class:`~..handle.Worker` that answered
    ``kernel_info`` (its ``activity`` marked ready, its IOPub watched). Both
    raise :class:`~..spec.WorkerStartError`, with words for the service's
    report, when the worker does not come up; nothing they started is left
    running then.
    """

    def __init__(self, settings: WorkerSettings, accounts: WorkerAccounts, cgroups: Containment,
                 kernels: KernelManagers, reaper: Reaper, log: logging.Logger) -> None:
        self.settings = settings
        self.accounts = accounts
        self.cgroups = cgroups
        self.kernels = kernels
        self.reaper = reaper
        self.log = log

    @abstractmethod
    async def cold(self, spec: WorkerSpec) -> Worker:
        """Start the worker of ``spec`` (its ``spec`` set), its slice's
        environment (``settings.enforcement``) set from the start."""

    @abstractmethod
    async def warm(self) -> Worker:
        """Start one warm worker (``spec`` None): no GPU visible,
        ``settings.warm.preload`` imported; :mod:`..binding` binds it to a
        lease later."""
