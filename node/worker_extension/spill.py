"""A worker's namespace saved to a file of the node's spill folder, and loaded
into a new worker (docs/parking.md, the spill tier).

What is saved is what a pull of everything sends (:func:`.namespace.pull_header`,
pickled by :mod:`gpupool.transfer`): every user variable that pickles, each
with the device it came off, and the modules as imports; what does not
pickle is listed by name with the reason, in words. The file:
an 8-byte big-endian header length, the JSON header (the pull's, plus
``"sizes"``, each buffer's bytes), then the buffers back to back, written
without copying them. Not synced to disk: the spill guards against the
budget, not against the host's crash, which ends its parked workers anyway.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from gpupool.dataplane import allocate
from gpupool.wire.transfer import PullAll

from .namespace import pull_header, restore

_LENGTH = struct.Struct(">Q")
#: What a cell that reaches a worker after its namespace was saved says (it is not run).
CELL_AFTER_SAVE = ("this cell reached the worker after its variables were saved to disk for a park, so it did not "
                   "run (what it did would have been lost with this worker); run it again: the lease resumes from "
                   "what was saved")


def save(ip, path: str) -> dict[str, Any]:
    """Write the namespace of ``ip`` to ``path`` (a new file); answers
    ``{"ok", "items", "types", "errors", "modules", "nbytes"}``: the names
    saved and ``{name: type}`` of each, ``{name: why}`` for those that could
    not be, the module names, and the file's size. From then on, while that
    file exists, the worker refuses cells
    (:meth:`gpupool.kernelapp.WorkerKernel.refuse_cells`)."""
    header, buffers = pull_header(ip, PullAll(outputs=True))
    header["sizes"] = [memoryview(b).nbytes for b in buffers]
    head = json.dumps(header).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _write(fd, _LENGTH.pack(len(head)) + head)
        for buffer in buffers:
            _write(fd, memoryview(buffer).cast("B"))
    finally:
        os.close(fd)
    refuse = getattr(getattr(ip, "kernel", None), "refuse_cells", None)
    if refuse is not None:  # the agent ends this process next: a cell still on its way would be lost with it
        refuse(CELL_AFTER_SAVE, path)
    return {"ok": True, "items": [item["name"] for item in header["items"]],
            "types": {item["name"]: item["type"] for item in header["items"]}, "errors": header["errors"],
            "modules": sorted(header.get("modules", {})), "nbytes": os.path.getsize(path)}


def _write(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def load(ip, path: str) -> dict[str, Any]:
    """Load what :func:`save` wrote at ``path`` into ``ip``'s namespace:
    values back on their devices where this worker has them, modules
    imported. Answers ``{"ok", "loaded", "errors"}`` (``{name: why}`` for
    each that did not come back as it was)."""
    with open(path, "rb", buffering=0) as file:
        (length,) = _LENGTH.unpack(_read(file, _LENGTH.size))
        header = json.loads(_read(file, length))
        buffers = []
        for size in header.get("sizes", []):
            buffer = allocate(int(size))
            done = 0
            while done < size:  # one read returns at most what the kernel moves at once
                got = file.readinto(buffer[done:])
                if not got:
                    raise ValueError(f"{path} ends before its buffers do")
                done += got
            buffers.append(buffer)
    return restore(ip, header, buffers)


def _read(file, size: int) -> bytes:
    data = file.read(size)
    if len(data) != size:
        raise ValueError("the spill file is cut short")
    return data
