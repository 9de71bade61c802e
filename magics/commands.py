"""The words after ``%gpu COMMAND``, read: what each subcommand's line asks.

A ``%gpu`` line is split into words once, as a shell splits them
(:func:`split_line`): ``--memory "20 GB"`` is one value, as the Acquire
dialog writes it. ``acquire`` and ``release`` take options, parsed by the
parsers IPython's ``magic_arguments`` builds (:data:`PARSERS`, which
``%gpu COMMAND --help`` prints); the others take names or nothing. Each
reader takes the words after the command and raises UsageError with words
for the user; :class:`~gpupool.magics.magics.GPUMagics` does what the line asks.
"""

from __future__ import annotations

import os
import shlex

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

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


def split_line(line: str) -> list[str]:
    """The words of a ``%gpu`` line (or of what follows its command), split as a
    shell splits them: quotes group a value and are dropped (``--memory '20 GB'``
    is ``--memory``, ``20 GB``; ``--memory '20GiB'`` is ``--memory``, ``20GiB``),
    as ``gpupool run`` gets its options from the shell and as IPython's own
    magics read theirs (``parse_options``). UsageError for a quote that is not
    closed, led by the option whose value it is in, if any (``--memory: ...``:
    the Acquire dialog names that field).

    ``magic_arguments``' own ``parse_argstring`` is not used: it splits with
    ``arg_split(posix=False)``, which keeps the quotes in the value (a new-user
    trial: ``cannot read "'20GiB'" as a memory size``)."""
    lexer = shlex.shlex(line, posix=True)
    lexer.whitespace_split, lexer.commenters = True, ""  # as shlex.split: '#' is a character like any other
    words: list[str] = []
    try:
        for word in lexer:
            words.append(word)
    except ValueError as exc:  # "No closing quotation", "No escaped character"
        option = words[-1] if words and words[-1].startswith("--") else ""
        what = "a backslash ends it" if "escaped" in str(exc) else "a quote in it is not closed"
        raise UsageError(f"{option + ': ' if option else ''}cannot read {line.strip()!r}: {what}; quote a value "
                         "whole, as in --memory '20 GB', or not at all") from None
    return words


def _parse(command, words: list[str]):
    try:  # --wait -1m as --wait=-1m: argparse would take the value for an option
        return command.parser.parse_args(join_negative_values(words, ACQUIRE_VALUE_FLAGS))
    except UsageError:
        raise
    except SystemExit:  # argparse exits on bad arguments; IPython's parser raises UsageError
        raise UsageError(f"bad arguments: {shlex.join(words)!r}") from None


def _request_arguments(func):
    """The options :mod:`gpupool.leaseargs` shares with ``gpupool run``, as ``@argument``s."""
    for flags, keywords in reversed(REQUEST_OPTIONS):  # IPython adds a function's arguments bottom-up
        func = argument(*flags, **keywords)(func)
    return func


@magic_arguments("_acquire")  # its usage line names the command as typed: PARSERS below
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
def acquire_request(words: list[str]) -> LeaseRequest:
    # The request `%gpu acquire WORDS` makes (the words after `acquire`, split_line's); UsageError for
    # a bad line. (No docstring: a decorated function's is its parser's description, which
    # `%gpu acquire --help` prints.)
    if not words or words[0].startswith("--"):
        raise UsageError("say how much: %gpu acquire 0.5 (a share of one GPU) or %gpu acquire 2 (whole GPUs), "
                         "then any options (%gpu help)")
    args = _parse(acquire_request, words)
    try:
        return lease_request(args, kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"),
                             prefer_env=None if args.env else kernel_env(),
                             lease_class=requested_class(args.batch, os.environ, args.lease_class),
                             on_idle=args.on_idle)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


@magic_arguments("_release")
@argument("--discard", action="store_true", help="do not bring the worker's variables back")
def release_discards(words: list[str]) -> bool:
    # Whether `%gpu release WORDS` leaves the variables on the worker (--discard); no docstring, as above.
    return _parse(release_discards, words).discard


#: ``%gpu COMMAND`` -> the parser ``%gpu COMMAND --help`` prints (the others print ``%gpu help``).
PARSERS = {"acquire": acquire_request.parser, "release": release_discards.parser}
for _command, _parser in PARSERS.items():
    _parser.prog = f"gpu {_command}"  # IPython puts the % before it


def no_arguments(command: str, words: list[str]) -> None:
    """UsageError when ``%gpu COMMAND`` is given ``words``; it takes none."""
    if words:
        raise UsageError(f"%gpu {command} takes no arguments")


def names(command: str, words: list[str], example: str) -> list[str]:
    """The variable names ``%gpu push|pull`` is given (``words``); UsageError
    (naming ``example``) when there are none."""
    if not words:
        raise UsageError(f"%gpu {command} needs variable names: %gpu {command} {example}")
    return list(words)
