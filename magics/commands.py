"""The ``%gpu`` subcommands: ``acquire``, ``release``, ``restart``,
``status``, ``pool``, ``quota``, ``push`` and ``pull``.

Each is ``command(magics, rest)``: :class:`~gpupool.magics.magics.GPUMagics`
``magics`` and the words after the subcommand; a command with options parses
them with the parser IPython's ``magic_arguments`` puts on it (its
``parser``, which ``%gpu COMMAND --help`` prints). Raises UsageError (or
GPUPoolError, which ``%gpu`` turns into one) with words for the user.
"""

from __future__ import annotations

import os
import sys
import time
from html import escape as html_escape
from dataclasses import replace
from datetime import datetime, timezone

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split
from IPython.display import display

from gpupool.errors import GPUPoolError
from gpupool.leaseclasses import CLASS_NAMES as LEASE_CLASSES
from gpupool.leasewait import POLL_SECONDS
from gpupool.schema import ON_IDLE, LeaseState, isoformat
from gpupool.leaseargs import REQUEST_OPTIONS, VALUE_OPTIONS, join_negative_values, lease_request
from gpupool.wire.leases import LeaseRequest
from gpupool.wire.transfer import GpuMemory
from gpupool.tables import (fraction_words, gpu_utilization, held_seconds, holders_table, host_words, lease_table,
                            pool_table, released_words, slice_words)
from gpupool.units import format_bytes, format_duration

from .attach import attach, kernel_env, same_size
from .move import move
from .park import parked_words
from .classes import class_note, requested_class
from .quota import quota_report
from .summary import summarize
from .dataplane import TransferInterrupted
from .words import pull_interrupted, push_interrupted, release_interrupted, say, transfer_note

#: The magics' options that take a value, whose value may start with '-' (a bad one: -5GiB).
ACQUIRE_VALUE_FLAGS = VALUE_OPTIONS | {"--idle-timeout", "--env"}
#: What the worker answers for a name its namespace lacks (provisioner/worker_extension/namespace.py).
NOT_ON_WORKER = "not defined on the worker"


def _parse(command, rest: str):
    try:  # --wait -1m as --wait=-1m: argparse would take the value for an option
        return command.parser.parse_args(join_negative_values(arg_split(rest), ACQUIRE_VALUE_FLAGS))
    except UsageError:
        raise
    except SystemExit:  # argparse exits on bad arguments; IPython's parser raises UsageError
        raise UsageError(f"bad arguments: {rest!r}") from None


def _request_arguments(func):
    """The options :mod:`gpupool.leaseargs` shares with ``gpupool run``, as ``@argument``s."""
    for flags, keywords in reversed(REQUEST_OPTIONS):  # IPython adds a function's arguments bottom-up
        func = argument(*flags, **keywords)(func)
    return func


# The parsers keep the names their usage line has always shown ("_acquire", "_release").
@magic_arguments("_acquire")
@argument("amount", help="a fraction of one GPU (0.5) or a count of whole GPUs (2)")
@_request_arguments
@argument("--idle-timeout", help="release after this long without a running cell, e.g. 10m")
@argument("--env", help="the worker environment on the GPU node, e.g. torch; %%gpu pool lists them (default: the "
                        "one named like this kernel, torch for a kernel torch or gpupool-torch, where a node "
                        "offers it, else the node's)")
@argument("--on-idle", choices=ON_IDLE, default="park",
          help="at the idle timeout: park (the worker waits frozen on its node with its variables, the GPU goes "
               "back to the pool, the next cell resumes it; default) or release (the variables are lost)")
@argument("--batch", action="store_true", help="a batch run: queued behind interactive requests "
          "(default: interactive, or $GPUPOOL_LEASE_CLASS)")
@argument("--class", dest="lease_class", metavar="CLASS",
          help=f"the lease class, one of {', '.join(LEASE_CLASSES)} (default: the first, or $GPUPOOL_LEASE_CLASS)")
