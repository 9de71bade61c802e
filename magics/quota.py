"""What ``%gpu quota`` prints, and the progress line of a request that waits
in the queue (``%gpu acquire 0.5 --wait 10m``). Pure text from the service's JSON.

    In [1]: %gpu quota
    user ann (groups: quants); days and weeks in UTC
                           used  limit
    ---------------------  ----  ------------------
    GPUs held (or queued)  0.50  2.00 GPU
    one lease                    unlimited
    GPU-hours today        1.25  8.0 GPU-hours
    GPU-hours this week    6.00  unlimited
    idle timeout                 2h
"""

from __future__ import annotations

from gpupool.api import ServiceClient
from gpupool.quota_cli import quota_text
from gpupool.schema import LeaseState
from gpupool.wire.leases import Lease
from gpupool.units import format_duration


def quota_report(client: ServiceClient) -> str:
    """``GET /quota`` as a table of limits beside usage."""
    return quota_text(client.quota())


def progress_words(lease: Lease) -> str:
    """``'queued: 2nd in line, about 5m'``, ``'queued (batch): 1st in line'``, ``'starting on node-1'``."""
    if lease.state is LeaseState.queued:
        text = "queued" if lease.lease_class == "interactive" else f"queued ({lease.lease_class})"
        if lease.queue_position:
            text += f": {_ordinal(lease.queue_position)} in line"
            if lease.queue_estimate_s is not None:
                text += f", about {format_duration(lease.queue_estimate_s)}"
        return text
    return f"{lease.state.value} on {lease.node or 'the pool'}"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
