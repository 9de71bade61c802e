"""``gpupool run``: run a Python script on a pooled GPU from a terminal, a CI
job or cron, as ``python script.py args`` would run it there.

    $ gpupool run --gpus 0.5 --wait 10m train.py --epochs 3
    gpupool: running train.py on L-7: 0.50 of NVIDIA A100-SXM4-80GB (GPU 0) on node-1, 40.0 GiB; batch
    epoch 1 loss 0.31
    ...
    gpupool: released L-7 after 2m 10s (65.0 GPU-seconds)

The lease is ``batch`` (queued behind people at notebooks) unless
``--interactive``. The script's source is sent to the worker (the node needs
no shared filesystem) and runs there as ``__main__`` with ``sys.argv`` and
``__file__`` set (gpupool.scriptmain), in the worker's folder as the agent
chose it. Its stdout and stderr stream here as it writes them; ``input()``
reads this terminal's stdin; Ctrl-C interrupts the script (KeyboardInterrupt
there), a second Ctrl-C releases the GPU and exits. The lease is heartbeated
while the script runs and released at the end, whatever the end.

Exit status: the script's (0; its ``SystemExit`` code; 1 after its
traceback; 130 after an interrupt); 2 when gpupool could not run it (bad
arguments, pool full, quota, service down, lease lost: one line saying why).
"""

from __future__ import annotations

import argparse
import getpass
import os
import signal
import sys
import time
import traceback

from .api import ServiceClient, add_client_arguments, client_from_arguments
from .errors import GPUPoolError, Reason
from .schema import LeaseState
from . import leaseclasses
from .leaseargs import VALUE_OPTIONS, add_request_options, join_negative_values, lease_request, option_words
from .leasewait import START_WAIT_S, cancel, wait_started
from .runremote import Abandoned, run_script
from .tables import host_words, memory_words, released_words, slice_words
from .units import format_duration
from .wire.leases import Lease, LeaseRequest

#: Seconds a lease may stay ``starting`` once out of the queue (as c.GPUMagics.start_timeout).
START_TIMEOUT = 300.0
#: Seconds a Ctrl-C during the release may wait to learn whether the release went through.
QUICK_LOOK_S = 3.0
#: Exit status when gpupool itself could not run the script (as argparse's for bad arguments).
EXIT_GPUPOOL = 2


