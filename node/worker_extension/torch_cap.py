"""The PyTorch memory cap of the slice: the caching allocator's fraction set
from ``GPUPOOL_MEMORY_LIMIT`` on each visible GPU, armed without importing
``torch`` or initialising CUDA before the user's code does."""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys

log = logging.getLogger("gpupool.worker")


def cap_torch_on_import() -> None:
    """Set the cap right after the user's code first imports ``torch``."""
    sys.meta_path.insert(0, AfterImport("torch", cap_torch_memory))


def cap_torch_at_cuda_init(torch) -> None:
    """Set the cap when PyTorch initialises CUDA, not now: initialising it at
    bind time would cost every lease a CUDA context, used or not.
    ``torch.cuda._lazy_call`` (private, used by ``torch.cuda.manual_seed``)
    queues the call for ``torch.cuda._lazy_init``."""
    try:
        torch.cuda._lazy_call(lambda: cap_torch_memory(torch))
    except Exception:  # an older or newer PyTorch without it: no cap, as for raw CUDA
        log.warning("could not arm the PyTorch memory cap", exc_info=True)


def cap_torch_memory(torch) -> None:
    """Set the caching allocator's cap to the slice's memory on each visible GPU."""
    try:
        if not torch.cuda.is_available():
            return
        limit = int(os.environ["GPUPOOL_MEMORY_LIMIT"])
        for device in range(torch.cuda.device_count()):
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    except Exception:  # a cap that cannot be set must not break the user's import
        log.warning("could not set the PyTorch memory cap", exc_info=True)


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after ``name`` is first imported."""

    def __init__(self, name: str, callback) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, callback = spec.loader, self.callback

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                callback(module)

        spec.loader = _Loader()
        return spec