def acquire(magics, rest: str) -> None:
    if not rest.strip() or rest.strip().startswith("--"):
        raise UsageError("say how much: %gpu acquire 0.5 (a share of one GPU) or %gpu acquire 2 (whole GPUs), "
                         "then any options (%gpu help)")
    args = _parse(acquire, rest)
    request = _lease_request(args)
    if magics.attachment is not None and magics.attachment.ended is None:
        return move(magics, request)  # another size or model: the variables go worker to worker
    magics.drop()
    started = time.monotonic()
    magics.attachment = attach(magics, request)
    lease = magics.attachment.lease
    gpu = lease.gpus[0] if lease.gpus else {}
    share = f"{fraction_words(lease.fraction)} of" if lease.gpu_count == 1 else f"{lease.gpu_count} x"
    where = ("Cells now run on the worker; %gpu release detaches." if magics.kernel is not None else
             "This kernel is not the gpupool kernel, so cells stay here: start one with %%gpu to run it "
             "on the worker (the Python 3 (gpupool) kernel runs every cell there).")
    say(f"attached {lease.id}: {slice_words(lease)}, {format_bytes(lease.memory)}{host_words(lease)}; "
        f"idle timeout {format_duration(lease.idle_timeout)}{class_note(lease)} "
        f"[{time.monotonic() - started:.1f}s]. {where}")
    if magics.attachment.workdir:
        say(magics.attachment.workdir)
    magics.tell("attached", f"attached {lease.id}: {share} {gpu.get('name', 'GPU')} on {lease.node}")


def _lease_request(args) -> LeaseRequest:
    """The request ``%gpu acquire``'s parsed ``args`` ask for; UsageError for a bad value."""
    try:
        return lease_request(args, kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"),
                             prefer_env=None if args.env else kernel_env(),
                             lease_class=requested_class(args.batch, os.environ, args.lease_class),
                             on_idle=args.on_idle)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


@magic_arguments("_release")
@argument("--discard", action="store_true", help="do not bring the worker's variables back")
def release(magics, rest: str) -> None:
    args = _parse(release, rest)
    if args.discard and magics.attachment is not None and magics.attachment.parked is not None:
        attachment, magics.attachment = magics.attachment, None  # parked: nothing to bring back, no resume
        try:
            lease = attachment.release(reason="%gpu release --discard")
        finally:
            magics.tell()  # detached here, whatever the service answered
        say(f"{released_words(lease)}; its variables were discarded")
        magics.tell("released", f"released {lease.id} (it was parked)")
        return
    attachment = magics.attached()  # a parked lease resumes first: its variables come home from the worker
    note = ""
    if not args.discard:
        try:
            values, items, errors = attachment.pull(None, max_bytes=magics.release_state_cap)
            magics.variables.take(values, items)
            note = summarize("brought back", items, errors)
        except GPUPoolError as exc:  # the worker died or is unreachable: the slice is still freed
            note = f"; the worker's variables could not come back: {exc.message}"
        except TransferInterrupted as exc:  # stopped before anything changed: still attached, as before
            raise UsageError(release_interrupted(exc, attachment.lease.id)) from None
    magics.attachment = None  # from here on this kernel is detached, whatever happens
    try:
        lease = attachment.release(reason="%gpu release")
    except KeyboardInterrupt:  # finish what was asked (release is idempotent), then stop
        lease = attachment.client.release(attachment.lease.id, reason="%gpu release")
    say(f"{released_words(lease)}{note}")
    magics.tell("released", f"released {lease.id} after {format_duration(held_seconds(lease))}")


def restart(magics, rest: str) -> None:
    """Release the lease without its variables (the worker may be stuck)
    and attach to a fresh one of the same size."""
    if rest.strip():
        raise UsageError("%gpu restart takes no arguments")
    if magics.attachment is None:
        raise UsageError("not attached to a GPU; run %gpu acquire 0.5 first")
    old = magics.attachment.lease
    magics.drop()
    try:
        magics.client.release(old.id, reason="%gpu restart")
    except GPUPoolError as exc:  # already ended (parked, reclaimed): a new slice is what was asked for
        print(f"gpupool: {old.id}: {exc.message}", file=sys.stderr)
    magics.attachment = attach(magics, same_size(old))
    say(f"restarted: released {old.id} (its variables are lost), attached {magics.attachment.lease.id}")
    magics.tell("attached", f"restarted: attached {magics.attachment.lease.id}")


