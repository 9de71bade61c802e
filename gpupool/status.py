"""``gpupool status``: the pool's nodes and GPUs, and your leases, as tables."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .api import ENV_TOKEN, ENV_URL, ServiceClient
from .tables import gpu_utilization, lease_table, pool_table


def main(argv: list[str] | None = None) -> int:
    """Print the pool table and the caller's leases; returns 0."""
    parser = argparse.ArgumentParser(prog="gpupool status", description="Show the pool's nodes and GPUs, and your leases, as tables.")
    parser.add_argument("--url", default=os.environ.get(ENV_URL), help=f"service URL (default: ${ENV_URL})")
    parser.add_argument("--token", default=os.environ.get(ENV_TOKEN), help=f"API token (default: ${ENV_TOKEN})")
    parser.add_argument("--token-file", type=Path, help="read the API token from this file")
    parser.add_argument("--all", action="store_true", help="also list leases that have ended")
    args = parser.parse_args(argv)
    if not args.url:
        parser.error(f"no service URL: pass --url or set {ENV_URL}")
    token = _read_token(args.token_file, parser) if args.token_file else args.token
    client = ServiceClient(args.url, token)
    pool = client.pool()
    print(pool_table(pool)[0])
    leases = client.list_leases(active=not args.all)
    print()
    print(lease_table(leases, gpu_utilization(pool))[0] if leases else "no leases")
    return 0


def _read_token(path: Path, parser: argparse.ArgumentParser) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:
        parser.error(f"cannot read the token file {path}: {exc.strerror}")
