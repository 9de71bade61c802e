"""The modes that need no node-level setup: ``timeslice``, ``exclusive``,
``mig``, and ``none`` (what a node with simulated GPUs reports)."""

from __future__ import annotations

from typing import Iterable

from .base import EnforcementMode


class Timeslice(EnforcementMode):
    """Fractions of a GPU, held by the framework caps and the memory watchdog; no compute share."""

    name = "timeslice"
    watches_memory = True


class Exclusive(EnforcementMode):
    """Whole GPUs only."""

    name = "exclusive"
    whole_gpus = True


class MIG(EnforcementMode):
    """Whole MIG instances only; the hardware confines memory and compute."""

    name = "mig"
    whole_gpus = True
    unit = "MIG instances"

    @staticmethod
    def present(uuids: Iterable[str]) -> bool:
        """True when the node's devices are MIG instances (``auto`` then picks this mode)."""
        return any(uuid.startswith("MIG-") for uuid in uuids)


class NoEnforcement(EnforcementMode):
    """Nothing runs on a GPU (simulated GPUs): the slice's variables only. Not selectable."""

    name = "none"
    runs_simulated = True
