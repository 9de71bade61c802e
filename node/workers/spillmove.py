"""A move of a spilled lease to another node (docs/parking.md, "The
agent's part"): the agent that holds the spill serves its manifest
(:func:`manifest`) and its namespace file, and the agent of the node the
lease moves to fetches both into its own spill folder (:func:`fetch_spill`),
node to node, before it loads them into a new worker as any spill
(:meth:`.spilling.Spilling.resume`).

Both ends are agents of one pool: they share the agent token and trust the
same CA (``c.NodeAgent.ca_file``, as for the service).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gpupool.errors import GPUPoolError, Reason
from gpupool.tls import untrusted, untrusted_message
from gpupool.units import format_bytes
from gpupool.wire.nodes import GPUInfo

from .parkstate import NAMESPACE, Spilled

#: Seconds to connect to the agent holding a spill, and for it to answer the manifest: it reads one small file.
CONNECT_TIMEOUT_S = 10.0
#: Bytes read from the namespace file at a time when serving it (and gathered before a write when fetching it).
CHUNK_BYTES = 1 << 20
#: Bytes of a refusal's body kept for its words.
_ERROR_BODY_BYTES = 1 << 16


@dataclass(frozen=True)
class SpillSource:
    """How this node fetches spills from the other agents of its pool: the
    ``tls`` context that verifies an ``https://`` agent (the one the agent
    checks the service with), the agent ``token`` (a callable: the agent
    reads its token file again before each registration), and ``timeout``,
    seconds for the whole namespace (``c.AgentParking.spill_fetch_timeout``)."""

    tls: ssl.SSLContext | None
    token: Callable[[], str]
    timeout: float


class FetchError(Exception):
    """The spill could not be fetched; the words say why (the words of
    :func:`fetch_spill`'s 502 follow them)."""


def manifest(spill: Spilled, size: int) -> dict[str, Any]:
    """What ``GET /workers/{lease_id}/spill`` answers: the spill's manifest
    without its local folder, and ``namespace_bytes``, the ``size`` of its
    namespace file."""
    return {"lease_id": spill.lease_id, "owner": spill.owner, "gpus": [g.to_json() for g in spill.gpus],
            "fraction": spill.fraction, "memory": spill.memory, "since": spill.since,
            "disk_bytes": spill.disk_bytes, "lost": list(spill.lost), "idle_since": spill.idle_since,
            "names": list(spill.names), "namespace_bytes": size}


def spilled_from(body: Any, lease_id: str, folder: Path) -> tuple[Spilled, int]:
    """A fetched manifest as this node's :class:`Spilled` in ``folder``, and
    the namespace's size in bytes; FetchError for a body that is not one."""
    try:
        spill = Spilled(str(body["lease_id"]), str(body["owner"]), folder,
                        tuple(GPUInfo.from_json(g) for g in body["gpus"]), float(body["fraction"]),
                        int(body["memory"]), float(body["since"]), int(body.get("disk_bytes", 0)),
                        tuple(str(w) for w in body.get("lost", ())), body.get("idle_since"),
                        tuple(str(n) for n in body.get("names", ())))
        size = int(body["namespace_bytes"])
    except Exception as exc:  # KeyError, TypeError, ValueError, GPUPoolError: not a manifest
        raise FetchError(f"its answer is not a spill's manifest ({exc})") from None
    if spill.lease_id != lease_id or size < 0:
        raise FetchError(f"its manifest is of lease {spill.lease_id!r}, {size} bytes")
    return spill, size


async def fetch_spill(source: SpillSource, url: str, lease_id: str, owner: str, spill_dir: Path,
                      log: logging.Logger) -> Spilled:
    """Fetch the spill of ``lease_id`` from the agent at ``url`` into
    ``spill_dir/lease_id`` (a new folder, the agent's only: the namespace
    under a temporary name until it is whole, then the manifest, which makes
    it a spill a restarted agent finds) and return it; the caller registers
    it. Call under the lease's lock, with no spill of the lease here.

    409 ``invalid_state`` when the spill there is another owner's; 502
    ``park_failed`` when it cannot be fetched (unreachable, refused, cut
    short, a size that does not match, no room here): either way nothing is left here and
    the spill stays on the other node."""
    url = url.rstrip("/")
    folder = spill_dir / lease_id
    began = time.monotonic()
    from tornado.httpclient import AsyncHTTPClient  # here: what imports the manager need not load tornado's client

    # max_body_size: tornado's default (100 MB) bounds a streamed body too; a state may be many GiB.
    http = AsyncHTTPClient(force_instance=True, max_body_size=1 << 60)
    try:
        body = await _manifest(http, source, url, lease_id)
        spill, size = spilled_from(body, lease_id, folder)
        if spill.owner != owner:
            raise GPUPoolError(Reason.invalid_state, f"the spill of lease {lease_id} at {url} is not {owner}'s: "
                               "nothing was fetched, nothing changed", 409,
                               log_message=f"lease {lease_id}: the spill at {url} is {spill.owner}'s, the resume "
                               f"asked for {owner}'s; nothing fetched")
        spill_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        shutil.rmtree(folder, ignore_errors=True)  # a leftover of a fetch cut short
        free = shutil.disk_usage(spill_dir).free
        if free < size:
            raise FetchError(f"this node's spill folder {spill_dir} has {format_bytes(free)} free, the spill "
                             f"holds {format_bytes(size)} (c.AgentParking.spill_dir)")
        folder.mkdir(mode=0o700)
        got = await _namespace(http, source, url, lease_id, folder / f"{NAMESPACE}.part")
        if got != size:
            raise FetchError(f"it sent {got} bytes of a namespace of {size}")
        os.replace(folder / f"{NAMESPACE}.part", spill.namespace)
        await asyncio.to_thread(spill.write)
    except FetchError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise GPUPoolError(Reason.park_failed, f"could not fetch the spill of lease {lease_id} from {url}: {exc}; "
                           "it stays on the other node", 502) from None
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        http.close()
    seconds = time.monotonic() - began
    log.info("fetched the spill of lease %s from %s: %d bytes (%s) in %.1fs", lease_id, url, size,
             format_bytes(size), seconds)
    return spill


async def _manifest(http: Any, source: SpillSource, url: str, lease_id: str) -> Any:
    """The manifest the agent at ``url`` serves; FetchError when it does not."""
    from tornado.httpclient import HTTPRequest

    request = HTTPRequest(f"{url}/workers/{lease_id}/spill", headers=auth_headers(source), follow_redirects=False,
                          connect_timeout=CONNECT_TIMEOUT_S, request_timeout=2 * CONNECT_TIMEOUT_S,
                          ssl_options=source.tls)
    response = await answer_of(http, request, url)
    if response.code != 200:
        raise FetchError(refusal_words(response.code, response.body or b""))
    try:
        return json.loads(response.body)
    except ValueError:
        raise FetchError(f"its answer to GET /workers/{lease_id}/spill is not JSON") from None


async def _namespace(http: Any, source: SpillSource, url: str, lease_id: str, path: Path) -> int:
    """Stream the namespace file the agent at ``url`` serves into ``path`` (a
    new file, the agent's only); returns the bytes written. FetchError when
    the answer is not the file (its words), or is cut short."""
    from tornado.httpclient import HTTPRequest

    status: list[int] = []
    refusal = bytearray()
    pending: list[bytes] = []
    written = pending_bytes = 0
    failed: list[OSError] = []  # this node's disk, not the other agent, when a write fails
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)

    def on_header(line: str) -> None:
        if not status and line.startswith("HTTP/"):
            parts = line.split(" ", 2)
            status.append(int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0)

    def write(chunks: list[bytes]) -> None:
        data = memoryview(b"".join(chunks))
        while data:
            data = data[os.write(fd, data):]

    async def on_chunk(chunk: bytes) -> None:  # awaited by tornado before it reads on: the disk sets the pace
        nonlocal written, pending_bytes
        if status[:1] != [200]:
            refusal.extend(chunk[:_ERROR_BODY_BYTES - len(refusal)])
            return
        pending.append(chunk)
        written += len(chunk)
        pending_bytes += len(chunk)
        if pending_bytes >= CHUNK_BYTES:
            chunks = pending[:]
            pending.clear()
            pending_bytes = 0
            try:
                await asyncio.to_thread(write, chunks)
            except OSError as exc:
                failed.append(exc)
                raise

    request = HTTPRequest(f"{url}/workers/{lease_id}/spill/namespace", headers=auth_headers(source),
                          follow_redirects=False, decompress_response=False, connect_timeout=CONNECT_TIMEOUT_S,
                          request_timeout=source.timeout, ssl_options=source.tls, header_callback=on_header,
                          streaming_callback=on_chunk)
    try:
        try:
            response = await answer_of(http, request, url, source.timeout)
        except FetchError:
            if failed:
                raise FetchError(f"could not write it to {path.parent}: {failed[0]}") from None
            raise
        if response.code != 200:
            raise FetchError(refusal_words(response.code, bytes(refusal)))
        try:
            await asyncio.to_thread(write, pending)
        except OSError as exc:
            raise FetchError(f"could not write it to {path.parent}: {exc}") from None
    finally:
        os.close(fd)
    return written


