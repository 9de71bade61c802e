"""Human units at the edges: sizes, durations, GPU amounts.

On the wire everything is plain numbers (bytes, seconds, fractions); these
parsers are the one place where ``20GiB``, ``30m`` or ``0.5`` written by a
person are turned into numbers, and where numbers are turned back into words.
"""

from __future__ import annotations

import math
import re

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "p": 1000**5, "pb": 1000**5,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2,
    "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4, "pi": 1024**5, "pib": 1024**5,
}
_DURATION_UNITS = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
# A sign is read so that a negative value is told it is out of range, not unreadable.
_NUMBER_UNIT = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def _number_with_unit(text: str | int | float, units: dict[str, int], what: str, example: str) -> float:
    """``text`` read as a number times one of ``units`` (a bare number has unit 1)."""
    if isinstance(text, bool):
        raise ValueError(f"{what} must be a number or a string like {example}, not {text!r}")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _NUMBER_UNIT.match(str(text))
        if not match or match.group(2).lower() not in units:
            raise ValueError(f"cannot read {text!r} as a {what}; write it like {example}")
        value, unit = float(match.group(1)), match.group(2).lower()
    return value * units[unit]


def parse_bytes(text: str | int | float) -> int:
    """Parse a memory size such as ``20GiB``, ``512MB`` or ``1073741824``.

    Binary suffixes (KiB, MiB, GiB, TiB, PiB, also ``Gi``) are powers of 1024,
    decimal ones (KB, MB, GB, TB, PB, also ``G``) powers of 1000, as in
    Kubernetes quantities. Returns whole bytes (> 0).

    Raises ValueError with a message naming the accepted forms.
    """
    size = _number_with_unit(text, _BYTE_UNITS, "memory size", "'20GiB', '512MiB' or '16GB'")
    if not math.isfinite(size) or size < 1:
        raise ValueError(f"memory size must be at least 1 byte, got {text!r}")
    return int(size)


def parse_duration(text: str | int | float, allow_zero: bool = False) -> float:
    """Parse a duration such as ``30m``, ``90s``, ``1.5h``, ``2d`` or ``45``.

    A bare number is seconds. Returns seconds (> 0, finite; or 0 when
    ``allow_zero``, for a ``--wait 0`` that means "do not wait").

    Raises ValueError naming the accepted forms.
    """
    seconds = _number_with_unit(text, _DURATION_UNITS, "duration", "'90s', '30m', '2h' or '1d'")
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise ValueError(f"duration must be more than 0 seconds, got {text!r}")
    return seconds


def parse_gpu_amount(text: str | int | float) -> tuple[float, int]:
    """Parse how much GPU a request asks for.

    Returns ``(fraction, count)``: a fraction in (0, 1] of one GPU with count 1,
    or ``(1.0, N)`` for N whole GPUs on one node (N >= 1 integer).
    ``0.5`` -> (0.5, 1); ``1`` -> (1.0, 1); ``2`` -> (1.0, 2).

    Raises ValueError for zero, negatives, non-numbers and amounts above 1
    that are not whole (``1.5``: ask for 1 or 2).
    """
    if isinstance(text, bool):
        raise ValueError(f"GPU amount must be a number, not {text!r}")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"cannot read {text!r} as a GPU amount; write a fraction like 0.5 or a whole count like 2") from None
    if not math.isfinite(value):
        raise ValueError(f"GPU amount must be a finite number, got {text!r}")
    if value <= 0:
        raise ValueError(f"GPU amount must be more than 0, got {text!r}")
    if value <= 1:
        return value, 1
    if value != int(value):
        raise ValueError(f"GPU amount {text!r} is above 1 but not whole: ask for a fraction of one GPU (<= 1) or whole GPUs (2, 3, ...)")
    return 1.0, int(value)


def format_bytes(size: int | float | None) -> str:
    """``85899345920`` -> ``'80.0 GiB'``; None -> ``'unknown'``."""
    if size is None:
        return "unknown"
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(size) >= factor:
            return f"{size / factor:.1f} {unit}"
    return f"{int(size)} B"


def format_share(fraction: float, gpu_count: int = 1, *, noun: bool = False, whole: bool = False) -> str:
    """A share of the pool in words: ``fraction`` of one GPU as ``'0.50'``, with more
    digits where two would hide what was asked (``'0.50001'``; ``noun``: ``'0.50 of a
    GPU'``), or, when ``gpu_count`` is above 1, ``'2 GPUs'`` (``whole``: ``'2 whole
    GPUs'``, where a slice could be meant)."""
    if gpu_count > 1:
        return f"{gpu_count} {'whole ' if whole else ''}GPUs"
    digits = f"{fraction:.2f}" if abs(fraction - round(fraction, 2)) < 1e-9 else f"{fraction:.6g}"
    return f"{digits}{' of a GPU' if noun else ''}"


def format_cpus(cpus: float) -> str:
    """``4`` -> ``'4 CPUs'``; ``1`` -> ``'1 CPU'``; ``0.5`` -> ``'0.5 CPU'`` (cores; fractions are CPU time)."""
    return f"{cpus:g} CPU{'s' if cpus > 1 else ''}"


def format_gpu_hours(hours: float, decimals: int = 1) -> str:
    """A number of GPU-hours (no unit): ``8`` -> ``'8.0'``, ``12.345`` -> ``'12.3'``;
    an amount that ``decimals`` places would round away (below 10) with three
    significant digits: ``0.001`` -> ``'0.001'`` (not ``'0.0'``), ``0.25`` -> ``'0.25'``."""
    fixed = f"{hours:.{decimals}f}"
    if hours == 0 or abs(hours) >= 10 or abs(hours - round(hours, decimals)) < 1e-9:
        return fixed
    digits = max(decimals, 2 - math.floor(math.log10(abs(hours))))  # three significant digits
    text = f"{hours:.{digits}f}".rstrip("0")
    return fixed if text.endswith(".") else text  # 9.9996: '10.0'


def format_durations_alike(*seconds: float) -> tuple[str, ...]:
    """Durations in one unit, the largest that reads each as a whole number, so
    that they compare at a glance: ``(356400, 86400)`` -> ``('99h', '24h')``
    (:func:`format_duration` says ``4d 3h`` and ``1d``); ``(172800, 86400)`` ->
    ``('2d', '1d')``; each as :func:`format_duration` says it where no unit fits
    (fractions of a second)."""
    for unit, factor in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if all(value >= factor and float(value) % factor == 0 for value in seconds):
            return tuple(f"{int(value // factor)}{unit}" for value in seconds)
    return tuple(format_duration(value) for value in seconds)


def format_duration(seconds: float | None) -> str:
    """``1830`` -> ``'30m 30s'``; ``7200`` -> ``'2h'``; ``0.25`` -> ``'0.25s'``; None -> ``'unknown'``."""
    if seconds is None:
        return "unknown"
    if 0 < seconds < 0.995:
        return f"{seconds:.2g}s"  # a sub-second bound must not read "0s"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    parts = []
    for unit, factor in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        amount, seconds = divmod(seconds, factor)
        if amount:
            parts.append(f"{amount}{unit}")
    return " ".join(parts[:2])
