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
from gpupool.schema import isoformat
from gpupool.tables import gpu_utilization, holders_table, lease_table, pool_table
from gpupool.wire.leases import Lease
from gpupool.wire.transfer import GpuMemory

from .lifecycle import Lifecycle
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
        words, leases, utilization = self.view()
        if words:
            say(words)
            return
        text, html = lease_table(leases, utilization)
        held = self.holders_view()
        if held is not None:
            text, html = f"{text}\n\n{held[0]}", html + held[1]
        display({"text/plain": text, "text/html": html}, raw=True)

    def view(self) -> tuple[str | None, list, dict[str, float | None]]:
        """What ``%gpu status`` shows: ``(words, [], {})`` when there is no lease
        to list (parked, not attached), else ``(None, leases, utilization by GPU
        UUID)`` for :func:`~gpupool.tables.lease_table`. GPUPoolError when the
        service cannot be asked."""
        attachment = self.lifecycle.attachment
        client = self.service.client
        if attachment is None:
            leases = client.list_leases(kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"))
            if not leases:
                return "not attached; %gpu acquire 0.5 attaches half a GPU", [], {}
        else:
            leases = [as_seen_here(self.cell, attachment.refresh())]
        return None, leases, gpu_utilization(client.pool())

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
    """``lease`` with its worker idle since the last forwarded ``cell`` ended, when the service still
    says busy and no forwarded cell runs: the service hears of a cell's end with the agent's next
    heartbeat (up to ``c.GPUPool.node_heartbeat_interval`` later); this kernel knows it now."""
    worker = lease.worker or {}
    if cell is None or cell.running is not None or cell.ended_at is None or worker.get("execution_state") != "busy":
        return lease
    ended = datetime.fromtimestamp(cell.ended_at, timezone.utc)
    return replace(lease, worker={**worker, "execution_state": "idle"}, idle_since=isoformat(ended),
                   idle_deadline=None)
