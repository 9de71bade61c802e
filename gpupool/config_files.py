"""Reading ``--config`` files for ``gpupool service`` and ``gpupool agent``.

Both apps set ``raise_config_file_errors = True``: traitlets would otherwise log
``Exception while loading config file`` and go on with the defaults, so a file
that asked for ``worker_launcher = "slurm"`` and has a typo would serve without
Slurm. :func:`load_config_file` turns what the file raises into one line
(:class:`~gpupool.errors.GPUPoolError`, which ``gpupool`` prints, exit 1)
naming the file and the error, instead of a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import GPUPoolError, Reason


def load_config_file(app: Any, path: Path, flag: str = "--config") -> None:
    """Load ``path`` into the traitlets Application ``app`` (its command line
    stays above the file). Raises GPUPoolError ``not_configured`` when the file
    is missing, or running it raised (a SyntaxError, a NameError, a bad value):
    ``config file /etc/gpupool/gpupool_config.py: SyntaxError: '{' was never
    closed (gpupool_config.py, line 3) (--config)``."""
    if not path.is_file():
        raise GPUPoolError(Reason.not_configured, f"config file {path} does not exist ({flag})")
    try:
        app.load_config_file(path.name, path=str(path.parent))
    except Exception as exc:  # what the user's file raised; the traceback would only show traitlets' frames
        words = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        said = f"{type(exc).__name__}: {words}" if words else type(exc).__name__
        raise GPUPoolError(Reason.not_configured, f"config file {path}: {said} ({flag})") from None
