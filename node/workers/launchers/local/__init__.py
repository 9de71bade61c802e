"""The ``local`` worker launcher (:class:`LocalLauncher`): every worker a
kernel process of the agent's host, in a cgroup of its own (docs/code.md,
"Launchers").
"""

from .launcher import LocalLauncher

__all__ = ["LocalLauncher"]
