"""The pool service's settings: ``c.GPUPool.*``, one module per concern, each
a class that :class:`GPUPool` inherits (:data:`SETTINGS_PARTS`), so every
one stays ``c.GPUPool.NAME`` (docs/code.md, "Settings").
"""

from .leases import LeaseSettings
from .nodes import NodeAndWorkerSettings
from .pressure import PressureSettings
from .quotas import QuotaSettings
from .service import ServiceSettings


# Its settings (c.GPUPool.*) are those of the classes above, which it inherits.
class GPUPool(QuotaSettings):
    """Settings of the pool service (scheduler, reclaim, store, tokens)."""


#: The classes whose settings :class:`GPUPool` inherits: shown as ``c.GPUPool.*``, not on their own.
SETTINGS_PARTS = (ServiceSettings, NodeAndWorkerSettings, LeaseSettings, PressureSettings, QuotaSettings)

__all__ = ["GPUPool", "SETTINGS_PARTS", "LeaseSettings", "NodeAndWorkerSettings", "PressureSettings",
           "QuotaSettings", "ServiceSettings"]
