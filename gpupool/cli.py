"""The ``gpupool`` command line.

    gpupool service [--ip IP] [--port N] [--state-dir DIR] [--config FILE]
    gpupool agent --service-url URL [--simulate 2xA100-80GB] [--name NODE] ...
    gpupool kernelspec install [--name gpupool] [--url URL] [--token-file F]
    gpupool demo [--keep-state]
    gpupool status [--url URL] [--token-file F]
    gpupool quota [show|list|set SCOPE LIMIT=VALUE...|unset SCOPE|usage]
    gpupool simulate --workload sensei|openb [--policy ...] [--pool-size N,...]

``service`` and ``agent`` are traitlets applications: their ``--help`` lists
every setting, and a config file (``gpupool_config.py`` or the hub's
``jupyterhub_config.py``) sets the same traits. The other commands are small
and parse their arguments here.
"""

from __future__ import annotations

import importlib
import sys

from .errors import GPUPoolError

#: command -> (module that has its ``main(argv)``, one line for the usage). Imported
#: only when run, so a notebook host never imports the service or the agent.
_COMMANDS = {
    "service": ("gpupool.hub_plugin.app", "run the pool service (REST API, scheduler, SQL store)"),
    "agent": ("gpupool.provisioner.agent", "run the node agent: GPU inventory, workers, heartbeats"),
    "kernelspec": ("gpupool.provisioner.kernelspec",
                   "install the 'gpupool' Jupyter kernelspec (kernelspec install --help)"),
    "demo": ("gpupool.demo", "start a pool on this machine and run examples/quickstart.ipynb end to end"),
    "status": ("gpupool.status", "show the pool's nodes, GPUs and your leases as a table"),
    "quota": ("gpupool.quota_cli", "show your quota and usage; admins: set or unset quota overrides"),
    "simulate": ("gpupool.hub_plugin.simulator",
                 "replay a workload trace against the scheduler and reclaim rules (capacity planning)"),
}


def _usage() -> str:
    lines = ["usage: gpupool COMMAND [options]", "", "GPU pooling for Jupyter.", "", "commands:"]
    lines += [f"  {name:<11} {text}" for name, (_, text) in _COMMANDS.items()]
    lines += ["", "Run 'gpupool COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpupool`` script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in _COMMANDS:
        print(f"gpupool: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        return importlib.import_module(_COMMANDS[command][0]).main(rest) or 0
    except GPUPoolError as exc:
        print(f"gpupool {command}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `gpupool status | head`: the reader left; nothing to say
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())

