"""Lease classes as data: the one table the wire, the rules, the magics,
``gpupool run`` and the simulator read (docs/api.md, "Classes and pressure").

A class is a name (what the wire and the database hold: a short word, at most
:data:`MAX_NAME` characters) and how the pool treats its requests and leases.
Adding a class is one row of :data:`LEASE_CLASSES` (and its tests): nothing
else names the classes. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

#: The longest class name (the database column is ``String(12)``).
MAX_NAME = 12


@dataclass(frozen=True)
class LeaseClass:
    """One lease class.

    ``rank``: queue order, lower first, one class per rank (a class's waiters queue behind every
    lower rank's). ``presses``: its waiters press (pressure parks idle leases
    early for them), on the leases of its own rank and after, never on a lower
    rank's. ``preempts``: its waiters may also interrupt running opted-in
    (preemptible) cells, where ``c.PoolPressure.allow_preemption``; and a waiting
    request of it for several whole GPUs has a node cleared for it
    (``c.PoolPressure.pressure_clears_nodes``). ``yields``: backfill: a new request
    of it does not start while a request of a class that does not yield waits
    (``c.PoolPressure.batch_yields``) nor takes the last idle nodes
    (``c.PoolPressure.batch_headroom_nodes``), and under ``c.PoolPressure.batch_first`` its
    leases are taken before those of the classes that do not yield.
    ``idles``: its leases sit idle between cells (a person thinking), so the
    simulator gives them the idle timeout; a class that does not idle runs
    its work start to end. ``default``: the class of a request that names none
    (exactly one row). ``words``: what it is, for help texts."""

    name: str
    rank: int
    words: str
    presses: bool = True
    preempts: bool = False
    yields: bool = False
    idles: bool = True
    default: bool = False


#: Every class, in queue order.
LEASE_CLASSES: tuple[LeaseClass, ...] = (
    LeaseClass("interactive", 0, "a person at a notebook", preempts=True, default=True),
    LeaseClass("batch", 1, "a job queued behind every interactive request", yields=True, idles=False),
)


def names() -> tuple[str, ...]:
    """The class names, in queue order (by rank)."""
    return tuple(item.name for item in sorted(LEASE_CLASSES, key=lambda item: item.rank))


class _Names(Sequence[str]):
    """The class names, in queue order, read from the table at each use: what
    the wire's ``enum`` and the help texts hold, so a row added is accepted
    everywhere without another change."""

    def __getitem__(self, index):  # type: ignore[override]
        return names()[index]

    def __len__(self) -> int:
        return len(LEASE_CLASSES)

    def __iter__(self) -> Iterator[str]:
        return iter(names())

    def __contains__(self, value: object) -> bool:
        return value in names()

    def __repr__(self) -> str:
        return repr(names())


#: The class names, a live view of :data:`LEASE_CLASSES`.
CLASS_NAMES: Sequence[str] = _Names()


def default() -> LeaseClass:
    """The default class: a request that names none (None on the wire, leases from before classes)."""
    return next(item for item in LEASE_CLASSES if item.default)


def script_default() -> LeaseClass:
    """The class of a script run from a terminal (``gpupool run``): the first that
    does not idle (a script runs start to end): ``batch``."""
    return next(item for item in LEASE_CLASSES if not item.idles)


def lease_class(name: str | None) -> LeaseClass:
    """The class called ``name`` (None: :func:`default`); raises ValueError in
    words naming the classes for any other name."""
    if name is None:
        return default()
    for item in LEASE_CLASSES:
        if item.name == name:
            return item
    raise ValueError(f"lease class {name!r:.40} is not one of {', '.join(names())}")


def class_rank(name: str | None) -> int:
    """The queue rank of ``name`` (:func:`lease_class`)."""
    return lease_class(name).rank


def yielding() -> tuple[str, ...]:
    """The names of the classes that yield (backfill)."""
    return tuple(item.name for item in LEASE_CLASSES if item.yields)


def not_yielding() -> tuple[str, ...]:
    """The names of the classes that do not yield (a person waits on them)."""
    return tuple(item.name for item in LEASE_CLASSES if not item.yields)