def auth_headers(source: SpillSource) -> dict[str, str]:
    return {"Authorization": f"token {source.token()}"}


async def answer_of(http: Any, request: Any, url: str, timeout: float | None = None,
                    doing: str = "send the whole namespace") -> Any:
    """``http.fetch(request)``, any status; FetchError when no whole HTTP
    answer came (refused, no route, a certificate not trusted, a timeout, a
    connection cut), in words. ``timeout``: the setting's, named with what
    the agent was ``doing`` when it ran out."""
    from tornado.httpclient import HTTPClientError
    from tornado.simple_httpclient import HTTPStreamClosedError, HTTPTimeoutError

    try:
        return await http.fetch(request, raise_error=False)  # still raises where no answer came
    except HTTPTimeoutError as exc:
        if "during request" not in str(exc):  # tornado's words for a timeout once connected
            raise FetchError(f"cannot reach it (no connection within {CONNECT_TIMEOUT_S:g} s)") from None
        if timeout is None:
            raise FetchError(f"it did not answer within {2 * CONNECT_TIMEOUT_S:g} s") from None
        raise FetchError(f"it did not {doing} within {timeout:g} s "
                         "(c.AgentParking.spill_fetch_timeout)") from None
    except HTTPStreamClosedError:
        raise FetchError("its answer was cut short (the connection closed)") from None
    except (OSError, HTTPClientError) as exc:
        raise FetchError(_no_answer(exc, url)) from None


def _no_answer(exc: BaseException | None, url: str) -> str:
    why = untrusted(exc)
    if why:
        return untrusted_message(f"the node agent at {url}", why)
    return f"cannot reach it ({exc})"


def refusal_words(status: int, body: bytes) -> str:
    """Words for an agent's refusal: its own message, else its status."""
    try:
        message = json.loads(body).get("message")
    except (ValueError, AttributeError):
        message = None
    if status in (401, 403):
        return (f"it refused the agent token (HTTP {status}{': ' + message if message else ''}); the agents of a "
                "pool must share one token (--token-file)")
    return f"HTTP {status}: {message}" if message else f"it answered HTTP {status}"
