"""The last traceback IPython keeps (``sys.last_traceback`` and friends, for
``%debug``): its frames' locals pin what they referred to, GPU tensors
included, until the next error replaces it. ``%gpu status`` lists it as a
holder (:mod:`.gpumemory`); a park clears it (:func:`forget`), so that its
memory can be freed instead of moved.
"""

from __future__ import annotations

import gc
import sys
import types
from typing import Iterator

#: Exceptions followed along ``__cause__`` / ``__context__`` from the last one.
CHAIN = 8
#: Frames looked at per traceback.
FRAMES = 200
#: Modules whose frames are the shell's own: their locals reach the whole namespace.
_SHELL_MODULES = ("IPython", "ipykernel", "asyncio", "tornado", "gpupool")
#: What IPython (and Python 3.12's ``sys.last_exc``) sets after an error in a cell.
_NAMES = ("last_type", "last_value", "last_traceback", "last_exc")


def last_exception() -> BaseException | None:
    """The exception IPython last showed, None when none is kept."""
    value = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return value if isinstance(value, BaseException) else None


def user_frames(ip, exc: BaseException) -> list[types.FrameType]:
    """The frames of ``exc``'s traceback (and of the exceptions it chains to)
    whose locals are the user's: not the shell's own frames, not a cell's
    top level (its locals are the namespace, whose names are listed as themselves)."""
    frames, seen = [], set()
    for tb in _tracebacks(exc):
        for _ in range(FRAMES):
            if tb is None:
                break
            frame = tb.tb_frame
            if id(frame) not in seen and not _shells(ip, frame):
                seen.add(id(frame))
                frames.append(frame)
            tb = tb.tb_next
    return frames


def _tracebacks(exc: BaseException) -> Iterator[types.TracebackType | None]:
    seen: set[int] = set()
    first = getattr(sys, "last_traceback", None)
    if first is not None:
        yield first
    while exc is not None and id(exc) not in seen and len(seen) < CHAIN:
        seen.add(id(exc))
        if exc.__traceback__ is not first:
            yield exc.__traceback__
        exc = exc.__cause__ or exc.__context__


def _shells(ip, frame: types.FrameType) -> bool:
    if frame.f_globals.get("__name__", "").split(".")[0] in _SHELL_MODULES:
        return True
    # A cell's top level runs with the namespace as its globals and locals.
    return frame.f_code.co_name == "<module>" and frame.f_globals is ip.user_ns


def cells(ip, exc: BaseException) -> str:
    """Where ``exc`` went through, in IPython's words: ``"Cell In[3]"``,
    ``"Cell In[3], Cell In[5]"``, or the files' names for code outside cells."""
    names: list[str] = []
    for tb in _tracebacks(exc):
        for _ in range(FRAMES):
            if tb is None:
                break
            frame = tb.tb_frame
            if frame.f_globals.get("__name__", "").split(".")[0] not in _SHELL_MODULES:
                name = _cell_name(ip, frame.f_code.co_filename)
                if name not in names:
                    names.append(name)
            tb = tb.tb_next
    return ", ".join(names) or "the shell"


def _cell_name(ip, filename: str) -> str:
    formatted = getattr(getattr(ip, "compile", None), "format_code_name", lambda name: None)(filename)
    return " ".join(formatted) if formatted else filename.rpartition("/")[2]


def label(ip, exc: BaseException) -> str:
    """``"last traceback (ZeroDivisionError; frames of Cell In[3])"``: the holder's name in a listing."""
    return f"last traceback ({type(exc).__name__}; frames of {cells(ip, exc)})"


def forget(ip) -> str | None:
    """Drop the last traceback (``sys.last_*``, the shell's ``_last_traceback``
    and last execution result's error) and clear its user frames' locals (a
    reference kept elsewhere to the exception no longer pins them); the
    :func:`label` of what was dropped, None when none was kept. Called before a park."""
    exc = last_exception()
    if exc is None and getattr(sys, "last_traceback", None) is None:
        return None
    words = label(ip, exc) if exc is not None else "last traceback"
    for frame in user_frames(ip, exc) if exc is not None else ():
        try:
            frame.clear()
        except RuntimeError:  # still running (a generator's frame): left as it is
            continue
        # Python 3.11 keeps the locals dict that reading f_locals made (the traceback's formatting,
        # a listing) past clear(); reading it again syncs it with the cleared frame: empty.
        _ = frame.f_locals
    for name in _NAMES:
        if hasattr(sys, name):
            delattr(sys, name)
    if getattr(ip, "_last_traceback", None) is not None:
        ip._last_traceback = None
    result = getattr(ip, "last_execution_result", None)
    if getattr(result, "error_in_exec", None) is exc:
        result.error_in_exec = None
    del exc
    gc.collect()  # frames sit in reference cycles with their exception
    return words
