"""The worker's end of the ``gpupool.transfer`` comm
(:mod:`gpupool.wire.transfer`): one request per comm (its open message),
answered and closed. Ops: ``push``, ``pull`` and ``pull_all`` move
variables (:mod:`.namespace`); ``have``, ``versions``, ``attach``,
``fetch`` (a move from another worker, :mod:`.move`) and ``gpu_memory``
(what ``%gpu status`` lists, :mod:`.gpumemory`) are the remoting ops
(REMOTING_OPS); ``forget_traceback``, ``park_gpu``, ``resume_gpu``,
``spill`` and ``load_spill`` are the agent's, for parking
(:mod:`.lasttraceback`, :mod:`.offload`, :mod:`.spill`; PARKING_OPS)."""

from __future__ import annotations

import logging
import sys
from typing import Any

from . import dataplane, gpumemory, lasttraceback, move, offload, spill
from gpupool.transfer import load_values, package_versions
from gpupool.wire.transfer import Attach, GpuMemory, Have, Op, Pulling, Push, Request, read_request

from .devices import place_on_devices
from .namespace import pull_header
from .workdir import enter_workdir, take_home

log = logging.getLogger("gpupool.worker")


def serve(ip, comm, msg, plane=None) -> None:
    """Answer one request (the comm's open message) and close the comm.
    ``plane``: the worker's data plane (:mod:`.dataplane`),
    which carries big buffers when the request has a ``stream`` ticket."""
    data = msg["content"]["data"]
    op = data.get("op")
    try:
        request = read_request(data)
        if request is None:
            comm.send({"ok": False, "message": f"unknown transfer op {op!r}"})
        elif isinstance(request, Push):
            comm.send(_push(ip, request, msg.get("buffers") or [], plane))
        elif isinstance(request, Pulling):
            header, buffers = dataplane.offer_pull(plane, request, *pull_header(ip, request))
            comm.send({"ok": True, "header": header}, buffers=buffers)
        elif request.OP in REMOTING_OPS:
            comm.send(REMOTING_OPS[request.OP](ip, request))
        else:
            comm.send(PARKING_OPS[request.OP](ip, request))
    except dataplane.TransferError as exc:  # its words are for the user as they are
        comm.send({"ok": False, "message": str(exc)})
    except Exception as exc:  # the client shows this; the worker stays up
        log.exception("transfer %s failed", op)
        comm.send({"ok": False, "message": f"{type(exc).__name__}: {exc}"})
    finally:
        comm.close()


def _push(ip, request: Push, buffers: list, plane) -> dict[str, Any]:
    """Op ``push``: the values into the namespace, each on its device; the
    buffers came in the comm message (``buffers``) or on the data plane."""
    if request.stream:
        buffers = dataplane.pushed_buffers(plane, request)
    values, errors = load_values(request.header, buffers)
    errors.update(place_on_devices(values, request.devices or {}))
    ip.user_ns.update(values)
    return {"ok": True, "loaded": sorted(values), "errors": errors}


def _have(ip, request: Have) -> dict[str, Any]:
    """Op ``have``: which of the request's names the worker's namespace holds."""
    return {"ok": True, "have": [n for n in request.names if n in ip.user_ns]}


def _versions(ip, request: Request) -> dict[str, Any]:
    """Op ``versions``: Python and key package versions (see package_versions)."""
    return {"ok": True, "versions": package_versions()}


def _attach(ip, request: Attach) -> dict[str, Any]:
    """Op ``attach``, sent once by the gpupool kernel when it attaches: take
    the notebook's execution count (so prompts, ``Out[n]`` and tracebacks'
    ``Cell In[n]`` agree), its working directory (:func:`.workdir.enter_workdir`)
    and its home (:func:`.workdir.take_home`). Answers ``{"ok", "cwd",
    "notebook_dir": bool, "home"}``."""
    if isinstance(request.execution_count, int):
        ip.execution_count = request.execution_count
    cwd, followed = enter_workdir(request.cwd, request.user or "user")
    return {"ok": True, "cwd": cwd, "notebook_dir": followed, "home": take_home(request.home)}


def _gpu_memory(ip, request: GpuMemory) -> dict[str, Any]:
    """Op ``gpu_memory``: the names holding GPU memory, the ``top`` largest
    (default 10; :func:`.gpumemory.listing`)."""
    return gpumemory.listing(ip, max(0, int(request.top)))


def _forget_traceback(ip, request: Request) -> dict[str, Any]:
    """Op ``forget_traceback``, the agent's before a park: drop the last
    traceback so its frames' GPU memory is freed instead of moved (PyTorch's
    cache emptied too, for a checkpointer that moves what the driver holds).
    Answers ``{"ok", "cleared": its label, or None when none was kept}``."""
    cleared = lasttraceback.forget(ip)
    torch = sys.modules.get("torch")
    if cleared and torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return {"ok": True, "cleared": cleared}


REMOTING_OPS = {Op.have: _have, Op.versions: _versions, Op.attach: _attach, Op.gpu_memory: _gpu_memory,
                Op.fetch: move.fetch}
#: The agent's ops while it parks this worker: the last traceback dropped, GPU memory to
#: host memory and back (the framework checkpointer), the namespace to a spill file and back.
PARKING_OPS = {Op.forget_traceback: _forget_traceback,
               Op.park_gpu: lambda ip, request: offload.park(), Op.resume_gpu: lambda ip, request: offload.resume(),
               Op.spill: lambda ip, request: spill.save(ip, str(request.path)),
               Op.load_spill: lambda ip, request: spill.load(ip, str(request.path))}
