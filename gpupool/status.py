"""``gpupool status`` and ``gpupool pool``: the pool's nodes and GPUs, and your
leases, as tables; with ``--json`` the service's JSON as it is, for scripts:

    gpupool status --json   # {"pool": GET /pool, "leases": [GET /leases ...]}
    gpupool pool --json     # GET /pool
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from .api import add_client_arguments, client_from_arguments
from .tables import cell_freezing, gpu_utilization, lease_table, pool_table


def _print_json(body: Any) -> None:
    print(json.dumps(body, indent=2, sort_keys=True, default=str))


def main(argv: list[str] | None = None) -> int:
    """Print the pool table and the caller's leases; returns 0."""
    parser = argparse.ArgumentParser(prog="gpupool status", description="Show the pool's nodes and GPUs, and your leases, as tables.")
    add_client_arguments(parser)
    parser.add_argument("--all", action="store_true", help="also list leases that have ended")
    parser.add_argument("--all-users", action="store_true",
                        help="every user's leases, with an owner column (pool admins only)")
    parser.add_argument("--json", action="store_true", help="print the service's JSON instead of tables")
    args = parser.parse_args(argv)
    client = client_from_arguments(parser, args)
    pool = client.pool()
    leases = client.list_leases(active=not args.all, all_users=args.all_users)
    if args.json:
        # Without "connection": its HMAC key is for the notebook kernel, not for a script's output.
        _print_json({"pool": pool, "leases": [{**{k: v for k, v in asdict(lease).items() if k != "connection"},
                                                "state": lease.state.value} for lease in leases]})
        return 0
    print(pool_table(pool)[0])
    print()
    # Yours only (GET /leases lists the caller's), while the pool table counts everyone's: say whose.
    print(lease_table(leases, gpu_utilization(pool), cell_freezing(pool), owners=args.all_users)[0] if leases
          else no_leases_words(args.all, args.all_users))
    return 0


def no_leases_words(ended_too: bool, all_users: bool = False) -> str:
    """What ``gpupool status`` prints when there is no lease to list: the caller's, not the pool's
    (whose table counts everyone's leases per GPU), unless ``all_users`` asked for everyone's."""
    if all_users:
        return "no user has leases, active or ended" if ended_too else "no user holds a lease"
    return ("you have no leases, active or ended" if ended_too else "you hold no leases") + \
        " (this lists your own; the pool table above counts everyone's)"


def pool_main(argv: list[str] | None = None) -> int:
    """``gpupool pool``: the pool table (and the worker environments where a node offers a choice); returns 0."""
    parser = argparse.ArgumentParser(prog="gpupool pool",
                                     description="Show the pool's nodes and GPUs, and the worker environments "
                                     "where a node offers a choice of them.")
    add_client_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print GET /pool's JSON instead of tables")
    args = parser.parse_args(argv)
    pool = client_from_arguments(parser, args).pool()
    if args.json:
        _print_json(pool)
        return 0
    print(pool_table(pool)[0])  # with the nodes' worker environments when they offer a choice
    return 0
