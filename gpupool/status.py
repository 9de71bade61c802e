"""``gpupool status``: the pool's nodes and GPUs, and your leases, as tables."""

from __future__ import annotations

import argparse

from .api import add_client_arguments, client_from_arguments
from .tables import gpu_utilization, lease_table, pool_table


def main(argv: list[str] | None = None) -> int:
    """Print the pool table and the caller's leases; returns 0."""
    parser = argparse.ArgumentParser(prog="gpupool status", description="Show the pool's nodes and GPUs, and your leases, as tables.")
    add_client_arguments(parser)
    parser.add_argument("--all", action="store_true", help="also list leases that have ended")
    args = parser.parse_args(argv)
    client = client_from_arguments(parser, args)
    pool = client.pool()
    print(pool_table(pool)[0])
    leases = client.list_leases(active=not args.all)
    print()
    print(lease_table(leases, gpu_utilization(pool))[0] if leases else "no leases")
    return 0

