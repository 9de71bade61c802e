"""The pool service's settings: ``c.GPUPool.*`` in ``gpupool_config.py`` or
``jupyterhub_config.py``.

Each setting is a trait whose help gives the unit, the default and an
example. Durations and sizes accept human units (``"30m"``, ``"512MiB"``)
through :mod:`gpupool.traits`; the value stored is seconds or bytes.

The settings are grouped by concern into the classes :class:`GPUPool`
inherits, one from the other (:data:`SETTINGS_PARTS`), a module each, so every one stays
``c.GPUPool.NAME``; ``ServiceApp`` shows them all under ``GPUPool`` in
``--generate-config`` and ``--help-all``.
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
