"""``%gpu`` in a cell on the worker, run by the notebook kernel over the
worker's stdin channel (docs/api.md, "The forwarding kernel"), and the front end's
own ``input()`` rule for a forwarded cell."""

from __future__ import annotations

from gpupool import ipykernel_private as ipk
from gpupool.wire.magic import STDIN_KEY, ask_prompt, read_answer


def notebook_magic(ip, line: str) -> None:
    """``%gpu LINE`` in a cell on the worker: the notebook kernel runs it (its
    output shows in the cell, in order) and says whether it worked; raises
    UsageError with its words when not. It travels as an ``input_request``
    because the worker's shell channel is busy with this very cell."""
    from IPython.core.error import UsageError

    kernel = ip.kernel
    saved = ipk.allow_stdin(kernel)
    ipk.set_allow_stdin(kernel, True)
    try:
        answer = kernel.raw_input(ask_prompt(line))
    finally:
        ipk.set_allow_stdin(kernel, saved)
    try:
        ok, message = read_answer(answer)
    except ValueError:
        raise UsageError("%gpu on the worker needs the notebook's gpupool kernel to answer it") from None
    if not ok:
        raise UsageError(message or "%gpu failed")


def front_end_stdin(ip) -> None:
    """Before a forwarded cell: ``input()`` is allowed only if the front end
    allowed it (a forwarded request always allows stdin, see STDIN_KEY)."""
    metadata = (ip.kernel.get_parent("shell") or {}).get("metadata") or {}
    if STDIN_KEY in metadata:
        ipk.set_allow_stdin(ip.kernel, bool(metadata[STDIN_KEY]))
