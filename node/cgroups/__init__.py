"""Lease cgroups: every process of a worker lives in one cgroup and dies with
it. One contract, one module per kind (``v2``, ``v1``, ``none``), and
:func:`containment`, which picks one (docs/code.md, "Lease cgroups").
"""

from .contract import CgroupError, Containment, LeaseCgroup
from .factory import MODES, containment

__all__ = ["MODES", "CgroupError", "Containment", "LeaseCgroup", "containment"]
