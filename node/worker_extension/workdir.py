"""The worker's working directory: the notebook's folder where this node
sees it, else a scratch folder of the user's own."""

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
