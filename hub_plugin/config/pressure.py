"""Settings of the plan while requests wait: early parks, preemption, batch (``c.PoolPressure.*``)."""

from __future__ import annotations

from traitlets import Bool, Enum, Integer, Union
from traitlets.config import Configurable

from gpupool.traits import Duration


class PoolPressure(Configurable):
    """What the service does while requests wait: parking idle leases early,
    preemption, batch placement, clearing a node for a whole-node ask
    (the plan of :mod:`..rules.priority`)."""

    pressure_grace = Duration(
        120.0,
        help="""Seconds an idle over-quota lease may stay idle while requests wait in
        the queue before it is parked early (instead of after its idle timeout):
        batch leases first, then the longest idle, until what they free covers
        the queue; a lease within its owner's ``guaranteed_gpus`` is never parked
        early, a lease whose cell runs never (docs/api.md, "Pressure"). Counted
        from when it went idle or when the oldest waiting request was asked,
        whichever is later. Default: 2 minutes. ``c.PoolPressure.pressure_grace = "5m"``.""",
    ).tag(config=True)

    allow_preemption = Bool(
        True,
        help="""Whether leases may opt in to preemption (``%gpu acquire --preemptible``):
        under pressure such a lease is parked (after a notice of ``preemption_notice``)
        with its running cell frozen where it is, and resumed later with everything
        kept (the cell is interrupted instead where the node's checkpointer cannot
        freeze it mid-cell). False refuses ``preemptible``
        requests with 400 naming this setting. Default: True.
        ``c.PoolPressure.allow_preemption = False``.""",
    ).tag(config=True)

    preemption_notice = Duration(
        30.0,
        help="""Seconds a preemptible lease is told ahead before it is parked with its
        running cell frozen (on top of ``pressure_grace``, counted from when the oldest
        waiting request was asked; the notebook gives at least this much after it
        first hears of it). Default: 30 seconds. ``c.PoolPressure.preemption_notice = "2m"``.""",
    ).tag(config=True)

    preemption_grace = Union(
        [Duration(), Enum([0])], default_value=None, allow_none=True,
        help="""Seconds from when the oldest waiting interactive request was asked until
        a preemptible lease's running cell is told it will be preempted (it is then
        interrupted ``preemption_notice`` later). ``None`` means ``pressure_grace``; 0
        tells it at once, so the notice alone is its warning and a waiting person gets
        the GPU within a sweep or two. Default: None (``pressure_grace``).
        ``c.PoolPressure.preemption_grace = 0``.""",
    ).tag(config=True)

    batch_first = Bool(
        False,
        help="""Under pressure, take batch leases before interactive ones whatever their
        state: a running preemptible batch lease is preempted before a person's idle
        notebook is parked early. False keeps the order idle leases first (batch, then
        the longest idle), then running preemptible ones. Default: False.
        ``c.PoolPressure.batch_first = True``.""",
    ).tag(config=True)

    batch_yields = Bool(
        False,
        help="""Place no batch request (new or queued) while an interactive request waits:
        what frees up, or what pressure frees, goes to the person, not to backfill. A new
        batch request is then queued (with ``wait``) or refused (409 ``pool_full``). False:
        batch fills whatever interactive requests cannot use. Default: False.
        ``c.PoolPressure.batch_yields = True``.""",
    ).tag(config=True)

    batch_headroom_nodes = Integer(
        0, min=0,
        help="""Nodes kept idle for interactive requests for whole nodes: a batch request is
        not placed on a node with nothing allocated while only this many (or fewer) nodes
        have nothing allocated. Default: 0 (none kept). ``c.PoolPressure.batch_headroom_nodes = 1``.""",
    ).tag(config=True)

    pressure_clears_nodes = Bool(
        True,
        help="""For a waiting interactive request for several whole GPUs (``%gpu acquire 8``),
        pressure clears one node that can hold it: of the nodes where wholly free GPUs (and what
        is on its way back) plus the GPUs that what pressure may take (idle leases, and running
        preemptible ones) frees whole cover the ask, the one where no person's idle notebook is
        parked, then the one stopping the fewest running GPUs; it stays the one cleared for that
        request while it can still be. No batch request or resume is placed there while the
        request waits; a request no node can be cleared for presses on nothing. False counts what waits in GPUs pool-wide, which may free a GPU on each
        of several nodes and none that fits, and which backfill then takes again, round after
        round. Default: True. ``c.PoolPressure.pressure_clears_nodes = False``.""",
    ).tag(config=True)

    pressure_clear_grace = Union(
        [Duration(), Enum([0])], default_value=None, allow_none=True,
        help="""With ``pressure_clears_nodes``: seconds after a waiting interactive request for
        several whole GPUs was asked at which an idle lease on the node cleared for it is parked
        (when the lease goes idle later: as soon as it does), instead of ``pressure_grace``. A
        person asking for a whole node then waits seconds, not minutes, for a notebook idle on
        it; a lease whose cell runs is still never touched. ``None`` means ``pressure_grace``.
        Default: None. ``c.PoolPressure.pressure_clear_grace = 5``.""",
    ).tag(config=True)
