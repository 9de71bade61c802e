"""A move from memory (docs/parking.md, "The agent's part"): a lease parked in memory
on one node resumes on another without its state touching a disk. The old
node's worker, thawed with its GPU state in its host memory, offers its
whole namespace on its data plane (:func:`offer`, the agent's
``POST /workers/{id}/offer``); the new node's agent starts a new worker,
which takes it from there, worker to worker, node to node, and restores it
(:func:`take`; the worker's ``fetch`` op, as a move ``%gpu acquire`` makes).

The ticket for those bytes (a fresh key and id, encrypted whenever the old
worker's channels are) is the old agent's, sent to the new one in the
offer's answer: the agents of a pool share the agent token and trust the
same CA (:mod:`.spillmove`). What cannot travel (a lock, an open socket)
is named, as a spill names what it cannot save. A move that fails leaves
the old worker offered: the service then moves the lease through the old
node's disk (its spill reads the offered worker as it is), and an offer
nobody takes is spilled after ``c.AgentParking.spill_fetch_timeout``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from gpupool.dataplane import Ticket, streams_for
from gpupool.errors import GPUPoolError, Reason
from gpupool.schema import WorkerState
from gpupool.wire.parking import WorkerResumed
from gpupool.wire.transfer import Fetch, PullAll

from ..cgroups import CgroupError
from ..checkpoint import CheckpointError
from ..checkpoint.framework import ask
from .handle import Worker
from .spec import WorkerSpec, WorkerStartError
from .spillmove import CONNECT_TIMEOUT_S, FetchError, SpillSource, answer_of, auth_headers, refusal_words
from .spilling import lost_words

if TYPE_CHECKING:
    import logging

    from .manager import WorkerManager
    from .parking import WorkerParking


async def offer(parking: WorkerParking, worker: Worker, owner: str, timeout: float) -> dict[str, Any]:
    """Offer the namespace of ``worker``, parked in memory, on its data plane
    for a move to another node; the answer of ``POST /workers/{id}/offer``:
    ``lease_id``, ``source`` (the worker's ``ip`` and
    ``transfer_port``), ``stream`` (the ticket and the buffers' ``sizes``)
    and ``header`` (its ``pull_all`` header, naming what cannot travel).
    Under the lease's lock; ``owner``: whose lease the new node resumes;
    ``timeout``: seconds the worker may take to pack it. 409
    ``invalid_state``, with nothing changed, for another owner's worker, one
    not parked in memory or frozen mid-cell (a move would interrupt it), or
    one without a data plane; 502
    ``park_failed`` when its state cannot be made readable or it does not
    answer (it stays offered: a spill takes it as it is)."""
    lease, parked = worker.name, worker.parked
    if worker.spec.owner != owner:
        raise GPUPoolError(Reason.invalid_state, f"the worker of lease {lease} here is not {owner}'s: nothing moved, "
                           "nothing changed", 409, log_message=f"lease {lease}: an offer asked for {owner}'s worker, "
                           f"which is {worker.spec.owner}'s; refused")
    if parked is None:
        raise GPUPoolError(Reason.invalid_state, f"the worker of lease {lease} is not parked in memory on this node: "
                           "it has nothing to offer", 409)
    if parked.execution_state == WorkerState.busy and not parked.offered:
        raise GPUPoolError(Reason.invalid_state, f"the worker of lease {lease} is frozen mid-cell: a move would "
                           "interrupt its cell, so it resumes on this node only", 409)
    connection = worker.connection()
    if not connection.get("transfer_port"):
        raise GPUPoolError(Reason.invalid_state, f"the worker of lease {lease} has no data plane (transfer_port): it "
                           "moves through the disk only", 409)
    try:
        if not parked.offered:
            await parking.checkpointer.to_host(parking.target(worker), parked.moved)
            await parking.thaw(worker)
            worker.parked = parked.but(offered=True)
            worker.record().write(parking.manager.workers_dir)
        ticket = Ticket.new(encrypted=bool(connection.get("curve_publickey")), streams=streams_for(0))
        request = PullAll(stream=ticket.wire(), stream_all=True, outputs=True)
        answer = await asyncio.to_thread(ask, connection, request, timeout)
    except (CheckpointError, CgroupError) as exc:
        raise GPUPoolError(Reason.park_failed, f"could not offer the worker of lease {lease} for a move: {exc}",
                           502) from None
    header = dict(answer["header"])
    sizes = header.pop("stream")["sizes"]
    parking.log.info("offered the namespace of lease %s for a move: %d buffer(s), %d bytes", lease, len(sizes),
                     sum(sizes))
    return {"lease_id": lease, "header": header,
            "source": {"ip": connection["ip"], "transfer_port": connection["transfer_port"]},
            "stream": {**ticket.wire(), "sizes": sizes}}


async def take(manager: WorkerManager, spec: WorkerSpec, url: str, source: SpillSource,
               log: logging.Logger) -> WorkerResumed:
    """Move the lease of ``spec``, parked in memory on the agent at ``url``,
    into a new worker here on ``spec``'s GPUs: ask that agent's offer while
    the new worker starts, then the new worker takes the namespace from the
    old one's data plane. Under the lease's lock, with no worker of it here.
    Its answer (``tier: memory``; ``lost``: what could not travel or did not
    load). 409 ``invalid_state`` for another owner's lease; 502
    ``park_failed`` (or ``worker_start_failed``) when it cannot be done:
    nothing of the lease is left here, its worker stays on the old node."""
    lease, url = spec.lease_id, url.rstrip("/")
    began = time.monotonic()
    starting = asyncio.ensure_future(manager.start_locked(spec))
    try:
        offered = await _ask_offer(source, url, lease, spec.owner)
        worker = await starting
    except BaseException as exc:
        await _never_mind(manager, starting, lease)
        if isinstance(exc, WorkerStartError):
            raise GPUPoolError(Reason.worker_start_failed, f"{exc}; it stays parked on the other node ({url})",
                               502) from None
        raise
    request = Fetch(source=offered["source"], stream=offered["stream"], header=offered["header"])
    try:
        answer = await asyncio.to_thread(ask, worker.connection(), request, source.timeout)
    except CheckpointError as exc:
        await manager.stop_locked(lease)
        raise GPUPoolError(Reason.park_failed, f"could not move lease {lease} from {url} worker to worker: {exc}; "
                           "it stays parked on the other node", 502) from None
    lost = (*lost_words(offered["header"].get("errors") or {}, "moved", offered["header"].get("types")),
            *lost_words(answer.get("errors") or {}, "loaded"))
    seconds = time.monotonic() - began
    log.info("moved lease %s from %s into a new worker (pid %s) in %.1fs, worker to worker: %d byte(s), %d name(s) "
             "loaded", lease, url, worker.pid, seconds, sum(offered["stream"]["sizes"]),
             len(answer.get("loaded", [])))
    return WorkerResumed(worker.pid, worker.connection(), "memory", round(seconds, 4), lost)


async def _never_mind(manager: WorkerManager, starting: asyncio.Future, lease: str) -> None:
    """Stop the new worker of a move that will not happen, once its start is over."""
    if not starting.done():
        await asyncio.wait({starting})
    if not starting.cancelled() and starting.exception() is None:
        await manager.stop_locked(lease)


async def _ask_offer(source: SpillSource, url: str, lease: str, owner: str) -> dict[str, Any]:
    """``POST {url}/workers/{lease}/offer`` for ``owner``: the old agent's
    offer; its 409 (another owner's lease) as it is, 502 ``park_failed``
    when there is no offer."""
    from tornado.httpclient import AsyncHTTPClient, HTTPRequest

    http = AsyncHTTPClient(force_instance=True)
    request = HTTPRequest(f"{url}/workers/{lease}/offer", method="POST", body=json.dumps({"owner": owner}),
                          headers={**auth_headers(source), "Content-Type": "application/json"},
                          follow_redirects=False, connect_timeout=CONNECT_TIMEOUT_S, request_timeout=source.timeout,
                          ssl_options=source.tls)
    try:
        response = await answer_of(http, request, url, source.timeout, "offer it")
        if response.code == 409:
            raise GPUPoolError(Reason.invalid_state, f"the agent at {url} refused to offer lease {lease}: "
                               f"{refusal_words(409, response.body or b'')}", 409)
        if response.code != 200:
            raise FetchError(refusal_words(response.code, response.body or b""))
        return _offer_of(response.body, lease)
    except FetchError as exc:
        raise GPUPoolError(Reason.park_failed, f"could not move lease {lease} from {url} worker to worker: {exc}; "
                           "it stays parked on the other node", 502) from None
    finally:
        http.close()


def _offer_of(body: bytes, lease: str) -> dict[str, Any]:
    """The offer in an answer's ``body``; FetchError when it is not one."""
    try:
        offered = json.loads(body)
        if not (isinstance(offered["header"], dict) and isinstance(offered["stream"]["sizes"], list)
                and isinstance(offered["source"]["ip"], str)):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise FetchError(f"its answer to POST /workers/{lease}/offer is not an offer") from None
    return offered
