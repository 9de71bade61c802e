"""How the ``%gpu`` magics word what they did: the ``gpupool:`` line, what
a push or pull moved (what a lease holds, its usage and time held:
:mod:`gpupool.tables`)."""

from __future__ import annotations

import textwrap
from typing import Any

from gpupool.transfer import describe


def say(text: str) -> None:
    """One line of the magics' own words: ``gpupool: TEXT`` on stdout."""
    print(f"gpupool: {text}", flush=True)


def dedent(text: str | None) -> str:
    """A docstring for ``%gpu help``: its first line, then the rest dedented."""
    head, _, body = (text or "").partition("\n")
    return head + "\n" + textwrap.dedent(body)


def transfer_note(verb: str, items: list[dict[str, Any]], errors: dict[str, str]) -> str:
    """``"; VERB 2 variables: x (...), y (...); not moved: z (why)"``, or ``""``."""
    parts = []
    if items:
        count = f"{len(items)} variable{'s' if len(items) != 1 else ''}"
        parts.append(f"{verb} {count}: {describe(items)}")
    if errors:
        parts.append("not moved: " + "; ".join(f"{name} ({why})" for name, why in errors.items()))
    return "; " + "; ".join(parts) if parts else ""


def push_interrupted(exc: Any) -> str:
    """One line for a push the user interrupted (a
    :class:`~gpupool.magics.dataplane.TransferInterrupted`): where it stopped
    and what the worker holds now."""
    if exc.defined:
        names = ", ".join(exc.defined)
        return (f"push interrupted {exc.where()}, too late to stop it: {names} "
                f"{'is' if len(exc.defined) == 1 else 'are'} defined on the worker")
    return f"push interrupted {exc.where()}; nothing was defined on the worker"


def pull_interrupted(exc: Any) -> str:
    """One line for an interrupted pull: nothing here changes until every byte has come."""
    return f"pull interrupted {exc.where()}; nothing was changed here"


def release_interrupted(exc: Any, lease_id: str) -> str:
    """One line for a release interrupted while the variables came back: it did not release."""
    return (f"release interrupted {exc.where()} while the variables came back; nothing came back and {lease_id} "
            "is still attached: run %gpu release again, or %gpu release --discard to leave them there")
