"""``c.AgentInventory``: where the node's GPUs are read from (NVML or
simulated), how NVML is retried and timed, and what of the host is offered."""

from __future__ import annotations

from typing import Any

from traitlets import Float, TraitError, Unicode, validate
from traitlets.config import Configurable

from gpupool.traits import ByteSize, Duration

from .. import inventory
from .choices import auto_or_one_of


class AgentInventory(Configurable):
    """The node's GPUs and host as the agent reads and offers them."""

    simulate = Unicode(
        "", help="""Declare simulated GPUs instead of reading NVML, e.g. ``2xA100-80GB`` or
        ``1xH100-80GB,2xL4-24GB``. Empty (default): real GPUs through NVML.
        ``c.AgentInventory.simulate = "2xA100-80GB"``.""",
    ).tag(config=True)

    inventory_source = Unicode(
        "auto",
        help=f"""Where this node's GPUs are read from, one of auto,
        {", ".join(inventory.available())}: ``nvml`` (real GPUs, read by a helper
        process), ``simulated`` (the GPUs of ``simulate``), or an inventory of the
        ``gpupool.inventory`` entry point group. ``auto`` (default): ``simulated``
        when ``simulate`` is set, else ``nvml``.
        ``c.AgentInventory.inventory_source = "nvml"``.""",
    ).tag(config=True)

    @validate("inventory_source")
    def _inventory_source_valid(self, proposal: Any) -> str:
        return auto_or_one_of(proposal, inventory.available())

    nvml_retry_min = Duration(
        5.0, help="""Seconds before NVML is opened again after it failed to start (driver not
        loaded, driver/library version mismatch) or stopped answering; the node is ``degraded``
        meanwhile (its leases go on, nothing new is placed there), and the wait doubles after
        each failure up to ``nvml_retry_max``. Default: 5. ``c.AgentInventory.nvml_retry_min = 10``.""",
    ).tag(config=True)

    nvml_retry_max = Duration(
        300.0, help="""Longest wait between two attempts to open NVML again (see
        ``nvml_retry_min``). Default: 300 (5 minutes). ``c.AgentInventory.nvml_retry_max = "10m"``.""",
    ).tag(config=True)

    nvml_timeout = Duration(
        5.0, help="""Seconds one round of NVML readings (one heartbeat's) may take. NVML runs in
        a helper process; one that passes this (a call hung in the GPU driver) is killed, the
        node is ``degraded`` ("the GPU driver stopped answering"; its leases go on, nothing new
        is placed there) and a new helper starts on the ``nvml_retry_min``/``nvml_retry_max``
        schedule. Starting NVML in a helper may take 6 times this. Keep it well under the
        service's ``node_ttl``. Default: 5. ``c.AgentInventory.nvml_timeout = 10``.""",
    ).tag(config=True)

    @validate("nvml_timeout")
    def _nvml_timeout_valid(self, proposal: Any) -> float:
        if proposal["value"] <= 0:
            raise TraitError(f"c.AgentInventory.nvml_timeout must be positive, got {proposal['value']}")
        return proposal["value"]

    host_cpus = Float(
        None, allow_none=True,
        help="""Host cores this node offers to leases (``%gpu acquire --cpus``, and the
        default share), reported at registration. Default: None, psutil's count of
        logical CPUs. ``c.AgentInventory.host_cpus = 48`` (keep some for the system).""",
    ).tag(config=True)

    host_memory = ByteSize(
        None, allow_none=True,
        help="""Host RAM this node offers to leases (``--host-memory``), reported at
        registration. Default: None, psutil's total. ``c.AgentInventory.host_memory = "384GiB"``.""",
    ).tag(config=True)

    host_proc = Unicode(
        "", help="""Where the host's /proc is mounted when the agent runs in a container
        without the host PID namespace (NVML reports host PIDs; this maps them
        to the agent's). Empty (default): the agent runs in the host PID
        namespace. ``c.AgentInventory.host_proc = "/host/proc"``.""",
    ).tag(config=True)
