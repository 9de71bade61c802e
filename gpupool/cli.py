"""The ``gpupool`` command line.

    gpupool service [--ip IP] [--port N] [--state-dir DIR] [--config FILE]
    gpupool agent --service-url URL [--simulate 2xA100-80GB] [--name NODE] ...
    gpupool kernelspec install [--name gpupool] [--url URL] [--token-file F]
    gpupool demo [--keep-state]
    gpupool status [--url URL] [--token T]
    gpupool simulate --workload sensei|openb [--policy ...] [--pool-size N,...]

``service`` and ``agent`` are traitlets applications: their ``--help`` lists
every setting, and a config file (``gpupool_config.py`` or the hub's
``jupyterhub_config.py``) sets the same traits. The other commands are small
and parse their arguments here.
"""

from __future__ import annotations

import sys

from .errors import GPUPoolError

_COMMANDS = {
    "service": "run the pool service (REST API, scheduler, SQL store)",
    "agent": "run the node agent: GPU inventory, workers, heartbeats",
    "kernelspec": "install the 'gpupool' Jupyter kernelspec (kernelspec install --help)",
    "demo": "start a pool on this machine and run examples/quickstart.ipynb end to end",
    "status": "show the pool's nodes, GPUs and your leases as a table",
    "simulate": "replay a workload trace against the scheduler and reclaim rules (capacity planning)",
}


def _usage() -> str:
    lines = ["usage: gpupool COMMAND [options]", "", "GPU pooling for Jupyter.", "", "commands:"]
    lines += [f"  {name:<11} {text}" for name, text in _COMMANDS.items()]
    lines += ["", "Run 'gpupool COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpupool`` script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command == "service":
            from .hub_plugin.app import main as service_main

            return service_main(rest) or 0
        if command == "agent":
            from .provisioner.agent import main as agent_main

            return agent_main(rest) or 0
        if command == "kernelspec":
            from .provisioner.kernelspec import main as kernelspec_main

            return kernelspec_main(rest) or 0
        if command == "demo":
            from .demo import main as demo_main

            return demo_main(rest) or 0
        if command == "simulate":
            from .hub_plugin.simulator import main as simulate_main

            return simulate_main(rest) or 0
        if command == "status":
            from .status import main as status_main

            return status_main(rest) or 0
    except GPUPoolError as exc:
        print(f"gpupool {command}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(f"gpupool: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

