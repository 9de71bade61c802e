"""What the notebook kernel, the agent and a worker kernel agree on: which
application ``python -m`` runs and the extension a worker loads (pure; no
ipykernel import, so that a Jupyter server or an agent can use it). What the
two kernels say beside the Jupyter protocol is :mod:`gpupool.wire`'s
(:mod:`~gpupool.wire.transfer`, :mod:`~gpupool.wire.magic`)."""

from __future__ import annotations

#: The gpupool kernel's application (:mod:`gpupool.magics.kernelapp`).
NOTEBOOK_KERNEL_APP = "gpupool.magics.kernelapp"
#: A worker's application (:mod:`gpupool.kernelapp`: a plain IPython kernel, no subshells).
WORKER_KERNEL_APP = "gpupool.kernelapp"
#: The IPython extension every worker loads (:mod:`gpupool.node.worker_extension`).
WORKER_EXTENSION = "gpupool.node.worker_extension"


def with_launcher(cmd: list[str], module: str) -> list[str] | None:
    """``cmd`` with ``-m ipykernel_launcher`` (or ``-m ipykernel``) replaced
    by ``-m module``; None when ``cmd`` launches ipykernel some other way (pure)."""
    for i, arg in enumerate(cmd[:-1]):
        if arg == "-m" and cmd[i + 1] in ("ipykernel_launcher", "ipykernel"):
            return [*cmd[:i + 1], module, *cmd[i + 2:]]
    return None
