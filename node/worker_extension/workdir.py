"""The worker's working directory: the notebook's folder where this node
sees it, else a scratch folder of the user's own; and its home (``~``): the
notebook's where this node sees it."""

from __future__ import annotations

import os
import re
import tempfile


def enter_workdir(path: str | None, user: str) -> tuple[str, bool]:
    """Change into the notebook's folder ``path`` when this node sees it and
    this worker's account may enter and read it (shared home); else into a
    scratch folder of ``user``'s own under ``GPUPOOL_SCRATCH_DIR`` (default:
    the system temp dir's ``gpupool-scratch``), made 0700. Tried as the
    worker's own account, so the permission check is the kernel's own.
    Returns ``(folder now current, whether it is the notebook's)``."""
    if path and os.path.isdir(path) and os.access(path, os.R_OK | os.X_OK):
        os.chdir(path)
        return path, True
    root = os.environ.get("GPUPOOL_SCRATCH_DIR") or os.path.join(tempfile.gettempdir(), "gpupool-scratch")
    if not os.path.isdir(root):  # shared by every worker account of the node, like /tmp (sticky)
        os.makedirs(root, exist_ok=True)
        os.chmod(root, 0o1777)
    scratch = os.path.join(root, re.sub(r"[^A-Za-z0-9._-]", "_", user) or "user")
    os.makedirs(scratch, mode=0o700, exist_ok=True)
    os.chdir(scratch)
    return scratch, False


def take_home(path: str | None) -> str:
    """Make the notebook's home ``path`` this worker's ``~`` (``HOME``, which
    ``os.path.expanduser`` and the shell read) when this node sees it and the
    worker's account may enter it, as :func:`enter_workdir` does the folder;
    else the worker keeps its account's. Returns the worker's home now."""
    if path and os.path.isabs(path) and os.path.isdir(path) and os.access(path, os.R_OK | os.X_OK):
        os.environ["HOME"] = path
    return os.path.expanduser("~")
