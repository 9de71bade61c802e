"""traitlets trait types that read human units from config files.

``c.PoolLeases.idle_timeout = "30m"`` and ``c.PoolNodes.context_overhead = "512MiB"``
are read here, the way JupyterHub's ``ByteSpecification`` reads memory
limits; the value stored is always seconds (float) or bytes (int).
"""

from __future__ import annotations

from typing import Any, Callable

from traitlets import TraitError, TraitType

from .units import parse_bytes, parse_duration


class _UnitTrait(TraitType):
    parse: Callable[[Any], Any]

    def validate(self, obj: Any, value: Any) -> Any:
        try:
            return type(self).parse(value)
        except ValueError as exc:
            raise TraitError(f"{type(obj).__name__}.{self.name}: {exc}") from None

    def from_string(self, s: str) -> Any:
        return type(self).parse(s)


class Duration(_UnitTrait):
    """Seconds (float > 0); accepts numbers or strings like ``"90s"``, ``"30m"``, ``"2h"``."""

    parse = staticmethod(parse_duration)
    default_value = 1.0
    info_text = "a duration in seconds or a string like '30m'"


class ByteSize(_UnitTrait):
    """Bytes (int >= 1); accepts numbers or strings like ``"512MiB"``, ``"20GiB"``."""

    parse = staticmethod(parse_bytes)
    default_value = 1
    info_text = "a size in bytes or a string like '20GiB'"