class _OneLineParser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument is one line (argparse prints its usage block first)."""

    def error(self, message: str):
        self.exit(EXIT_GPUPOOL, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


#: ``gpupool run``'s options that take a value (``--gpus 0.5``), besides the lease request's.
VALUE_FLAGS = VALUE_OPTIONS | {"--gpus", "--env", "--class", "--url", "--token-file", "--ca-file"}


def build_parser() -> argparse.ArgumentParser:
    """The ``gpupool run`` parser: lease options, client options, the script and its arguments."""
    doc = __doc__.replace("``", "").split("\n\n")
    parser = _OneLineParser(prog="gpupool run", description="Run a Python script on a pooled GPU, as "
                                     "`python script.py args` would run it there.", epilog="\n\n".join(doc[2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", dest="amount", default="1",
                        help="a fraction of one GPU (0.5) or a count of whole GPUs (2); default 1")
    add_request_options(parser.add_argument)
    parser.add_argument("--env", help="the worker environment on the GPU node, e.g. torch; gpupool pool lists them "
                                      "(default: the node's)")
    parser.add_argument("--interactive", action="store_true",
                        help="an interactive lease, queued with people at notebooks (short for --class "
                             f"{leaseclasses.default().name}; default: {leaseclasses.script_default().name})")
    parser.add_argument("--class", dest="lease_class", metavar="CLASS",
                        help=f"the lease class, one of {', '.join(leaseclasses.names())} "
                             f"(default: {leaseclasses.script_default().name})")
    add_client_arguments(parser)
    parser.add_argument("script", nargs="?", help="the Python script to run (its source is sent to the worker)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments (its sys.argv[1:])")
    return parser


def read_script(path: str) -> tuple[str, str]:
    """``(absolute path, source)`` of the script at ``path``, checked to
    compile here before any GPU is asked for. Raises GPUPoolError
    ``bad_request`` when it cannot be read; SyntaxError as Python would."""
    try:
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
    except OSError as exc:
        raise GPUPoolError(Reason.bad_request, f"cannot read the script {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise GPUPoolError(Reason.bad_request, f"cannot read the script {path}: it is not UTF-8 text") from None
    absolute = os.path.abspath(path)
    compile(source, absolute, "exec", dont_inherit=True)
    return absolute, source


def run_class(interactive: bool, named: str | None) -> str:
    """The class ``gpupool run`` asks for: ``named`` (``--class``), else the default class with
    ``--interactive``, else :func:`.leaseclasses.script_default`. ValueError in words for an
    unknown class, or ``--interactive`` with another ``--class``."""
    if named is None:
        return (leaseclasses.default() if interactive else leaseclasses.script_default()).name
    if interactive and named != leaseclasses.default().name:
        raise ValueError(f"--interactive asks for class {leaseclasses.default().name}, --class for "
                         f"{named!r:.40}: say one of them")
    try:
        return leaseclasses.lease_class(named).name
    except ValueError:
        raise ValueError(f"--class {named!r:.40} is not a lease class; use one of "
                         f"{', '.join(leaseclasses.names())}") from None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gpupool run``; returns the exit status (see the module's docstring)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(join_negative_values(argv, VALUE_FLAGS, stop_at_positional=True))
    if args.script is None:  # optional only so that argparse's words do not name the script's arguments
        parser.error("the following arguments are required: script")
    try:
        request = lease_request(args, lease_class=run_class(args.interactive, args.lease_class))
    except ValueError as exc:
        parser.error(str(exc))
    client = client_from_arguments(parser, args)
    try:
        path, source = read_script(args.script)
        return ScriptRun(client, request, path, source, args.args).go()
    except SyntaxError as exc:  # as Python says it; nothing was asked of the pool
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        return 1
    except GPUPoolError as exc:
        print(f"gpupool run: {exc.message}", file=sys.stderr)
        return EXIT_GPUPOOL


class ScriptRun:
    """One ``gpupool run``: acquire, run, release. ``path`` and ``source``
    as :func:`read_script` gives them, ``argv`` the script's arguments."""

    def __init__(self, client: ServiceClient, request: LeaseRequest, path: str, source: str,
                 argv: list[str]) -> None:
        self.client, self.request = client, request
        self.path, self.source, self.argv = path, source, argv
        self.lease: Lease | None = None

    def go(self) -> int:
        """Run the script on a lease of its own and release it, also after a
        failure or a signal (SIGTERM, SIGHUP: exit 128 + the signal). Returns
        the exit status; raises GPUPoolError for what gpupool could not do."""
        previous = {sig: signal.signal(sig, _abandon) for sig in (signal.SIGTERM, signal.SIGHUP)}
        started = time.monotonic()
        try:
            try:
                self.lease = self.client.create_lease(self.request, start_wait=START_WAIT_S)
            except GPUPoolError as exc:  # a refused option is named as typed: --idle-timeout, not idle_timeout
                raise option_words(exc) from None
            self.lease = wait_started(self.client, self.lease, started, START_TIMEOUT, stream=sys.stderr,
                                      rewrite=sys.stderr.isatty())
            lease = self.lease

            def announce(elsewhere: str | None) -> None:  # once the worker is in its folder
                where = f"; in {elsewhere}" if elsewhere else ""
                _say(f"running {os.path.basename(self.path)} on {lease.id}: {slice_words(lease)}, "
                     f"{memory_words(lease)}{host_words(lease)}; {lease.lease_class}{where} "
                     f"[{time.monotonic() - started:.1f}s]")

            return run_script(self.client, lease, self.source, self.path, self.argv, _ask_terminal, announce)
        except KeyboardInterrupt:  # while queued or starting: give the request up
            print(file=sys.stderr)
            _say("interrupted; the request was cancelled" if self.lease else "interrupted")
            return 130
        except Abandoned as exc:
            _say(exc.why)
            return exc.status
        finally:
            self._release()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _release(self) -> None:
        """Give the lease back (idempotent at the service) and say so; never
        raises. A SIGTERM or SIGHUP meanwhile is ignored (``timeout`` and
        process managers send one to the process and one to its group); a
        Ctrl-C gives the wait up and says what is true (:meth:`_interrupted_words`)."""
        if self.lease is None:
            return
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            cancel(self.client, self.lease.id, reason="gpupool run finished")
            lease = self.client.get_lease(self.lease.id)
            if lease.started_at:
                _say(released_words(lease))
        except GPUPoolError:
            return
        except KeyboardInterrupt:
            print(file=sys.stderr)
            _say(self._interrupted_words())
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _interrupted_words(self) -> str:
        """What a Ctrl-C during :meth:`_release` leaves, in words: the release may
        have gone through before it (the service's answer was on its way), so the
        service is asked once, briefly; ``released L-7 after ...`` when it did, else
        that the lease may still be held, where to see it and when the service
        reclaims it (its heartbeats stopped with the script)."""
        lease_id, ttl = self.lease.id, self.lease.heartbeat_ttl
        reclaim = (f"the service reclaims it within {format_duration(ttl)}" if ttl else
                   "the service reclaims it") + " now that its heartbeats stopped"
        try:
            lease = self.client.get_lease(lease_id, timeout=QUICK_LOOK_S)
        except (GPUPoolError, KeyboardInterrupt):  # the service is slow, or a second Ctrl-C: it is not known
            return (f"interrupted while releasing {lease_id}: it may still be held (gpupool status lists your "
                    f"leases); {reclaim}")
        if lease.state.ended:
            return released_words(lease)
        if lease.state is LeaseState.releasing:  # the service has it in hand
            return f"interrupted; the service is releasing {lease_id}"
        return (f"interrupted before {lease_id} was released: it may still be held (gpupool status lists your "
                f"leases); {reclaim}")


def _abandon(signum: int, frame) -> None:
    """SIGTERM or SIGHUP: stop at once, releasing the lease on the way out
    (deaf to more of them from here: see :meth:`ScriptRun._release`)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise Abandoned(f"stopped by {signal.Signals(signum).name}", 128 + signum)


def _ask_terminal(request: dict) -> str:
    """Answer the script's ``input()`` from this process's stdin; EOF is
    passed on (the script's ``input()`` raises EOFError)."""
    prompt = request.get("prompt", "")
    try:
        return getpass.getpass(prompt) if request.get("password") else input(prompt)
    except EOFError:
        return "\x04"  # ipykernel raises EOFError in the script for this reply


def _say(text: str) -> None:
    print(f"gpupool: {text}", file=sys.stderr, flush=True)
