"""Variables between the notebook and the worker: ``%gpu push`` and
``%gpu pull``, the locals sent along with a cell, and the worker's variables
brought back when a lease is given up. Each is given the attachment it works
on; which one that is, :class:`~.lifecycle.Lifecycle` decides."""

from __future__ import annotations

import os
from typing import Callable

from IPython.core.error import UsageError

from gpupool.errors import GPUPoolError

from .attachment import Attachment
from .dataplane import TransferInterrupted
from .summary import as_outputs, summarize
from .variables import Variables
from .words import pull_interrupted, push_interrupted, say, transfer_note

#: What the worker answers for a name its namespace lacks (node/worker_extension/namespace.py).
NOT_ON_WORKER = "not defined on the worker"


class Transfers:
    """Moves values between ``variables`` (the user's namespace) and a
    worker. ``cap`` gives the most bytes a bring-back takes
    (``c.GPUMagics.release_state_cap``, read at each one)."""

    def __init__(self, variables: Variables, cap: Callable[[], int]) -> None:
        self.variables, self.cap = variables, cap

    def check_defined(self, names: list[str]) -> None:
        """UsageError unless every one of ``names`` is defined here (before a push)."""
        missing = self.variables.undefined(names)
        if missing:
            raise UsageError(f"not defined here: {', '.join(missing)}; nothing was sent")

    def push(self, attachment: Attachment, names: list[str]) -> None:
        """``%gpu push NAMES``: the line saying what went; UsageError when interrupted."""
        try:
            items, errors = self.variables.send(attachment, names)
        except TransferInterrupted as exc:
            raise UsageError(push_interrupted(exc)) from None
        say(transfer_note("pushed", items, errors).lstrip("; "))

    def pull(self, attachment: Attachment, names: list[str]) -> None:
        """``%gpu pull NAMES``: the line saying what came. UsageError, with
        nothing taken, when interrupted or when a name is not on the worker."""
        try:
            values, items, errors = attachment.pull(names)
        except TransferInterrupted as exc:
            raise UsageError(pull_interrupted(exc)) from None
        missing = [name for name, why in errors.items() if why == NOT_ON_WORKER]
        if missing:  # as push does for a name not defined here: nothing taken
            raise UsageError(f"not defined on the worker: {', '.join(missing)}; nothing was pulled")
        self.variables.take(values, items)
        say(transfer_note("pulled", items, errors).lstrip("; "))

    def send_along(self, attachment: Attachment, cell: str) -> None:
        """Send the local names ``cell`` reads that the worker lacks
        (:meth:`.variables.Variables.follow`) before it runs there; an interrupt
        is one UsageError line saying the cell did not run and what was sent."""
        try:
            self.variables.follow(attachment, cell)
        except TransferInterrupted as exc:
            raise UsageError(f"the cell did not run: sending along {', '.join(exc.names)}: "
                             f"{push_interrupted(exc)}") from None
        except KeyboardInterrupt:
            raise UsageError("interrupted before the cell ran on the worker; nothing was sent") from None

    def bring_back(self, attachment: Attachment) -> str:
        """Take all the worker's variables (up to the cap) into the user's
        namespace; returns the note on what came (``"; brought back ..."``).
        Raises GPUPoolError (the worker died or cannot be reached) and
        TransferInterrupted (nothing taken) as :meth:`Attachment.pull` does."""
        cap = self.cap()
        values, items, errors = attachment.pull(None, max_bytes=cap)
        kept = self.variables.take(values, items, keep_edited=True)
        room = cap - sum(item.get("nbytes", 0) for item in items) if cap else None
        outputs, left = self._outputs(attachment, room)
        items = [item for item in items if item["name"] not in kept] + outputs
        note = f"; kept the notebook's own {', '.join(kept)} (a %%local cell changed it after the worker's copy)"
        return (summarize("brought back", items, {**errors, **left}) + (note if kept else "")
                + _follow_folder(attachment))

    def _outputs(self, attachment: Attachment, room: int | None) -> tuple[list[dict], dict[str, str]]:
        """Bring home the results the worker's cells showed (its ``Out[n]`` and ``_n``: objects, as a
        pull moves them), the latest first, within ``room`` bytes (None: no cap) of the release's cap.
        Returns their items, named ``Out[n]``, and why each other stayed there."""
        names = [f"_{count}" for count in reversed(attachment.counts)]
        if not names:
            return [], {}
        try:
            if room is not None and room <= 0:  # none fits: which there are, not their bytes
                values, items, errors = {}, [], {name: "over the transfer size cap" for name in attachment.have(names)}
            else:
                values, items, errors = attachment.pull(names, max_bytes=room)
        except (GPUPoolError, TransferInterrupted) as exc:  # the variables came: the release goes on without these
            return [], {"Out": f"not brought back: {getattr(exc, 'message', None) or 'interrupted'}"}
        self.variables.take_outputs(values)
        return as_outputs(list(reversed(items)), {name: why for name, why in errors.items() if why != NOT_ON_WORKER})


def _follow_folder(attachment: Attachment) -> str:
    """Where the worker started in the notebook's folder and its cells moved (``%cd``), this kernel
    goes there too, as a local ``%cd`` would have left it; the note saying so, or ``""``."""
    cwd = attachment.worker_cwd
    if not attachment.shares_folder or not cwd or cwd == os.getcwd() or not os.path.isdir(cwd):
        return ""
    try:
        os.chdir(cwd)
    except OSError:
        return ""
    return f"; now in {cwd}, where the worker's cells left the folder"
