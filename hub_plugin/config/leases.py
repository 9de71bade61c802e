"""Settings of a lease's life: idle and heartbeat reclaim, the queue's wait, where a parked lease
resumes (``c.PoolLeases.*``)."""

from __future__ import annotations

from traitlets import Bool, Enum, TraitError, Union, validate
from traitlets.config import Configurable

from gpupool.traits import Duration


class PoolLeases(Configurable):
    """How long a lease lives and waits: idle and heartbeat reclaim, the
    queue's wait, where a parked lease resumes. Raises TraitError when ``idle_timeout`` is above
    ``max_idle_timeout``."""

    idle_timeout = Duration(
        30 * 60.0,
        help="""Seconds an attached worker may sit idle (no cell running) before
        its lease is reclaimed, when the request names none. Default: 30 minutes.
        ``c.PoolLeases.idle_timeout = "1h"``.""",
    ).tag(config=True)

    max_idle_timeout = Duration(
        24 * 3600.0,
        help="""Largest idle timeout a request may ask for, in seconds; a larger
        one is refused with 400. Default: 24 hours. ``c.PoolLeases.max_idle_timeout = "8h"``.""",
    ).tag(config=True)

    @validate("idle_timeout", "max_idle_timeout")
    def _idle_timeout_within_most(self, proposal):
        # Checked once both are set: a config file setting the two (in either order) is read whole first.
        idle, most = (proposal.value, self.max_idle_timeout) if proposal.trait.name == "idle_timeout" \
            else (self.idle_timeout, proposal.value)
        if idle > most:
            raise TraitError(f"c.PoolLeases.idle_timeout ({idle:g}s) is above c.PoolLeases.max_idle_timeout "
                             f"({most:g}s)")
        return proposal.value

    idle_warning = Union(
        [Duration(), Enum([0])], default_value=60.0,
        help="""Seconds before an idle lease is parked (or released, for one asked
        ``on_idle: release``) that the notebook warns, once per idle period; at
        most a third of the lease's idle timeout. The lease JSON carries it with
        ``idle_deadline``. 0 turns the warning off. Default: 60 seconds.
        ``c.PoolLeases.idle_warning = "5m"``.""",
    ).tag(config=True)

    heartbeat_ttl = Duration(
        60.0,
        help="""Seconds a lease lives without a heartbeat from its notebook kernel
        (while no cell runs) before it is reclaimed. Default: 60 seconds.
        ``c.PoolLeases.heartbeat_ttl = "2m"``.""",
    ).tag(config=True)

    reclaim_interval = Duration(
        5.0,
        help="""Seconds between two reclaim sweeps (idle leases, missing
        heartbeats, lost nodes). Default: 5 seconds. ``c.PoolLeases.reclaim_interval = 10``.""",
    ).tag(config=True)

    max_wait = Duration(
        3600.0,
        help="""Longest ``wait`` (seconds) a lease request may ask for: a request that
        does not fit waits in the queue that long, then ends ``failed``. A longer wait is
        refused with 400. Default: 1 hour. ``c.PoolLeases.max_wait = "4h"``.""",
    ).tag(config=True)

    resume_moves = Bool(
        True,
        help="""Whether a parked lease whose own node has no room for its resume may
        resume on another node with room on GPUs of the same model (a move): a
        worker parked in memory sends its namespace to a new worker there, worker
        to worker over the network; a spilled one (or one whose move from memory
        failed) goes through its node's disk, the new node's agent fetching the
        spill and loading it into a new worker; the old node's copy is removed.
        The cost: what cannot be pickled (locks, generators, open sockets, CUDA
        state outside the arrays saved) is lost, and named in the lease's events
        as in a spill, and the resume takes a new worker's start plus the copy; a
        cell frozen mid-way never moves. False:
        a parked lease waits for room on its own node, however long, and keeps
        everything a park in memory keeps. Default: True.
        ``c.PoolLeases.resume_moves = False``.""",
    ).tag(config=True)
