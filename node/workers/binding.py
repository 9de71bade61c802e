"""Code the agent runs in a warm worker: the preload when it starts, and the
binding that hands it to a lease.

Binding puts the slice's variables into the worker's ``os.environ``
(:func:`gpupool.node.worker_extension.bind`, before CUDA initialises there)
instead of booting a kernel; docs/enforcement.md, "Binding a worker to its
GPUs", says why that holds the worker to its GPUs as a cold start does.

A bind is on a lease's attach path, so what it can pay ahead it pays when the
warm worker starts (:func:`prepare`): the shell connection it sends on (with
CurveZMQ, a handshake) and the kernel's first ``execute_request``, which costs
a few ms more than the next ones (bench/REPORT.md, "Attach latency").
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping, Sequence

from gpupool.schema import WorkerState

from ..activity import WorkerActivity
from .handle import Worker
from .spec import WORKER_EXTENSION, WorkerBindError, WorkerSpec

#: Seconds a warm worker gets to answer its binding.
BIND_TIMEOUT_S = 10.0

#: The environment of a warm worker before it is bound: no GPU visible, so
#: nothing that initialises CUDA early can use a GPU no lease holds.
UNBOUND_ENVIRONMENT = {"CUDA_VISIBLE_DEVICES": ""}


def bind_code(slice_env: Mapping[str, str]) -> str:
    """The code the agent runs in a warm worker (a silent ``execute_request``)
    to bind it to ``slice_env``: a call of
    :func:`gpupool.node.worker_extension.bind`. Only string names and values, so
    ``repr`` is an exact Python literal."""
    env = {str(name): str(value) for name, value in slice_env.items()}
    return f"__import__({WORKER_EXTENSION!r}, fromlist=['bind']).bind({env!r})"


def preload_code(modules: Sequence[str]) -> str:
    """The code that imports ``modules`` in a warm worker without binding a
    name in the user's namespace; it fails (ImportError) on the first module
    that cannot be imported, which fails the warm start."""
    return "".join(f"__import__({name!r})\n" for name in modules)


def shell_client(worker: Worker) -> Any:
    """A client of ``worker``'s shell channel only (the agent needs no other to run code), on the
    node's shared ZMQ context. A warm worker keeps this client until its bind; with a context of
    its own (jupyter_client's default), one never closed (its worker abandoned) would be garbage
    collected with its socket still open, and ZeroMQ's context termination waits for ever then."""
    client = worker.manager.client(context=worker.manager.context)
    client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    return client


async def execute(client: Any, code: str, timeout: float) -> dict[str, Any]:
    """Run ``code`` silently (no history, no execution count) through the
    worker's shell ``client``; returns the ``execute_reply`` content;
    TimeoutError after ``timeout`` seconds. The agent alone holds a warm
    worker's key, so no one else can send it code meanwhile."""
    reply = await client.execute(code, silent=True, store_history=False, allow_stdin=False,
                                 reply=True, timeout=timeout)
    return reply["content"]


async def prepare(worker: Worker, code: str, timeout: float) -> dict[str, Any]:
    """Run a warm worker's first ``code`` (its preload, else ``pass``) and keep
    the shell client it ran on for the bind (``worker.bind_client``) when it
    ran; returns the ``execute_reply`` content. Raises what :func:`execute`
    raises (the client closed then)."""
    client = shell_client(worker)
    try:
        reply = await execute(client, code, timeout)
    except BaseException:
        client.stop_channels()
        raise
    if reply.get("status") == "ok":
        worker.bind_client = client
    else:
        client.stop_channels()
    return reply


async def bind(worker: Worker, spec: WorkerSpec, slice_env: Mapping[str, str], timeout: float) -> None:
    """Bind a warm worker to ``spec``: put ``slice_env`` in its
    ``os.environ`` (:func:`~gpupool.node.worker_extension.bind` refuses when
    CUDA is initialised there already). From then on it is ``spec``'s
    worker, idle since now, as a cold worker is idle since it answered.
    WorkerBindError when it refused or did not answer within ``timeout``."""
    # A fresh activity, not ready until bound: what the warm worker did
    # before (its start, the preload) is not the lease's.
    worker.activity = WorkerActivity()
    client, worker.bind_client = worker.bind_client or shell_client(worker), None
    try:
        # A healthy worker answers in milliseconds; one that does not is
        # replaced by a cold start well within the service's start timeout.
        reply = await execute(client, bind_code(slice_env), min(BIND_TIMEOUT_S, timeout))
    except Exception as exc:  # noqa: BLE001 - died, timed out: the caller falls back to a cold start
        raise WorkerBindError(f"it did not answer the binding: {exc or type(exc).__name__}") from None
    finally:
        client.stop_channels()
    if reply.get("status") != "ok":
        raise WorkerBindError(f"{reply.get('ename', 'error')}: {reply.get('evalue', '')}")
    worker.spec, worker.name = spec, spec.lease_id
    worker.activity.mark_ready()
    # ipykernel publishes the binding's "idle" status just after its reply:
    # wait for it (a few ms), so the lease's first report says idle, as a
    # cold worker's does.
    for _ in range(250):
        if worker.activity.execution_state == WorkerState.idle:
            break
        await asyncio.sleep(0.004)
