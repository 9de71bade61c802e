"""Validators of the agent's plugin settings: a name of the built-in ones or
of an entry point group's, checked when the setting is set."""

from __future__ import annotations

from typing import Any

from traitlets import TraitError
from traitlets.utils.descriptions import class_of


def one_of(proposal: Any, choices: tuple[str, ...]) -> str:
    """A plugin setting's value (one of ``choices``, built-in names and
    entry points'); TraitError in the words of an ``Enum`` trait otherwise."""
    if proposal["value"] not in choices:
        raise TraitError(f"The '{proposal['trait'].name}' trait of {class_of(proposal['owner'])} instance expected "
                         f"any of {list(choices)}, not {proposal['value']!r}")
    return proposal["value"]


def auto_or_one_of(proposal: Any, available: tuple[str, ...]) -> str:
    """As :func:`one_of`, ``auto`` or one of ``available``."""
    return one_of(proposal, ("auto", *available))