#: How many names ``%gpu status`` lists as holding GPU memory (then "and N more, X GiB").
HOLDERS_SHOWN = 10
#: Seconds ``%gpu status`` waits for the worker's list of them (the worker's own walk stops after about one).
HOLDERS_TIMEOUT_S = 10.0


def status(magics, rest: str) -> None:
    """``%gpu status``: the lease as a table, and, attached to a running
    worker, the names holding GPU memory there (:func:`holders_view`)::

        In [5]: %gpu status
        lease           state   node    ...  worker  idle deadline in / reason
        --------------  ------  ------  ...  ------  -------------------------
        L-94731d6f2463  active  node-1  ...  idle    30m

        holds GPU memory                                         size               on      type
        -------------------------------------------------------  -----------------  ------  ---------
        model                                                    1.2 GiB            cuda:0  Linear
        last traceback (OutOfMemoryError; frames of Cell In[4])  512.0 MiB          cuda:0  traceback
        batches                                                  64.0 MiB, and x's  cuda:0  list
        w                                                        in model           cuda:0  Parameter
        and 3 more, 12.0 MiB
    """
    if rest.strip():
        raise UsageError("%gpu status takes no arguments")
    words, leases, utilization = status_view(magics)
    if words:
        say(words)
        return
    text, html = lease_table(leases, utilization)
    held = holders_view(magics)
    if held is not None:
        text, html = f"{text}\n\n{held[0]}", html + held[1]
    display({"text/plain": text, "text/html": html}, raw=True)


def holders_view(magics) -> tuple[str, str] | None:
    """``(text, html)`` of the names holding GPU memory on the attached
    worker (:func:`holders_answer`, :func:`~gpupool.tables.holders_table`), or
    one line saying why it did not say; None when no worker runs."""
    answer = holders_answer(magics)
    if answer is None or isinstance(answer, str):
        return None if answer is None else (answer, f"<p>{html_escape(answer)}</p>")
    return holders_table(answer)


def holders_answer(magics) -> dict | str | None:
    """The attached worker's ``gpu_memory`` answer, or one line saying why it
    did not say (parked: asking would wake the frozen worker); None when no
    worker runs (not attached, or ended)."""
    attachment = magics.attachment
    if attachment is None or attachment.ended is not None:
        return None
    if attachment.is_parked:  # asking would wake the frozen worker
        return "the worker is parked: the names holding GPU memory are listed once it runs again"
    if attachment.lock.locked():  # %gpu status in a cell on the worker: its comm answers after that cell
        return "the names holding GPU memory are listed by a %gpu status between cells (one runs on the worker now)"
    try:
        answer, _ = attachment.request(GpuMemory(top=HOLDERS_SHOWN), timeout=HOLDERS_TIMEOUT_S)
    except GPUPoolError as exc:
        return f"which names hold GPU memory: the worker did not say ({exc.message})"
    return answer


