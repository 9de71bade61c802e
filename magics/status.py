"""What ``%gpu status``, ``%gpu pool`` and ``%gpu quota`` show, and the
status the JupyterLab extension's popup asks for (:class:`~.events.Requests`)."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import datetime, timezone
from html import escape as html_escape
from typing import TYPE_CHECKING

from IPython.display import display

from gpupool.errors import GPUPoolError
from gpupool.schema import isoformat, parse_time
from gpupool.tables import cell_freezing, gpu_utilization, holders_table, lease_table, pool_table
from gpupool.units import format_duration
from gpupool.wire.leases import Lease
from gpupool.wire.transfer import GpuMemory

from .lifecycle import Lifecycle
from .park import parked_now
from .quota import quota_report
from .service import Service
from .words import say

if TYPE_CHECKING:  # the gpupool kernel's, which imports IPython's kernel
    from .cell import ForwardedCell

#: How many names ``%gpu status`` lists as holding GPU memory (then "and N more, X GiB").
HOLDERS_SHOWN = 10
#: Seconds ``%gpu status`` waits for the worker's list of them (the worker's own walk stops after about one).
HOLDERS_TIMEOUT_S = 10.0


class Status:
    """Asks the ``service`` and the attachment ``lifecycle`` holds (read
    only); ``cell`` is the gpupool kernel's forwarded cell (None in any
    other IPython), which knows when the worker went idle before the service does."""

    def __init__(self, service: Service, lifecycle: Lifecycle, cell: ForwardedCell | None = None) -> None:
        self.service, self.lifecycle, self.cell = service, lifecycle, cell

    def show(self) -> None:
        """``%gpu status``: the lease as a table, and, attached to a running
        worker, the names holding GPU memory there (:meth:`holders_view`)::

            In [5]: %gpu status
            lease           state   node    ...  worker  idle deadline in / reason
            --------------  ------  ------  ...  ------  -------------------------
            L-94731d6f2463  active  node-1  ...  idle    30m

            holds GPU memory                                         size               on      type
            -------------------------------------------------------  -----------------  ------  ---------
            model                                                    1.2 GiB            cuda:0  Linear
            last traceback (OutOfMemoryError; frames of Cell In[4])  512.0 MiB          cuda:0  traceback
            batches                                                  64.0 MiB, and x's  cuda:0  list
            w                                                        in model           cuda:0  Parameter
            and 3 more, 12.0 MiB
        """
        words, leases, utilization, freezing, notes = self.view()
        if words:
            say(words)
            return
        text, html = lease_table(leases, utilization, freezing)
        if notes:
            text, html = "\n\n".join([text, *notes]), html + "".join(f"<p>{html_escape(n)}</p>" for n in notes)
        held = self.holders_view()
        if held is not None:
            text, html = f"{text}\n\n{held[0]}", html + held[1]
        display({"text/plain": text, "text/html": html}, raw=True)

    def view(self) -> tuple[str | None, list, dict[str, float | None], dict[str, bool], list[str]]:
        """What ``%gpu status`` shows: ``(words, [], {}, {}, [])`` when there is no
        lease to list (parked, not attached), else ``(None, leases, utilization
        by GPU UUID, freezing by node, notes)`` for :func:`~gpupool.tables.lease_table`
        (freezing: whether a node freezes a running cell, for a coming preemption's
        words), the notes (:func:`lost_node_note`) to show under it. GPUPoolError
        when the service cannot be asked."""
        attachment = self.lifecycle.attachment
        client = self.service.client
        if attachment is None:
            leases = client.list_leases(kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"))
            if not leases:
                return "not attached; %gpu acquire 0.5 attaches half a GPU", [], {}, {}, []
        else:
            leases = [as_seen_here(self.cell, attachment.refresh())]
        pool = client.pool()
        notes = [note for note in (lost_node_note(lease, pool) for lease in leases) if note]
        leases = [as_seen_by_pool(lease, pool) for lease in leases]
        return None, leases, gpu_utilization(pool), cell_freezing(pool), notes

    def holders_view(self) -> tuple[str, str] | None:
        """``(text, html)`` of the names holding GPU memory on the attached
        worker (:meth:`holders_answer`, :func:`~gpupool.tables.holders_table`), or
        one line saying why it did not say; None when no worker runs."""
        answer = self.holders_answer()
        if answer is None or isinstance(answer, str):
            return None if answer is None else (answer, f"<p>{html_escape(answer)}</p>")
        return holders_table(answer)

    def holders_answer(self) -> dict | str | None:
        """The attached worker's ``gpu_memory`` answer, or one line saying why it
        did not say (parked: asking would wake the frozen worker); None when no
        worker runs (not attached, or ended)."""
        attachment = self.lifecycle.attachment
        if attachment is None or attachment.ended is not None:
            return None
        if attachment.new_worker is not None:
            return (f"the lease resumed on a new worker on {attachment.new_worker.node}: the names holding GPU "
                    "memory are listed once the next cell has connected to it")
        if attachment.is_parked:  # asking would wake the frozen worker
            return "the worker is parked: the names holding GPU memory are listed once it runs again"
        if attachment.lock.locked():  # %gpu status in a cell on the worker: its comm answers after that cell
            return "the names holding GPU memory are listed by a %gpu status between cells (one runs on the worker now)"
        try:
            answer, _ = attachment.request(GpuMemory(top=HOLDERS_SHOWN), timeout=HOLDERS_TIMEOUT_S)
        except GPUPoolError as exc:
            return f"which names hold GPU memory: the worker did not say ({exc.message})"
        return answer

    def pool(self) -> None:
        """``%gpu pool``: the pool's nodes, GPUs and worker environments as a table."""
        text, html = pool_table(self.service.client.pool())
        display({"text/plain": text, "text/html": html}, raw=True)

    def quota(self) -> None:
        """``%gpu quota``: your limits beside today's and this week's usage."""
        print(quota_report(self.service.client))


