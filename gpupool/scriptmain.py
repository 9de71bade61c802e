"""What ``gpupool run`` runs on the worker: a script as ``python script.py
args`` would run it. The module's source is sent to the worker with the
script's (the node needs no shared filesystem, nor this version of
gpupool), so it imports nothing but the standard library (and has no
``from __future__`` import, which would reach the script).

On the worker (an ipykernel), :func:`run_as_main` runs the script in a fresh
``__main__`` module: ``sys.argv`` is ``[path, *args]``, ``__file__`` the
path, ``sys.path[0]`` its folder, and its source is in ``linecache`` so
that a traceback shows its lines. It returns the exit status Python would
give: 0, the code of ``SystemExit`` (1 with the message printed for a
non-integer one), 1 after printing the traceback of an exception, 130
after a ``KeyboardInterrupt``'s. Writes to stdout and stderr keep their
order (:class:`_Ordered`) as in a terminal.
"""

import sys


class _Ordered:
    """A stream that flushes the other one of the pair before it writes, so
    that the two (ipykernel's buffered stdout and stderr) reach the client in
    the order they were written; costs one flush per switch of stream."""

    def __init__(self, stream, pair: list) -> None:
        self._stream, self._pair = stream, pair

    def write(self, text: str) -> int:
        last = self._pair[0]
        if last is not None and last is not self._stream:
            last.flush()
        self._pair[0] = self._stream
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def exit_status(exc: SystemExit) -> int:
    """The process status Python gives for ``exc``: ``None`` -> 0, an int as
    is (masked to 0..255 as the OS would), else 1 after printing the object
    to stderr."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def print_script_exception(exc: BaseException) -> None:
    """Print ``exc`` (raised in the script run by :func:`run_as_main`) to
    stderr as Python would: from the script's frame on, without the frames of
    ipykernel's ``input()`` and ``getpass()`` (built-ins, frameless under
    Python), and the end of stdin there in Python's words."""
    import traceback

    summary = traceback.TracebackException(type(exc), exc, exc.__traceback__.tb_next)
    in_kernel = False
    while len(summary.stack) > 1 and "ipykernel" in summary.stack[-1].filename:
        summary.stack.pop()
        in_kernel = True
    lines = list(summary.format())
    if in_kernel and isinstance(exc, EOFError) and not exc.args and lines[-1] == "EOFError\n":
        lines[-1] = "EOFError: EOF when reading a line\n"
    sys.stderr.write("".join(lines))


def run_as_main(source: str, path: str, argv: list[str]) -> int:
    """Run ``source`` (a script's text) as the ``__main__`` module of file
    ``path`` (absolute) with ``sys.argv[1:]`` = ``argv``; returns its exit
    status (see the module's docstring). ``sys.argv``, ``sys.path``,
    ``sys.modules["__main__"]`` and the streams are restored afterwards."""
    import builtins
    import linecache
    import os
    import types

    linecache.cache[path] = (len(source), None, source.splitlines(True), path)  # mtime None: never re-read
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__builtins__ = builtins
    saved = (sys.argv, list(sys.path), sys.modules.get("__main__"), sys.stdout, sys.stderr)
    pair = [None]
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    sys.modules["__main__"] = module
    sys.stdout, sys.stderr = _Ordered(sys.stdout, pair), _Ordered(sys.stderr, pair)
    try:
        # dont_inherit: the script's own __future__ imports, not those of the code calling this
        exec(compile(source, path, "exec", dont_inherit=True), module.__dict__)
        return 0
    except SystemExit as exc:
        return exit_status(exc)
    except BaseException as exc:  # as Python prints it: from the script's frame on, not this one
        print_script_exception(exc)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.argv, sys.path[:], main, sys.stdout, sys.stderr = saved
        if main is not None:
            sys.modules["__main__"] = main
