"""Where simulated GPU memory lives: the folder layout under one tmpfs root
(``$GPUPOOL_SIMGPU_ROOT``, default ``/dev/shm/gpupool-simgpu``) that the
worker's arrays (:mod:`.simgpu`), the simulated inventory's readings and the
``simulated`` checkpointer share: ``<GPU UUID>/<pid>-<n>`` per allocation,
``.binding/<pid>.json`` after a resume, ``.parked/<lease id>/`` for parked
copies (docs/parking.md, "Simulated GPU memory").
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT_ENV = "GPUPOOL_SIMGPU_ROOT"
DEFAULT_ROOT = "/dev/shm/gpupool-simgpu"
BINDING = ".binding"
PARKED = ".parked"
_FILE = re.compile(r"^(\d+)-(\d+)$")
_GPU_DIR = re.compile(r"^(GPU|MIG)-[A-Za-z0-9-]+$")


def root() -> Path:
    """The root folder, from ``$GPUPOOL_SIMGPU_ROOT`` (for tests: each run a folder of its own) or the default."""
    return Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT)


def gpu_dir(uuid: str, base: Path | None = None) -> Path:
    """The folder of GPU ``uuid``'s allocations; ValueError for a name that is no GPU UUID."""
    if not _GPU_DIR.match(uuid):
        raise ValueError(f"{uuid!r} is not a GPU UUID (GPU-... or MIG-...)")
    return (base or root()) / uuid


def prepare(uuids: list[str], base: Path | None = None) -> Path:
    """Make the layout for the GPUs ``uuids``, as the agent: the root and its
    ``.binding`` and ``.parked`` folders the agent's own (0755, 0755, 0700:
    a worker may read its binding, never touch another's, nor the host
    copies), each GPU's folder shared (:func:`make_shared`). A root left by
    another account is taken back (as root; an agent that is not root leaves
    it as it is: give each agent its own ``$GPUPOOL_SIMGPU_ROOT`` then).
    Returns the root. OSError when the folders cannot be made."""
    base = base or root()
    base.mkdir(parents=True, exist_ok=True)
    for folder, mode in ((base, 0o755), (base / BINDING, 0o755), (base / PARKED, 0o700)):
        folder.mkdir(exist_ok=True)
        try:
            if folder.stat().st_uid != os.geteuid() and os.geteuid() == 0:
                os.chown(folder, 0, 0)
            folder.chmod(mode)
        except PermissionError:  # another account's agent made it (not root: it cannot be taken): shared then
            pass
    for uuid in uuids:
        make_shared(gpu_dir(uuid, base))
    return base


def make_shared(folder: Path) -> Path:
    """``folder`` made if needed, writable by every worker account and
    sticky (as /tmp is: each removes only its own files)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        folder.chmod(0o1777)
    except PermissionError:  # another account made it; it set the mode then
        pass
    return folder


@dataclass(frozen=True)
class AllocationFile:
    """One allocation file: its ``gpu`` (UUID), the ``pid`` that made it and
    its number ``n`` in that process, ``path``, ``size`` in bytes and
    ``resident`` bytes (its allocated pages: what the GPU holds)."""

    gpu: str
    pid: int
    n: int
    path: Path
    size: int
    resident: int


def allocations(base: Path | None = None, gpus: set[str] | None = None) -> list[AllocationFile]:
    """Every allocation file under the GPU folders of ``base`` (default
    :func:`root`), of the GPUs ``gpus`` only when given; files that vanish
    meanwhile are left out."""
    base = base or root()
    found = []
    try:
        folders = [entry for entry in os.scandir(base) if entry.is_dir() and _GPU_DIR.match(entry.name)]
    except FileNotFoundError:
        return []
    for folder in folders:
        if gpus is not None and folder.name not in gpus:
            continue
        try:
            entries = list(os.scandir(folder.path))
        except FileNotFoundError:
            continue
        for entry in entries:
            match = _FILE.match(entry.name)
            if not match:
                continue
            try:
                stat = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            found.append(AllocationFile(folder.name, int(match[1]), int(match[2]), Path(entry.path), stat.st_size,
                                    stat.st_blocks * 512))
    return found


def process_files(pid: int, base: Path | None = None) -> list[AllocationFile]:
    """The allocations of process ``pid`` on every GPU, by GPU and number."""
    return sorted((a for a in allocations(base) if a.pid == pid), key=lambda a: (a.gpu, a.n))


def binding_path(pid: int, base: Path | None = None) -> Path:
    return (base or root()) / BINDING / f"{pid}.json"


def write_binding(pid: int, gpus: list[str], limit: int | None, base: Path | None = None) -> None:
    """Tell process ``pid`` the GPUs it sees now (``gpus``, in its device
    order) and its memory limit per GPU (``limit`` bytes; None: none),
    atomically."""
    path = binding_path(pid, base)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)  # the agent's (prepare): no one else writes there
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": list(gpus), "limit": limit}))
    tmp.chmod(0o644)
    tmp.replace(path)


def read_binding(pid: int, base: Path | None = None) -> dict | None:
    """What :func:`write_binding` wrote for ``pid``, or None."""
    try:
        return json.loads(binding_path(pid, base).read_text())
    except (OSError, ValueError):
        return None


def _alive_since(pid: int, cache: dict[int, float | None]) -> float | None:
    """The start time of live process ``pid`` (epoch seconds), or None when it is gone."""
    if pid not in cache:
        try:
            proc = psutil.Process(pid)
            cache[pid] = None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
        except psutil.Error:
            cache[pid] = None
    return cache[pid]


def sweep(base: Path | None = None) -> list[Path]:
    """Remove the allocation and binding files of processes that are gone
    (no such pid, or a process that started after the file was made: the pid
    was reused). Returns the paths removed. Files of live processes, frozen
    ones too, stay."""
    base = base or root()
    cache: dict[int, float | None] = {}
    removed = []
    candidates = [(a.pid, a.path) for a in allocations(base)]
    try:
        candidates += [(int(p.stem), p) for p in (base / BINDING).glob("*.json") if p.stem.isdigit()]
    except OSError:
        pass
    for pid, path in candidates:
        started = _alive_since(pid, cache)
        try:
            made = path.stat().st_ctime
        except FileNotFoundError:
            continue
        # ctime moves with a rename or a punch, so only a clearly later start means reuse.
        if started is None or started > made + 1.0:
            try:
                path.unlink()
                removed.append(path)
            except (FileNotFoundError, PermissionError):
                pass
    return removed
