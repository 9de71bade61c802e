"""Lease cgroups: every process of a worker lives in one cgroup and dies with it.

A double fork with ``setsid`` leaves a process group and its parent's tree,
but not its cgroup: an unprivileged process cannot move itself out (that
needs write access to the ``cgroup.procs`` of a common ancestor, which the
agent's subtree does not give). So the agent makes a cgroup per worker under
its own subtree, puts the worker's first process in it before that process
runs anything (:mod:`..workers`, "the start gate"), and kills the whole
cgroup when the lease ends, when the worker dies and when the agent stops.

Three kinds, chosen by ``c.NodeAgent.cgroup_mode`` (:func:`containment`):

- ``v2``: the unified hierarchy (its mount found in ``/proc/mounts``);
  ``cgroup.kill`` kills the subtree at once; where the kernel has none
  (before 5.14) ``cgroup.freeze``, SIGKILL to each process, thaw, repeated.
  Host CPU and memory limits go to the v1 ``cpu``/``memory`` hierarchies
  where v2 lacks those controllers (:mod:`.hybrid`).
- ``v1``: the ``freezer`` hierarchy (required: it is what makes the kill
  race-free), and ``memory``, ``pids`` and ``cpu`` where mounted (for
  limits): freeze, SIGKILL every task, thaw.
- ``none``: no cgroup. A loud warning, once per agent; kills reach the
  worker's process group and the descendants seen at kill time, which a
  double-forked daemon escapes (docs/security.md, "Containment").

The agent's subtree (``c.NodeAgent.cgroup_root``): by default
``gpupool/agent-<12 hex digits of the state dir>`` under the agent's own
cgroup (``/proc/self/cgroup``), which is the subtree systemd delegates to a
unit with ``Delegate=yes``. The state-dir part keeps two agents on one host
(tests, or a second agent for another GPU set) out of each other's way: a
restarted agent kills every cgroup of its subtree that it does not re-adopt.

All calls are blocking file writes of a few microseconds, except
:meth:`~.contract.LeaseCgroup.kill`, which waits (up to its ``timeout``) until the
processes are gone: call that one in a thread from the event loop.

The package: :mod:`.contract` (the two classes every kind implements, and
:class:`CgroupError`), :mod:`.mounts` (where the hierarchies and the
agent's subtree are), :mod:`.files` (the file operations the kinds share),
one module per kind (:mod:`.v2`, :mod:`.hybrid`, :mod:`.v1`, :mod:`.none`)
and :mod:`.factory` (:func:`containment`, which picks one).
"""

from .contract import CgroupError, Containment, LeaseCgroup
from .factory import MODES, containment

__all__ = ["MODES", "CgroupError", "Containment", "LeaseCgroup", "containment"]
