"""The ``local`` worker launcher (:class:`LocalLauncher`): every worker a
kernel process of the agent's host, in a cgroup of its own.

- :mod:`.launcher`: :class:`LocalLauncher`: cold and warm starts, and after
  an agent restart its ``adopt`` and ``sweep``;
- :mod:`.template`: the per-interpreter worker templates (:mod:`gpupool.zygote`)
  that cold workers are forked from;
- :mod:`.gate`: the start gate a booted (not forked) worker joins its cgroup
  behind;
- :mod:`.adoption`: a record's host process in its cgroup, and the stray
  cgroups a sweep kills.

The host-process primitives the Slurm launcher shares (:mod:`...process`,
:func:`...records.stray_workers`, :mod:`...stopping`) stay in
:mod:`gpupool.provisioner.workers`.
"""

from .launcher import LocalLauncher

__all__ = ["LocalLauncher"]
