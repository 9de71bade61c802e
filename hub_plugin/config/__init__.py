"""The pool service's settings, one class per concern (docs/code.md, "Settings"):
``c.GPUPool.*`` (store, URL, TLS, tokens), ``c.PoolNodes.*``, ``c.PoolLeases.*``,
``c.PoolPressure.*`` and ``c.PoolQuotas.*``; :class:`ServiceSettings` holds one
of each for the service.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from traitlets.config import Configurable

from .leases import PoolLeases
from .nodes import PoolNodes
from .pressure import PoolPressure
from .quotas import PoolQuotas
from .service import GPUPool


@dataclass(frozen=True)
class ServiceSettings:
    """One of each settings class, as the service reads them. :class:`..pool.Pool`
    and the handlers' context take it whole; each of the pool's parts is handed
    only the classes it reads. A part not given is that class with its defaults."""

    service: GPUPool = field(default_factory=GPUPool)
    nodes: PoolNodes = field(default_factory=PoolNodes)
    leases: PoolLeases = field(default_factory=PoolLeases)
    pressure: PoolPressure = field(default_factory=PoolPressure)
    quotas: PoolQuotas = field(default_factory=PoolQuotas)

    @classmethod
    def configured(cls, parent: Configurable) -> ServiceSettings:
        """Each part made with ``parent`` (the application), so it reads the
        parent's config; raises TraitError for a bad value."""
        return cls(GPUPool(parent=parent), PoolNodes(parent=parent), PoolLeases(parent=parent),
                   PoolPressure(parent=parent), PoolQuotas(parent=parent))


__all__ = ["GPUPool", "PoolLeases", "PoolNodes", "PoolPressure", "PoolQuotas",
           "ServiceSettings"]
