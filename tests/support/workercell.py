"""Run one cell on a worker the way a notebook client would, without a notebook kernel.

For the tests (and ``bench/gpu_check.py``) that check what a worker does; the
pool they talk to is :mod:`gpupool.demo_pool`'s.
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio
from jupyter_client import BlockingKernelClient

from gpupool.kernelconn import connect_channel, kernel_session


def worker_client(connection: dict, timeout: float = 60) -> BlockingKernelClient:
    """A jupyter_client to the worker of a lease's ``connection`` info, its
    channels started (not the heartbeat's: the pool watches workers) and the
    kernel ready; RuntimeError after ``timeout`` seconds. The caller stops
    its channels."""
    kc = BlockingKernelClient()
    kc.load_connection_info(connection)
    kc.start_channels(hb=False)
    try:
        kc.wait_for_ready(timeout=timeout)
    except BaseException:
        kc.stop_channels()
        raise
    return kc


async def run_worker_cell(connection: dict, code: str, timeout: float = 30) -> str:
    """Execute ``code`` on a worker, given a lease's ``connection`` info, the
    way a notebook client would (a CurveZMQ client with a key pair of its own
    when the worker encrypts, :mod:`gpupool.kernelconn`); returns its stdout.

    For checks and tests that talk to a worker without a notebook kernel.
    Raises RuntimeError naming the remote error when the cell fails, and
    TimeoutError after ``timeout`` seconds.
    """
    session = kernel_session(connection)
    context = zmq.asyncio.Context()

    async def execute(shell: zmq.asyncio.Socket, iopub: zmq.asyncio.Socket) -> tuple[dict, str]:
        # Ask until IOPub delivers anything (a status): subscribed, so no output can be missed.
        session.send(shell, "kernel_info_request", {})
        while not await iopub.poll(1000):
            session.send(shell, "kernel_info_request", {})
        msg_id = session.send(shell, "execute_request", {"code": code, "silent": False, "store_history": True,
                                                         "user_expressions": {}, "allow_stdin": False})["header"]["msg_id"]
        reply, idle, out = None, False, []
        poller = zmq.asyncio.Poller()
        poller.register(shell, zmq.POLLIN)
        poller.register(iopub, zmq.POLLIN)
        while reply is None or not idle:
            for sock, _ in await poller.poll():
                got = session.deserialize(session.feed_identities(await sock.recv_multipart())[1])
                if got["parent_header"].get("msg_id") != msg_id:
                    continue
                kind = got["header"]["msg_type"]
                if sock is shell:
                    reply = got["content"]
                elif kind == "stream":
                    out.append(got["content"]["text"])
                elif kind == "status":
                    idle = got["content"]["execution_state"] == "idle"
        return reply, "".join(out)

    try:
        reply, out = await asyncio.wait_for(execute(connect_channel(context, connection, "shell"),
                                                    connect_channel(context, connection, "iopub")), timeout)
    finally:
        context.destroy(linger=0)
    if reply.get("status") != "ok":
        raise RuntimeError(f"{reply.get('ename')}: {reply.get('evalue')}")
    return out