def status_view(magics) -> tuple[str | None, list, dict[str, float | None]]:
    """What ``%gpu status`` shows: ``(words, [], {})`` when there is no lease
    to list (parked, not attached), else ``(None, leases, utilization by GPU
    UUID)`` for :func:`~gpupool.tables.lease_table`. GPUPoolError when the
    service cannot be asked."""
    if magics.attachment is None:
        leases = magics.client.list_leases(kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"))
        if not leases:
            return "not attached; %gpu acquire 0.5 attaches half a GPU", [], {}
    else:
        leases = [_as_seen_here(magics, magics.attachment.refresh())]
    return None, leases, gpu_utilization(magics.client.pool())


def _as_seen_here(magics, lease):
    """``lease`` with its worker idle since the last forwarded cell ended, when the service still
    says busy and no forwarded cell runs: the service hears of a cell's end with the agent's next
    heartbeat (up to ``c.GPUPool.node_heartbeat_interval`` later); this kernel knows it now."""
    cell = getattr(magics.kernel, "cell", None)
    worker = lease.worker or {}
    if cell is None or cell.running is not None or cell.ended_at is None or worker.get("execution_state") != "busy":
        return lease
    ended = datetime.fromtimestamp(cell.ended_at, timezone.utc)
    return replace(lease, worker={**worker, "execution_state": "idle"}, idle_since=isoformat(ended),
                   idle_deadline=None)


def quota(magics, rest: str) -> None:
    """``%gpu quota``: your limits beside today's and this week's usage."""
    if rest.strip():  # `%gpu quota set ...` would otherwise just show the caller's own quota
        raise UsageError("%gpu quota takes no arguments; admins change quotas with `gpupool quota set SCOPE "
                         "LIMIT=VALUE` in a terminal")
    print(quota_report(magics.client))


def pool(magics, rest: str) -> None:
    if rest.strip():
        raise UsageError("%gpu pool takes no arguments")
    text, html = pool_table(magics.client.pool())
    display({"text/plain": text, "text/html": html}, raw=True)


def push(magics, rest: str) -> None:
    names = rest.split()
    if not names:
        raise UsageError("%gpu push needs variable names: %gpu push X y")
    missing = [n for n in names if n not in magics.shell.user_ns]
    if missing:
        raise UsageError(f"not defined here: {', '.join(missing)}; nothing was sent")
    try:
        items, errors = magics.variables.send(magics.attached(), names)
    except TransferInterrupted as exc:
        raise UsageError(push_interrupted(exc)) from None
    say(transfer_note("pushed", items, errors).lstrip("; "))


def pull(magics, rest: str) -> None:
    names = rest.split()
    if not names:
        raise UsageError("%gpu pull needs variable names: %gpu pull model history")
    try:
        values, items, errors = magics.attached().pull(names)
    except TransferInterrupted as exc:
        raise UsageError(pull_interrupted(exc)) from None
    missing = [name for name, why in errors.items() if why == NOT_ON_WORKER]
    if missing:  # as push does for a name not defined here: nothing taken
        raise UsageError(f"not defined on the worker: {', '.join(missing)}; nothing was pulled")
    magics.variables.take(values, items)
    say(transfer_note("pulled", items, errors).lstrip("; "))


def park(magics, rest: str) -> None:
    """``%gpu park``: give the GPU back now, keeping everything: the worker
    waits frozen on its node with its variables; the next cell resumes it."""
    if rest.strip():
        raise UsageError("%gpu park takes no arguments")
    if magics.attachment is not None and magics.attachment.is_parked:
        say(f"{magics.attachment.lease.id} is parked already; the next cell resumes it")
        return
    attachment = magics.attached()
    attachment.parking_here = True
    try:
        lease = magics.client.park(attachment.lease.id)
        deadline = time.monotonic() + magics.start_timeout
        while lease.state is LeaseState.parking and time.monotonic() < deadline:
            lease = magics.client.get_lease(lease.id, wait=POLL_SECONDS, state="parking")
    except GPUPoolError as exc:
        attachment.parking_here = False
        raise UsageError(f"could not park {attachment.lease.id}: {exc.message}") from None
    if lease.state is not LeaseState.parked:
        attachment.parking_here = False
        raise UsageError(f"{lease.id} is {lease.state.value}: {lease.reason or 'not parked'}")
    attachment.parking_here = True  # whichever thread sees the park first, this says it
    attachment.follow_parking(lease)
    if attachment.parked is not None:
        attachment.parked.told = True
    say(parked_words(lease, running=False))
    magics.tell("parked", f"parked {lease.id}")


#: ``%gpu COMMAND`` -> its function, in the order the unknown-command error lists them.
COMMANDS = {"acquire": acquire, "release": release, "status": status, "pool": pool, "push": push, "pull": pull,
            "park": park, "restart": restart, "quota": quota}
