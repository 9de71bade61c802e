"""What parking in place costs a replay (:mod:`.notebooks`): seconds to park
and resume, a session's parked state in bytes, a node's parked-memory budget.

Pure: bytes in, seconds out. Sizes in bytes, rates in bytes per second.

Where the figures come from:

- Warm park and resume (frozen in its node's RAM): a fixed cost plus the GPU
  state over pinned host<->device bandwidth. The fixed costs are
  ``bench/park_bench.py``'s at 1 MiB (``bench/park_results.json``, p50: warm
  park 10 ms, warm resume 4 ms: freeze or thaw plus the agent's HTTP round).
  The bandwidth is a real GPU's, not that bench's (its ``simulated``
  checkpointer copies tmpfs to tmpfs, 0.55-0.63 GiB/s at 1 GiB on two busy
  cores): pinned host<->device copies run at 20+ GB/s on PCIe 4 x16
  (A100; ``make gpu-check`` measures it), and ``cuda-checkpoint`` moves
  the state at that speed; the service's own estimate
  (:data:`gpupool.hub_plugin.rules.resume.HOST_TO_GPU_BYTES_S`, 10 GB/s) is
  the rate taken here, half of the link's, as a margin.
- Spilled resume (the worker's namespace on its node's local disk): a new
  worker starts (the service's :data:`~gpupool.hub_plugin.rules.resume.COLD_START_S`,
  3 s) and loads it from disk at the service's
  :data:`~gpupool.hub_plugin.rules.resume.DISK_BYTES_S` (1 GB/s: a datacentre
  NVMe reads 2-7 GB/s sequentially; a pickle load is slower than the
  device). A spill itself runs in the background on the node and costs
  the user nothing until a resume.
- Move (the state goes to another node, :func:`move_seconds`): a new
  worker there, cold start, plus the bytes: from a worker parked in memory,
  worker to worker at :data:`NETWORK_BYTES_S` (a 25 Gbit/s node NIC, about
  3 GB/s at line rate; the data plane's own transfers, bench/transfer.json,
  reach less on this host's loopback); from a spill, through the disk as
  well, at the slower of the two.
- A session's parked state (:func:`state_bytes`): no trace records GPU
  memory per notebook (sensei has GPU counts, openb GPU fractions), so it
  is an assumption, stated in bench/REPORT.md: the slice's memory share
  (fraction x the GPU's memory x GPUs) times a fill drawn per session,
  uniform in [:data:`FILL_LOW`, 1].
- A node's budget (:func:`parked_budget`): ``c.AgentParking.parked_memory``'s
  default, a quarter of the host's RAM (``node/settings/parking.py:
  AgentParking.budget``), of :data:`NODE_HOST_BYTES` (2 TiB: the host RAM of a
  DGX A100 640 GB, the 8 x A100 80 GB nodes the replays simulate).
"""

from __future__ import annotations

from ..rules.resume import COLD_START_S, DISK_BYTES_S, HOST_TO_GPU_BYTES_S

#: Fixed seconds of a warm park and a warm resume (bench/park_results.json, 1 MiB, p50).
WARM_PARK_S = 0.010
WARM_RESUME_S = 0.004
#: Bytes per second between a node and another (25 Gbit/s NIC).
NETWORK_BYTES_S = 25e9 / 8
#: Host RAM of a simulated node, bytes, and the share of it ``c.AgentParking.parked_memory`` defaults to.
NODE_HOST_BYTES = 2 * 2**40
PARKED_SHARE = 0.25
#: Lowest fill of its slice's memory a session's parked state has.
FILL_LOW = 0.1


def warm_park_seconds(size: int, gpus: int = 1) -> float:
    """Seconds to freeze a worker and move ``size`` bytes of GPU state, spread
    over ``gpus`` GPUs (each copies over its own link), to its node's RAM."""
    return WARM_PARK_S + size / (HOST_TO_GPU_BYTES_S * gpus)


def warm_resume_seconds(size: int, gpus: int = 1) -> float:
    """Seconds to put ``size`` bytes back on ``gpus`` GPUs and thaw the worker."""
    return WARM_RESUME_S + size / (HOST_TO_GPU_BYTES_S * gpus)


def spilled_resume_seconds(size: int) -> float:
    """Seconds to start a new worker and load a ``size``-byte namespace from its node's disk."""
    return COLD_START_S + size / DISK_BYTES_S


def move_seconds(size: int, spilled: bool) -> float:
    """Seconds to bring a ``size``-byte state to a new worker on another node: worker to worker
    over the network, or, ``spilled``, from the old node's disk (network and disk)."""
    return COLD_START_S + size / (min(NETWORK_BYTES_S, DISK_BYTES_S) if spilled else NETWORK_BYTES_S)


def resume_seconds(tier: str, size: int, gpus: int = 1, spilled: bool = False) -> float:
    """A resume's seconds from ``tier`` (``memory``, ``disk`` or ``moved``; a move of a
    ``spilled`` state, or of one in memory) onto ``gpus`` GPUs."""
    if tier == "memory":
        return warm_resume_seconds(size, gpus)
    if tier == "disk":
        return spilled_resume_seconds(size)
    return move_seconds(size, spilled)


def state_bytes(milli: int, gpus: int, gpu_memory: int, fill: float) -> int:
    """A session's parked GPU state: ``fill`` of its slice's memory (``milli``
    thousandths of ``gpu_memory`` bytes per GPU, on ``gpus`` GPUs)."""
    return int(fill * milli / 1000 * gpu_memory * gpus)


def parked_budget(host_bytes: int = NODE_HOST_BYTES) -> int:
    """Bytes a node's parked workers may hold in its RAM (``c.AgentParking.parked_memory``'s default)."""
    return int(host_bytes * PARKED_SHARE)
