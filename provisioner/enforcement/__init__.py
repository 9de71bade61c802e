"""How a node confines workers to their slices: one contract, several modes.

- :mod:`.base`: :class:`EnforcementMode`, what each mode decides (name,
  capacity rule, worker environment, refusals, node setup, memory watchdog),
  and :func:`slice_environment`, the variables every mode gives a worker;
- :mod:`.modes` (``timeslice``, ``exclusive``, ``mig``, ``none``) and
  :mod:`.mps` (``mps``, with :class:`MPSControl`, the control daemon);
- :mod:`.factory`: modes by name (built in, :func:`register` / :func:`unregister`, or the
  ``gpupool.enforcement`` entry point group) and :func:`resolve`, the node's
  mode from what it asked (``auto`` included);
- :mod:`.watchdog`: :class:`MemoryWatchdog`, the agent's GPU memory check.

docs/enforcement.md says what each mode guarantees and how to add one.
"""

from .base import EnforcementMode, slice_environment
from .factory import ENTRY_POINT_GROUP, after_rediscovery, available, mode_class, register, resolve, unregister
from .modes import MIG, Exclusive, NoEnforcement, Timeslice
from .mps import MPS, MPSControl, mps_daemon_running
from .watchdog import MemoryWatchdog

__all__ = ["ENTRY_POINT_GROUP", "MIG", "MPS", "EnforcementMode", "Exclusive", "MPSControl", "MemoryWatchdog",
           "NoEnforcement", "Timeslice", "after_rediscovery", "available", "mode_class", "mps_daemon_running",
           "register", "resolve", "slice_environment", "unregister"]
