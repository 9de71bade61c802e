"""Finding enforcement modes by name, and the node's mode from what it asked.

Modes come from three places, looked up in this order: the built-in ones,
those added in this process with :func:`register` (until :func:`unregister`), and those a package
declares in the ``gpupool.enforcement`` entry point group (name = the mode's
name, value = its :class:`~.base.EnforcementMode` subclass)::

    [project.entry-points."gpupool.enforcement"]
    vgpu = "mypackage.vgpu:VGPU"
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Callable, Iterable

from .base import EnforcementMode
from .modes import MIG, Exclusive, NoEnforcement, Timeslice
from .mps import MPS

ENTRY_POINT_GROUP = "gpupool.enforcement"
#: The built-in modes, in the order their names are listed.
BUILTIN: dict[str, type[EnforcementMode]] = {mode.name: mode for mode in (MPS, MIG, Timeslice, Exclusive)}
_registered: dict[str, type[EnforcementMode]] = {}


def register(mode: type[EnforcementMode]) -> type[EnforcementMode]:
    """Make ``mode`` (a subclass) selectable by its name in this process;
    returns it, so it serves as a class decorator. Raises TypeError for no
    subclass, ValueError for a built-in mode's name."""
    if not (isinstance(mode, type) and issubclass(mode, EnforcementMode)):
        raise TypeError(f"an enforcement mode must subclass EnforcementMode, got {mode!r}")
    if mode.name in BUILTIN or mode.name in ("auto", NoEnforcement.name):
        raise ValueError(f"enforcement mode name {mode.name!r} is taken by gpupool")
    _registered[mode.name] = mode
    return mode


def unregister(mode: type[EnforcementMode]) -> None:
    """Undo :func:`register` of ``mode``: its name is no longer selectable
    in this process (an entry point of that name is again). No error when
    ``mode`` is not registered; another class registered under its name
    since stays."""
    if _registered.get(getattr(mode, "name", None)) is mode:
        del _registered[mode.name]


def _entry_points() -> dict[str, EntryPoint]:
    return {point.name: point for point in entry_points(group=ENTRY_POINT_GROUP)}


def available() -> tuple[str, ...]:
    """The names ``c.AgentEnforcement.enforcement_mode`` takes besides ``auto``:
    the built-in ones, then the others by name. Loads no plugin."""
    others = (set(_registered) | set(_entry_points())) - set(BUILTIN) - {"auto", NoEnforcement.name}
    return (*BUILTIN, *sorted(others))


def mode_class(name: str) -> type[EnforcementMode]:
    """The mode called ``name``. Raises ValueError for an unknown one (naming
    the choices) and TypeError for an entry point that names no mode of that name."""
    if name in BUILTIN:
        return BUILTIN[name]
    if name in _registered:
        return _registered[name]
    point = _entry_points().get(name) if name not in ("auto", NoEnforcement.name) else None
    if point is None:
        raise ValueError(f"unknown enforcement mode {name!r}; choose one of auto, {', '.join(available())}")
    mode = point.load()
    if not (isinstance(mode, type) and issubclass(mode, EnforcementMode)) or mode.name != name:
        raise TypeError(f"entry point {name} = {point.value} ({ENTRY_POINT_GROUP}) names no EnforcementMode "
                        f"subclass whose name is {name!r}")
    return mode


def resolve(requested: str, inventory_kind: str, uuids: Iterable[str],
            mps_running: Callable[[], bool] = MPS.running) -> EnforcementMode:
    """The mode a node enforces slices with (not set up yet).

    ``requested``: a name of :func:`available`, or ``"auto"``: ``mig`` when
    the node's devices (``uuids``) are MIG instances, ``mps`` when an MPS
    control daemon runs (``mps_running``), else ``timeslice``.
    ``inventory_kind``: ``"simulated"`` gives ``none`` unless the mode asked
    for runs on simulated GPUs. Raises as :func:`mode_class`.
    """
    chosen = None if requested == "auto" else mode_class(requested)
    if inventory_kind == "simulated" and (chosen is None or not chosen.runs_simulated):
        return NoEnforcement()
    if chosen is None:
        uuids = list(uuids)
        chosen = MIG if MIG.present(uuids) else MPS if mps_running() else Timeslice
    return chosen()


def after_rediscovery(mode: EnforcementMode, requested: str, uuids: Iterable[str]) -> EnforcementMode:
    """The mode once the GPUs (``uuids``) could be read again: ``auto``
    becomes ``mig`` when they are MIG instances, which could not be known
    while NVML was down at the agent's start; otherwise ``mode`` itself."""
    if requested == "auto" and not isinstance(mode, MIG) and MIG.present(uuids):
        return MIG()
    return mode
