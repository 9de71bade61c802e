"""How a node confines workers to their slices: one contract, several modes,
picked by name, and the memory watchdog (docs/code.md, "Enforcement modes";
docs/enforcement.md).
"""

from .base import EnforcementMode, slice_environment
from .factory import ENTRY_POINT_GROUP, after_rediscovery, available, mode_class, register, resolve, unregister
from .modes import MIG, Exclusive, NoEnforcement, Timeslice
from .mps import MPS, MPSControl, mps_daemon_running
from .watchdog import MemoryWatchdog

__all__ = ["ENTRY_POINT_GROUP", "MIG", "MPS", "EnforcementMode", "Exclusive", "MPSControl", "MemoryWatchdog",
           "NoEnforcement", "Timeslice", "after_rediscovery", "available", "mode_class", "mps_daemon_running",
           "register", "resolve", "slice_environment", "unregister"]
