"""The expected workload placement weighs, and how much one placement grows
a node's fragmentation on the GPU dimension (Weng et al., "Beware of
Fragmentation", USENIX ATC '23, section 4). Pure: numbers in, numbers out.

:func:`.scheduler.place` picks, among the GPUs that can take a request, the
one whose fragmentation grows least (:func:`slice_delta`,
:func:`whole_delta`); the every-dimension measure for nodes where host room
binds is :mod:`.fragmentation`. Units: GPUs (fractions of one GPU).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

#: Tolerance for sums of fractions: 0.1 + 0.2 + 0.7 must fill a GPU exactly.
EPSILON = 1e-9


@dataclass(frozen=True)
class Shape:
    """One kind of request in the expected workload: ``fraction`` of one GPU
    (``gpu_count == 1``; 1.0 is one whole GPU) or ``gpu_count`` whole GPUs,
    asked for by a ``weight`` share of requests (a workload's weights sum to 1)."""

    fraction: float
    gpu_count: int = 1
    weight: float = 1.0


#: The expected workload: request shapes and how popular each is.
Workload = tuple[Shape, ...]


def workload_of(demands) -> Workload:
    """The workload that ``demands`` (an iterable of :class:`Demand`) show:
    one :class:`Shape` per distinct ``(fraction to 3 places, gpu_count)``,
    weighted by how often it occurs; empty when ``demands`` is."""
    counts: Counter[tuple[float, int]] = Counter(
        (1.0, d.gpu_count) if d.gpu_count > 1 else (round(d.fraction, 3), 1) for d in demands)
    total = sum(counts.values())
    return tuple(Shape(fraction, count, n / total) for (fraction, count), n in sorted(counts.items()))


#: Used until a pool has seen requests of its own (a guess at notebook use:
#: mostly quarter and half GPUs, some whole ones, a few 2- and 4-GPU jobs).
DEFAULT_WORKLOAD: Workload = (Shape(0.25, 1, 0.3), Shape(0.5, 1, 0.3), Shape(1.0, 1, 0.25),
                              Shape(1.0, 2, 0.1), Shape(1.0, 4, 0.05))


def slice_delta(free: float, whole_free: bool, idle: int, fraction: float, workload: Workload) -> float:
    """How much a node's fragmentation grows when a ``fraction`` slice goes on
    one of its GPUs, which has ``free`` fraction free (``whole_free``: no lease
    on it at all) on a node with ``idle`` wholly free GPUs (this one included).

    Fragmentation of a node for a request shape is the free capacity that
    shape cannot use there: on GPUs with less free than a slice shape needs,
    or that are partly taken for a whole-GPU shape; all of the node's free
    capacity when the shape cannot be placed on the node at all (Weng et al.,
    ATC '23, eq. 1-2). Summed over the workload by weight. Placing a slice
    changes one GPU and, for whole-GPU shapes, maybe whether the node still
    has enough free GPUs, so the growth depends only on these arguments
    (derivation per case in the comments). Units: GPUs (fractions)."""
    left = free - fraction
    delta = 0.0
    for shape in workload:
        if shape.gpu_count == 1:
            # This GPU's free capacity is a fragment for the shape when below its size; when this
            # GPU was the node's last that fits, the others were fragments already: same growth.
            need = shape.fraction - EPSILON
            change = (left if left < need else 0.0) - (free if free < need else 0.0)
        elif not whole_free:
            change = -fraction  # a taken GPU was a fragment already; it shrinks by the slice
        elif idle - 1 >= shape.gpu_count:
            change = left  # the node still fits the shape; this GPU becomes a fragment
        elif idle >= shape.gpu_count:
            change = idle - fraction  # the node no longer fits it: all its free capacity is fragment
        else:
            change = -fraction  # it did not fit before either: all free was fragment, less now
        delta += shape.weight * change
    return delta


def whole_delta(idle: int, count: int, workload: Workload) -> float:
    """Growth of a node's fragmentation (see :func:`slice_delta`) when
    ``count`` of its ``idle`` wholly free GPUs are taken whole. Slice shapes
    do not change (the node keeps a GPU that fits them or had none); a
    whole-GPU shape the node stops fitting makes its partly free GPUs and
    the idle ones left fragments."""
    delta = 0.0
    for shape in workload:
        if shape.gpu_count == 1 or idle - count >= shape.gpu_count:
            continue
        delta += shape.weight * ((idle - count) if idle >= shape.gpu_count else -count)
    return delta