def as_seen_here(cell: ForwardedCell | None, lease: Lease) -> Lease:
    """``lease`` with its worker as this kernel knows it: the service hears of a cell's start and
    end with the agent's next heartbeat (up to ``c.PoolNodes.node_heartbeat_interval`` later).
    Busy, with no idle countdown, while a forwarded ``cell`` runs (``%gpu status`` in a cell on the
    worker) and the service still says idle; idle since the last forwarded cell ended when the
    service still says busy and none runs."""
    worker = lease.worker or {}
    if cell is not None and cell.running is not None and worker.get("execution_state") == "idle":
        return replace(lease, worker={**worker, "execution_state": "busy"}, idle_since=None, idle_deadline=None)
    if cell is None or cell.running is not None or cell.ended_at is None or worker.get("execution_state") != "busy":
        return lease
    ended = datetime.fromtimestamp(cell.ended_at, timezone.utc)
    return replace(lease, worker={**worker, "execution_state": "idle"}, idle_since=isoformat(ended),
                   idle_deadline=None)


#: The worker column of a lease whose node is lost: what its agent last reported is stale.
LOST_WORKER = "unknown (node lost)"


def _lost_node(lease: Lease, pool: dict) -> dict | None:
    """``lease``'s node of ``GET /pool`` when the service says it is lost
    (there, or in the lease's ``node_state``), else None."""
    node = next((n for n in pool.get("nodes", []) if n.get("name") == lease.node), None)
    if lease.node is None or lease.state.ended or ((node or {}).get("state") or lease.node_state) != "lost":
        return None
    return node or {"name": lease.node}


def as_seen_by_pool(lease: Lease, pool: dict) -> Lease:
    """``lease`` with its worker's state unknown when the service says its node
    is lost: the agent's last report (``idle``) is stale, nobody knows now."""
    if _lost_node(lease, pool) is None or not lease.worker:
        return lease
    return replace(lease, worker={**lease.worker, "execution_state": LOST_WORKER})


def lost_node_note(lease: Lease, pool: dict, now: datetime | None = None) -> str | None:
    """Under ``%gpu status``: what the service says of ``lease``'s node when it
    is lost (``GET /pool``: ``state``, ``state_reason``, ``last_heartbeat_at``),
    since when, and what that means for the lease; None when it is not::

        node node-1 is lost: no heartbeat from its agent for 30s (last heard from 36s ago, at 06:41:02 UTC).
        Lease L-1's worker cannot be reached: the next cell will fail, and its variables are lost unless
        the node comes back; the pool reclaims the lease at its idle deadline, in 29m 24s. %gpu release
        --discard gives it up now.
    """
    node = _lost_node(lease, pool)
    if node is None:
        return None
    now = now or datetime.now(timezone.utc)
    heard = parse_time(node.get("last_heartbeat_at"))
    since = (f" (last heard from {format_duration(max(0.0, (now - heard).total_seconds()))} ago, at "
             f"{heard:%H:%M:%S} UTC)") if heard is not None else ""
    reason = node.get("state_reason") or "no heartbeat from its agent"
    if parked_now(lease):
        held = ("its variables are saved on that node's disk" if (lease.parked or {}).get("tier") == "disk" else
                "its frozen worker holds its variables there")
        then = (f"Lease {lease.id} is parked there ({held}): the next cell resumes it once the node's agent is back; "
                "if the node stays lost, the pool ends the lease and they are lost.")
    else:
        at = parse_time(lease.idle_deadline)
        deadline = "" if at is None else ("; the pool reclaims the lease at its idle deadline, in "
                                          f"{format_duration(max(0.0, (at - now).total_seconds()))}")
        then = (f"Lease {lease.id}'s worker cannot be reached: the next cell will fail, and its variables are lost "
                f"unless the node comes back{deadline}.")
    return f"node {node['name']} is lost: {reason}{since}. {then} %gpu release --discard gives it up now."
