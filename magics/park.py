"""The notebook's part of park in place (docs/parking.md, "The notebook's part").

The service parks a lease: at its ``idle_deadline`` (after ``idle_timeout``
without a running cell, earlier under pressure, which ``pressure`` says), at
a preemptible lease's ``preempt_at``, or when asked (``%gpu park``). The
agent freezes the worker where it is, its GPU memory moved to the node's
host RAM, and its GPU share goes back to the pool. This kernel keeps its
connection to the frozen worker: the heartbeat sees the lease ``parking`` or
``parked`` (:func:`parked_now`), pauses the worker's liveness checks (a
frozen kernel answers no ping) and says so once; the next cell, or a cell
in flight that a park froze, asks the service to resume it
(:meth:`gpupool.magics.attachment.Attachment.resume`) and runs on the same
worker, its variables, open files and CUDA state as they were.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from gpupool.schema import LeaseState
from gpupool.units import format_bytes
from gpupool.wire.leases import Lease

#: The states in which the worker is frozen (or being frozen) on its node.
PARKED_STATES = (LeaseState.parking, LeaseState.parked)


@dataclass
class Parked:
    """A lease this kernel saw parked: the lease as last seen, whether its
    notice was given (``noticed``) and whether a cell here said it
    (``told``), whether this kernel's own resume waits for it (``resuming``:
    that says its line), whether a resume was asked (``asked_at``: when;
    and when asking last failed), and ``new_worker``: the lease as seen active
    again on a new worker (spilled, or moved to another node) that this kernel
    has not connected to yet (the next cell does, :meth:`~.attachment.Attachment.resume`),
    and whether the heartbeat said the resume already (``said_resumed``: the next cell does not again)."""

    lease: Lease
    new_worker: Lease | None = None
    noticed: bool = False
    told: bool = False
    resuming: bool = False
    resume_asked: bool = False
    failed_at: float = float("-inf")  # monotonic time an ask to resume last failed
    asked_at: float = float("-inf")  # monotonic time the resume was asked (ask_resume)
    said_resumed: bool = False  # the heartbeat said its resume (a resume this kernel did not wait for in full)
    lost_said: tuple[str, ...] = ()  # what the park could not keep that its notice said

    def not_kept(self, *seen: Lease) -> str:
        """What the park could not keep, as the service says it on this lease and on ``seen``
        (later looks at it), less what its notice said already (a notice given while it was
        ``parking``, or none: a cell interrupted by a preemption that spilled it to disk):
        ``"; not kept by the park: the running cell was interrupted"``, or ""."""
        items: list[str] = []
        for lease in (self.lease, *seen):
            items += [item for item in (lease.parked or {}).get("lost") or [] if item not in items]
        unsaid = [item for item in items if item not in self.lost_said]
        return f"; not kept by the park: {'; '.join(unsaid)}" if unsaid else ""


def parked_now(lease: Lease) -> bool:
    """Whether ``lease`` is ``parking`` or ``parked``."""
    return lease.state in PARKED_STATES


def resume_seconds(lease: Lease) -> float | None:
    """Seconds the last resume of the now ``active`` ``lease`` took at the service: from its
    placement (the ``starting`` event: in place, or a move's) to the ``active`` one after it, as
    its events say; None when they do not. What the notebook says of a resume it did not wait for
    from its start (a cell interrupted while the resume waited for room, or moved): its own clock
    would count the wait in line, or only the moment the next cell asked."""
    active = placed = None
    for event in reversed(lease.events or []):
        if active is None:
            if event.get("state") == LeaseState.active.value:
                active = event.get("at")
        elif event.get("state") == LeaseState.starting.value:
            placed = event.get("at")
            break
    if active is None or placed is None:
        return None
    try:
        seconds = (datetime.fromisoformat(active) - datetime.fromisoformat(placed)).total_seconds()
    except (TypeError, ValueError):
        return None
    return max(0.0, seconds)


def parked_words(lease: Lease, running: bool) -> str:
    """The notice that ``lease`` was parked: why, where its state waits
    (frozen in host memory, or spilled to disk with its worker ended), and
    what happens to the cell (``running``: one is in flight)."""
    park = lease.parked or {}
    why = park.get("reason") or lease.reason or "parked"
    lost = f"; not kept: {'; '.join(park['lost'])}" if park.get("lost") else ""
    node = lease.node or "its node"
    # The service's words: "idle for 30m (...)", "parked early: ...", "preempted: ...", "parked by its owner".
    was = f"was {why}" if why.startswith(("parked ", "preempted")) else f"was parked, {why}"
    if park.get("tier") == "disk":
        size = f" ({format_bytes(park['disk_bytes'])})" if park.get("disk_bytes") else ""
        return (f"lease {lease.id} {was}: its variables were saved to disk on {node}{size} and its worker ended; "
                f"its GPU is back in the pool; the next cell loads them into a new worker{lost}")
    held = f" ({format_bytes(park['host_bytes'])})" if park.get("host_bytes") else ""
    then = ("the running cell waits and goes on when the pool resumes it" if running else
            "the next cell resumes it where it was")
    return (f"lease {lease.id} {was}: its worker is frozen on {node} with its variables in host memory{held} "
            f"and its GPU is back in the pool; {then}{lost}")


def interrupted_words(lease: Lease) -> str:
    """What a forwarded cell says when a park of ``lease`` (``parked`` now) interrupted it: the
    node's agent stopping (a disk park whose node is lost: ``c.AgentParking.park_on_stop`` saved the
    worker first; the service's reason says so) or a park that could not freeze the running cell;
    what the park kept, and that the next cell goes on with the variables. What else the park could
    not keep follows, not the interrupt itself, which these words say::

        this cell was interrupted: the node agent on node-1 was stopped (a restart or an upgrade, say)
        and saved lease L-1 to that node's disk first (1.2 KiB); the next cell resumes it once the agent
        is back, with its variables
    """
    park = lease.parked or {}
    others = [item for item in park.get("lost") or [] if "running cell" not in item]
    if park.get("tier") == "disk" and lease.node_state == "lost":
        node = lease.node or "its node"
        size = f" ({format_bytes(park['disk_bytes'])})" if park.get("disk_bytes") else ""
        lost = f"; not kept: {'; '.join(others)}" if others else ""
        return (f"this cell was interrupted: the node agent on {node} was stopped (a restart or an upgrade, say) "
                f"and saved lease {lease.id} to that node's disk first{size}; the next cell resumes it once the "
                f"agent is back, with its variables{lost}")
    return "this cell was interrupted: " + parked_words(replace(lease, parked={**park, "lost": others}), False)
