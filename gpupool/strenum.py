"""``enum.StrEnum`` (Python 3.11) where the interpreter has it, else its
equivalent for 3.10 (``requires-python``; worker environments may run one):
members are ``str``, and ``str()`` and ``format()`` give the value."""

from __future__ import annotations

try:
    from enum import StrEnum
except ImportError:  # Python 3.10
    from enum import Enum

    class StrEnum(str, Enum):  # type: ignore[no-redef]
        """Members are strings; their text is their value (as 3.11's StrEnum)."""

        __str__ = str.__str__
        __format__ = str.__format__

__all__ = ["StrEnum"]
