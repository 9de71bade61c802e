"""The ``local`` worker launcher (:class:`LocalLauncher`): every worker a
kernel process of the agent's host, in a cgroup of its own.

- :mod:`.launcher`: :class:`LocalLauncher`, cold and warm starts;
- :mod:`.template`: the per-interpreter worker templates (:mod:`gpupool.zygote`)
  that cold workers are forked from.

The host-process primitives other launchers share (:mod:`...process`,
:mod:`...stopping`) stay in :mod:`gpupool.provisioner.workers`.
"""

from .launcher import LocalLauncher

__all__ = ["LocalLauncher"]
