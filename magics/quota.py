"""What ``%gpu quota`` prints. Pure text from the service's JSON.

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


def quota_report(client: ServiceClient) -> str:
    """``GET /quota`` as a table of limits beside usage."""
    return quota_text(client.quota())
