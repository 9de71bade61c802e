"""One daemon per state directory.

The service and the agent each keep what they own under a state directory
(the SQLite store and tokens; worker records and connection files). Two of
the same kind on one directory would fight over it: two services would each
decide on their own in-memory view of the pool, and a starting agent takes
over (or kills) every worker it finds there. So each holds an exclusive
lock on a file in it for its whole life.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import GPUPoolError, Reason


def lock_state_dir(state_dir: Path, kind: str) -> int:
    """Hold ``STATE_DIR/{kind}.lock`` for this process's life; returns its
    descriptor (keep it open). The kernel drops the lock when the process
    ends, kill -9 included; child processes do not inherit it (``O_CLOEXEC``).
    Raises GPUPoolError ``not_configured`` when another live ``kind`` holds it."""
    fd = os.open(state_dir / f"{kind}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise GPUPoolError(Reason.not_configured, f"another {kind} is running with the state directory {state_dir}; "
                           f"give each {kind} its own --state-dir") from None
    return fd
