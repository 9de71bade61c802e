"""How the ``%gpu`` magics word what they did: the ``gpupool:`` line, what
a push or pull moved (what a lease holds, its usage and time held:
:mod:`gpupool.tables`)."""

from __future__ import annotations

import textwrap
from typing import Any

from gpupool.heartbeat import ended_message
from gpupool.transfer import describe


def say(text: str) -> None:
    """One line of the magics' own words: ``gpupool: TEXT`` on stdout."""
    print(f"gpupool: {text}", flush=True)


#: What a cell that a lease's end overtook says of itself (:func:`ended_words` ``cell``).
CELL_DID_NOT_RUN = "this cell did not run"
CELL_STOPPED = "this cell was stopped with it"


def ended_words(lease: Any, cell: str = "") -> str:
    """Words for ``lease`` (a :class:`~gpupool.wire.leases.Lease`) that ended
    behind the notebook's back (reclaimed, released by an admin, its worker
    killed or out of memory): what the service said, that the worker's
    variables were lost with it (nothing comes back to the notebook from a
    lease that ends there; what the notebook holds itself is kept), what
    became of ``cell`` (:data:`CELL_DID_NOT_RUN`, :data:`CELL_STOPPED`; ""
    for a notice between cells) and how to go on::

        lease L-1 was reclaimed: idle for 7s. The worker's variables were lost with it (an idle release
        brings nothing back; --on-idle park, the default, keeps them): none came back to this notebook,
        which keeps only those it held itself; this cell did not run. Run %gpu acquire 0.5 to attach
        again, then rerun the cells that made them.
    """
    why = " (an idle release brings nothing back; --on-idle park, the default, keeps them)" \
        if getattr(lease, "on_idle", None) == "release" and lease.state.value == "reclaimed" else ""
    again = f"%gpu acquire {lease.fraction:g}" if lease.gpu_count == 1 else f"%gpu acquire {lease.gpu_count}"
    return (f"{ended_message(lease)}. The worker's variables were lost with it{why}: none came back to this "
            f"notebook, which keeps only those it held itself{'; ' + cell if cell else ''}. Run {again} to attach "
            "again, then rerun the cells that made them.")


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
    where = exc.where()
    during = where if where.startswith("while ") else f"{where} while the variables came back"
    return (f"release interrupted {during}; nothing came back and {lease_id} "
            "is still attached: run %gpu release again, or %gpu release --discard to leave them there")
