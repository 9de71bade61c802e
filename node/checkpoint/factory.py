"""Finding checkpointers by name, and the node's checkpointer from what it asked.

Checkpointers come from two places, looked up in this order: the built-in
ones (:data:`BUILTIN`) and those a package declares in the
``gpupool.checkpointers`` entry point group (name = what
``c.AgentParking.checkpointer`` takes, value = its
:class:`~.base.Checkpointer` subclass)::

    [project.entry-points."gpupool.checkpointers"]
    criu = "mypackage.criu:CRIUCheckpointer"

``auto`` is not a name of either: it is the first of :data:`AUTO_ORDER`
that works on the node (:meth:`~.base.Checkpointer.unusable`). Nothing here
loads a plugin until one is asked for by name.
"""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint, entry_points

from .base import Checkpointer, CheckpointError, NodeFacts

ENTRY_POINT_GROUP = "gpupool.checkpointers"
AUTO = "auto"
#: The built-in checkpointers, as entry points of this package (loaded when asked for).
BUILTIN: dict[str, EntryPoint] = {
    name: EntryPoint(name, f"{__package__}.{target}", ENTRY_POINT_GROUP)
    for name, target in (("cuda-checkpoint", "cuda:CudaCheckpointer"), ("framework", "framework:FrameworkCheckpointer"),
                         ("simulated", "simulated:SimulatedCheckpointer"))
}
#: What ``auto`` tries, best first: the whole CUDA state, else the simulated GPUs' memory, else the
#: frameworks' own tensors (which works everywhere).
AUTO_ORDER = ("cuda-checkpoint", "simulated", "framework")


def _entry_points() -> dict[str, EntryPoint]:
    return {point.name: point for point in entry_points(group=ENTRY_POINT_GROUP) if point.name != AUTO}


def available() -> tuple[str, ...]:
    """The names ``c.AgentParking.checkpointer`` takes besides ``auto``: the
    built-in ones, then the others by name. Loads no plugin."""
    return (*BUILTIN, *sorted(set(_entry_points()) - set(BUILTIN)))


def checkpointer_class(name: str) -> type[Checkpointer]:
    """The checkpointer called ``name``. ValueError for an unknown one (naming
    the choices), TypeError for an entry point that names no
    :class:`~.base.Checkpointer` subclass of that name."""
    point = BUILTIN.get(name) or _entry_points().get(name)
    if point is None:
        raise ValueError(f"unknown checkpointer {name!r}; choose one of {AUTO}, {', '.join(available())}")
    found = point.load()
    if not (isinstance(found, type) and issubclass(found, Checkpointer)) or found.name != name:
        raise TypeError(f"entry point {name} = {point.value} ({ENTRY_POINT_GROUP}) names no Checkpointer subclass "
                        f"whose name is {name!r}")
    return found


def resolve(requested: str, node: NodeFacts, log: logging.Logger | None = None) -> Checkpointer:
    """The node's checkpointer: the one named ``requested``, or for ``auto``
    the first of :data:`AUTO_ORDER` that works on ``node`` (the others'
    reasons logged). ValueError, in words naming the setting, for an unknown
    one or one that cannot work here; TypeError for a broken plugin."""
    log = log or logging.getLogger("gpupool.agent")
    if requested != AUTO:
        chosen = checkpointer_class(requested)
        why = chosen.unusable(node)
        if why is None:
            try:
                return chosen(log)
            except CheckpointError as exc:
                why = str(exc)
        raise ValueError(f"the checkpointer {requested!r} cannot work on this node: {why} "
                         f"(c.AgentParking.checkpointer = 'auto' picks one that can)")
    reasons = []
    for name in AUTO_ORDER:
        candidate = checkpointer_class(name)
        why = candidate.unusable(node)
        if why is None:
            try:
                made = candidate(log)
            except CheckpointError as exc:
                why = str(exc)
            else:
                log.info("checkpointer: %s (auto%s)", name, f"; not {'; not '.join(reasons)}" if reasons else "")
                return made
        reasons.append(f"{name}: {why}")
    raise ValueError(f"no checkpointer works on this node: {'; '.join(reasons)}")
