"""Finding worker launchers by name.

Launchers come from two places, looked up in this order: the built-in one
(:data:`BUILTIN`: ``local``, ``slurm``, ``kubernetes``) and those a package declares in the
``gpupool.worker_launchers`` entry point group (name = what
``c.AgentWorkers.worker_launcher`` takes, value = its
:class:`~.base.WorkerLauncher` subclass)::

    [project.entry-points."gpupool.worker_launchers"]
    podman = "mypackage.podman:PodmanLauncher"

Nothing here loads a plugin, or the local launcher, until one is asked for by name.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from .base import WorkerLauncher

ENTRY_POINT_GROUP = "gpupool.worker_launchers"
#: The built-in launchers, as entry points of this package (loaded when asked for).
BUILTIN: dict[str, EntryPoint] = {
    "local": EntryPoint("local", f"{__package__}.local:LocalLauncher", ENTRY_POINT_GROUP),
    "slurm": EntryPoint("slurm", f"{__package__}.slurm.workers:SlurmWorkers", ENTRY_POINT_GROUP),
    "kubernetes": EntryPoint("kubernetes", f"{__package__}.kubernetes.workers:KubernetesWorkers", ENTRY_POINT_GROUP),
}


def _entry_points() -> dict[str, EntryPoint]:
    return {point.name: point for point in entry_points(group=ENTRY_POINT_GROUP)}


def available() -> tuple[str, ...]:
    """The names ``c.AgentWorkers.worker_launcher`` takes: the built-in ones,
    then the others by name. Loads no plugin."""
    return (*BUILTIN, *sorted(set(_entry_points()) - set(BUILTIN)))


def launcher_class(name: str) -> type[WorkerLauncher]:
    """The launcher called ``name``. Raises ValueError for an unknown one
    (naming the choices) and TypeError for an entry point that names no
    :class:`~.base.WorkerLauncher` subclass."""
    point = BUILTIN.get(name) or _entry_points().get(name)
    if point is None:
        raise ValueError(f"unknown worker launcher {name!r}; choose one of {', '.join(available())}")
    found = point.load()
    if not (isinstance(found, type) and issubclass(found, WorkerLauncher)):
        raise TypeError(f"entry point {name} = {point.value} ({ENTRY_POINT_GROUP}) names no WorkerLauncher subclass")
    return found
