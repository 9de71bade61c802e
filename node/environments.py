"""Worker environments: the Pythons a node's workers may run in (``c.AgentWorkers.environments``).

An environment is a name and a Python interpreter, given as the interpreter's path or as a
conda/venv prefix (then ``PREFIX/bin/python``). It must hold ipykernel and gpupool's worker
part (``pip install 'gpupool[worker]'`` there). The agent checks each one when it starts
(:func:`check`: it runs the interpreter once and imports what a worker imports) and reports
every one, usable or not with the reason, at registration; a lease names one
(``LeaseRequest.env``, ``%gpu acquire 0.5 --env torch``), or gets the node's default.

The agent's own Python is always there as ``default`` unless an entry of that name replaces it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Mapping

from gpupool.wire.nodes import WorkerEnvironment

#: What a worker imports first: if this fails, the worker cannot start there.
PROBE = "import ipykernel, jupyter_client, gpupool.kernelapp, gpupool.node.worker_extension; print(ipykernel.__version__)"
PROBE_TIMEOUT_S = 60.0
DEFAULT_NAME = "default"


def interpreter(where: str) -> Path:
    """The Python of ``where``: the path itself when it is a file, else ``where/bin/python``."""
    path = Path(where).expanduser()
    return path if path.is_file() else path / "bin" / "python"


def check(name: str, where: str, *, default: bool = False, timeout: float = PROBE_TIMEOUT_S) -> WorkerEnvironment:
    """Run the environment's Python once (``PROBE``); never raises: a failure is
    ``usable=False`` with the reason in ``problem``, in words naming the fix."""
    python = interpreter(where)
    if str(python) == sys.executable:  # the agent's own: no process to start (agents start fast)
        missing = [m for m in ("ipykernel", "jupyter_client") if importlib.util.find_spec(m) is None]
        problem = f"no module {missing[0]}; pip install 'gpupool[worker]'" if missing else None
        return WorkerEnvironment(name, str(python), default, not missing, problem)
    if not python.is_file():
        return WorkerEnvironment(name, str(python), default, False,
                                 f"{python} does not exist (c.AgentWorkers.environments)")
    try:
        result = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return WorkerEnvironment(name, str(python), default, False, f"cannot run {python}: {exc}")
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return WorkerEnvironment(name, str(python), default, False,
                           f"{last}; install the worker part there: {python} -m pip install 'gpupool[worker]'")
    return WorkerEnvironment(name, str(python), default, True)


def check_all(configured: Mapping[str, str], default: str) -> list[WorkerEnvironment]:
    """Every configured environment plus the agent's own Python as ``default`` (unless
    configured under that name), checked; ``default`` names the default one (empty: the
    ``default`` entry). Raises ValueError when ``default`` names no environment."""
    entries = {DEFAULT_NAME: sys.executable, **dict(configured)}
    chosen = default or DEFAULT_NAME
    if chosen not in entries:
        raise ValueError(f"c.AgentWorkers.default_environment {chosen!r} is none of the environments "
                         f"({', '.join(sorted(entries))})")
    return [check(name, where, default=name == chosen) for name, where in sorted(entries.items())]


def choose(environments: list[WorkerEnvironment], name: str | None) -> WorkerEnvironment:
    """The environment a worker request names (None: the default). Raises
    ValueError in words when it is unknown or unusable here."""
    by_name = {env.name: env for env in environments}
    if name is None:
        env = next(env for env in environments if env.default)
    elif name not in by_name:
        raise ValueError(f"this node has no environment {name!r}; it has: {', '.join(sorted(by_name))}")
    else:
        env = by_name[name]
    if not env.usable:
        raise ValueError(f"environment {env.name!r} cannot run workers on this node: {env.problem}")
    return env
