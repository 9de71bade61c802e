"""Lease cgroups: every process of a worker lives in one cgroup and dies with it.

A process can leave its process group and tree, not its cgroup, so the agent
makes a cgroup per worker under its own subtree (``c.NodeAgent.cgroup_root``),
puts the worker's first process in it before that runs anything, and kills
the whole cgroup when the lease ends, the worker dies or the agent stops. The
kinds (``c.NodeAgent.cgroup_mode``: ``v2``, ``v1``, ``none``) and what each
guarantees: docs/security.md, "Containment". Every call is a blocking file
write of microseconds except :meth:`~.contract.LeaseCgroup.kill`, which
waits for the processes to go: call it in a thread from the event loop.

The package: :mod:`.contract` (the two classes every kind implements, and
:class:`CgroupError`), :mod:`.mounts`, :mod:`.files`, one module per kind
(:mod:`.v2`, :mod:`.hybrid`, :mod:`.v1`, :mod:`.none`) and :mod:`.factory`
(:func:`containment`, which picks one).
"""

from .contract import CgroupError, Containment, LeaseCgroup
from .factory import MODES, containment

__all__ = ["MODES", "CgroupError", "Containment", "LeaseCgroup", "containment"]
