"""The ``gpupool`` command line.

    gpupool --version
    gpupool service [--ip IP] [--port N] [--state-dir DIR] [--config FILE] | --generate-config
    gpupool agent --service-url URL [--simulate 2xA100-80GB] [--name NODE] ... | --generate-config
    gpupool kernelspec install [--name gpupool] [--url URL] [--token-file F]
    gpupool demo [--keep-state]
    gpupool status [--url URL] [--token-file F] [--json]
    gpupool pool [--url URL] [--token-file F] [--json]
    gpupool quota [show|list|set SCOPE LIMIT=VALUE...|unset SCOPE|usage] [--json]
    gpupool run [--gpus 0.5|2] [--memory 20GiB] [--wait 10m] [--interactive] ... script.py [args...]
    gpupool health URL        (exit 0 when it answers 200; else 1, with the reason in words)
    gpupool simulate --workload sensei|openb [--policy ...] [--pool-size N,...]

``service`` and ``agent`` are traitlets applications: their ``--help`` lists
every setting, ``--generate-config`` prints a config file with every setting
commented out, and a config file (``gpupool_config.py`` or the hub's
``jupyterhub_config.py``) sets the same traits. The other commands are small
and parse their arguments here.

Each role installs its own extra (``gpupool[hub]``, ``gpupool[agent]``,
``gpupool[kernel]``); a command whose packages are missing says which extra to
install instead of printing a ModuleNotFoundError.
"""

from __future__ import annotations

import importlib
import sys

from . import __version__
from .errors import GPUPoolError
from .extras import extras_providing

#: command -> (module that has its ``main(argv)``, one line for the usage, the extra it needs).
#: Imported only when run, so a notebook host never imports the service or the agent.
COMMANDS = {
    "service": ("gpupool.hub_plugin.app", "run the pool service (REST API, scheduler, SQL store)", "hub"),
    "agent": ("gpupool.node.agent", "run the node agent: GPU inventory, workers, heartbeats", "agent"),
    "kernelspec": ("gpupool.magics.kernelspec",
                   "install the 'gpupool' Jupyter kernelspec (kernelspec install --help)", "kernel"),
    "demo": ("gpupool.demo", "start a pool on this machine and run examples/quickstart.ipynb end to end", "all"),
    "status": ("gpupool.status", "show the pool's nodes, GPUs and your leases as a table", None),
    "pool": ("gpupool.status",
             "show the pool's nodes and GPUs as a table (and worker environments where a node offers a choice)", None),
    "quota": ("gpupool.quota_cli", "show your quota and usage; admins: set or unset quota overrides", None),
    "run": ("gpupool.run_cli", "run a Python script on a pooled GPU (a batch lease), streaming its output here",
            None),
    "health": ("gpupool.health_cli", "ask a health endpoint (an agent's /health) and say why it is not ready",
               None),
    "simulate": ("gpupool.hub_plugin.simulate.cli",
                 "replay a workload trace against the scheduler and reclaim rules (capacity planning)", "simulate"),
}

#: Commands that are traitlets applications: ``--generate-config`` prints their config file.
_APPS = {"service": ("gpupool.hub_plugin.app", "ServiceApp"), "agent": ("gpupool.node.agent", "NodeAgent")}


def _usage() -> str:
    lines = ["usage: gpupool COMMAND [options]", "       gpupool --version", "", "GPU pooling for Jupyter.", "",
             "commands:"]
    lines += [f"  {name:<11} {text}" for name, (_, text, _) in COMMANDS.items()]
    lines += ["", "Run 'gpupool COMMAND --help' for a command's options."]
    return "\n".join(lines)


def missing_extra(command: str, exc: ModuleNotFoundError) -> str | None:
    """Words naming the extra to install when ``exc`` is a package of one
    (``"gpupool service needs the 'hub' extra: pip install 'gpupool[hub]' (missing: sqlalchemy)"``):
    the command's own extra where it brings the module, else the first that names it
    (:func:`.extras.extras_providing`, from the installed distribution's requirements).
    None when the missing module belongs to no extra (a real bug: re-raise it)."""
    top = (exc.name or "").partition(".")[0]
    owners = extras_providing(top)
    if not owners:
        return None
    extra = COMMANDS[command][2]
    if extra not in owners:
        extra = owners[0]
    return f"gpupool {command} needs the '{extra}' extra: pip install 'gpupool[{extra}]' (missing module: {top})"


def generate_config(command: str) -> str:
    """The config file of ``command`` (``service``/``agent``): every setting, commented out, with its help."""
    module, name = _APPS[command]
    return getattr(importlib.import_module(module), name)().generate_config_file()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpupool`` script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a usage error, as argparse's: the usage on stderr, exit 2 (an unknown command's too)
        print(f"gpupool: a command is required\n\n{_usage()}", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("--version", "-V"):
        print(f"gpupool {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"gpupool: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        if command in _APPS and "--generate-config" in rest:
            print(generate_config(command))
            return 0
        module = importlib.import_module(COMMANDS[command][0])
        if command == "pool":
            return module.pool_main(rest) or 0
        return module.main(rest) or 0
    except GPUPoolError as exc:
        print(f"gpupool {command}: {exc.message}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        words = missing_extra(command, exc)
        if words is None:
            raise
        print(words, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `gpupool status | head`: the reader left; nothing to say
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
