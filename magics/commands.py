"""The words after ``%gpu COMMAND``, read: what each subcommand's line asks.

``acquire`` and ``release`` take options, parsed by the parsers IPython's
``magic_arguments`` builds (:data:`PARSERS`, which ``%gpu COMMAND --help``
prints); the others take names or nothing. Each reader raises UsageError
with words for the user; :class:`~gpupool.magics.magics.GPUMagics` does
what the line asks.
"""

from __future__ import annotations

import os

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split

from gpupool.leaseargs import REQUEST_OPTIONS, VALUE_OPTIONS, join_negative_values, lease_request
from gpupool.leaseclasses import CLASS_NAMES as LEASE_CLASSES
from gpupool.schema import ON_IDLE
from gpupool.wire.leases import LeaseRequest

from .attach import kernel_env
from .classes import requested_class

#: ``%gpu`` commands, in the order the unknown-command error lists them.
COMMANDS = ("acquire", "release", "status", "pool", "push", "pull", "park", "restart", "quota")
#: The magics' options that take a value, whose value may start with '-' (a bad one: -5GiB).
ACQUIRE_VALUE_FLAGS = VALUE_OPTIONS | {"--idle-timeout", "--env"}


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
def acquire_request(rest: str) -> LeaseRequest:
    # The request `%gpu acquire REST` makes; UsageError for a bad line. (No docstring: a decorated
    # function's is its parser's description, which `%gpu acquire --help` prints.)
    if not rest.strip() or rest.strip().startswith("--"):
        raise UsageError("say how much: %gpu acquire 0.5 (a share of one GPU) or %gpu acquire 2 (whole GPUs), "
                         "then any options (%gpu help)")
    args = _parse(acquire_request, rest)
    try:
        return lease_request(args, kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"),
                             prefer_env=None if args.env else kernel_env(),
                             lease_class=requested_class(args.batch, os.environ, args.lease_class),
                             on_idle=args.on_idle)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


@magic_arguments("_release")
@argument("--discard", action="store_true", help="do not bring the worker's variables back")
def release_discards(rest: str) -> bool:
    # Whether `%gpu release REST` leaves the variables on the worker (--discard); no docstring, as above.
    return _parse(release_discards, rest).discard


#: ``%gpu COMMAND`` -> the parser ``%gpu COMMAND --help`` prints (the others print ``%gpu help``).
PARSERS = {"acquire": acquire_request.parser, "release": release_discards.parser}


def no_arguments(command: str, rest: str) -> None:
    """UsageError when ``%gpu COMMAND`` is given words; it takes none."""
    if rest.strip():
        raise UsageError(f"%gpu {command} takes no arguments")


def names(command: str, rest: str, example: str) -> list[str]:
    """The variable names ``%gpu push|pull`` is given; UsageError (naming
    ``example``) when there are none."""
    found = rest.split()
    if not found:
        raise UsageError(f"%gpu {command} needs variable names: %gpu {command} {example}")
    return found
