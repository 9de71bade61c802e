"""The data plane against the comm path (buffers in comm messages), same worker, same run.

A worker kernel with gpupool's extension (CurveZMQ or plain, as the agent
starts one, with a ``transfer_port``), spoken to directly: each round pushes
and pulls one NumPy array once with the buffers in the comm message (the
path taken when the connection info has no ``transfer_port``) and
once on the data plane, interleaved; prints MiB/s per round. No notebook
kernel in between, so this isolates the transport. Run from the repository root:

    .venv/bin/python bench/dataplane_ab.py [--mib 64 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import numpy as np
from jupyter_client import KernelManager

from gpupool.magics import dataplane
from gpupool.remote import RemoteKernel
from gpupool.transfer import load_pulled
from gpupool.wire.transfer import TARGET, Pull


class _WorkerManager(KernelManager):
    def write_connection_file(self, **kwargs):
        with socket.socket() as probe:  # as the agent does (node/workers/kernel.py)
            probe.bind((self.ip, 0))
            kwargs.setdefault("transfer_port", probe.getsockname()[1])
        super().write_connection_file(**kwargs)


def one_worker(encrypted: bool, sizes: list[int], rounds: int) -> dict:
    km = _WorkerManager(kernel_name="python3", ip="127.0.0.1",
                        transport_encryption="required" if encrypted else "disabled")
    km.start_kernel(extra_arguments=["--IPKernelApp.extra_extensions=gpupool.node.worker_extension"])
    with open(km.connection_file) as handle:
        info = {k: v for k, v in json.load(handle).items() if k != "curve_secretkey"}
    remote = RemoteKernel(info)
    try:
        remote.wait_ready(60)

        def comm(request, buffers):
            answer, got = remote.comm_request(TARGET, request.to_json(), buffers)
            assert answer.get("ok"), answer
            return answer, got

        paths = {"comm": {k: v for k, v in info.items() if k != "transfer_port"}, "dataplane": info}
        out: dict = {}
        for mib in sizes:
            array = np.ones(mib << 20, np.uint8)
            for _ in range(rounds):
                for name, connection in paths.items():
                    start = time.perf_counter()
                    dataplane.push(comm, connection, {"a": array}, {}, progress=False)
                    pushed = time.perf_counter() - start
                    start = time.perf_counter()
                    load_pulled(*dataplane.pull(comm, connection, Pull(names=["a"]), progress=False))
                    pulled = time.perf_counter() - start
                    out.setdefault(f"{mib} MiB {name}", []).append((round(mib / pushed), round(mib / pulled)))
        return out
    finally:
        remote.close()
        km.shutdown_kernel(now=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[64, 256], help="array sizes in MiB")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per size (default 3)")
    args = parser.parse_args()
    for encrypted in (True, False):
        results = one_worker(encrypted, args.mib, args.rounds)
        print(f"{'curve' if encrypted else 'none'} (load {os.getloadavg()[0]:.1f}): push/pull MiB/s per round")
        for key, rows in results.items():
            print(f"  {key}: {rows}")


if __name__ == "__main__":
    main()
