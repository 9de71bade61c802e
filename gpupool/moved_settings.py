"""Settings that moved to another class: ``c.OLD.name`` is read as ``c.NEW.name``, with a warning.

The service's and the agent's settings were once all ``c.GPUPool.*`` and
``c.NodeAgent.*``; they now belong to one class per concern
(``c.PoolLeases.idle_timeout``, ``c.AgentWorkers.warm_workers``). A config
file or command line written for the old names keeps working: each moved
setting is carried to its new class before any class reads it, and the log
says the new spelling once. Where both spellings are set, the new one wins.
The idea is traitlets' own ``_deprecated_aliases`` of a renamed trait, across
classes instead of within one.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from traitlets.config import Config, Configurable


def new_homes(parts: Iterable[type[Configurable]]) -> dict[str, str]:
    """``{setting name: its class's name}`` for every configurable trait of
    ``parts``: where a setting once spelled ``c.OLD.name`` now lives."""
    return {name: part.__name__ for part in parts for name in part.class_trait_names(config=True)}


def carry_moved(config: Config, old: str, homes: Mapping[str, str], warn: Callable[[str], None]) -> None:
    """Move every ``config[old][name]`` whose name is in ``homes`` to
    ``config[homes[name]][name]`` (in place), unless that is set already;
    ``warn`` gets one sentence per moved setting."""
    if old not in config:
        return
    section = config[old]
    for name in [name for name in section if name in homes]:
        new = homes[name]
        value = section.pop(name)
        if name in config[new]:
            warn(f"c.{old}.{name} is now c.{new}.{name}, which is also set: c.{old}.{name} is ignored")
            continue
        config[new][name] = value
        warn(f"c.{old}.{name} is now c.{new}.{name}; the old spelling is read for now, please change it")
