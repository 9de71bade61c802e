"""Binding a warm worker to its lease (docs/enforcement.md, "Binding a worker to its GPUs")."""

from __future__ import annotations

import ctypes  # here, not in cuda_initialised: the import (about 2 ms) is then paid as the worker starts, not in a bind
import os
import sys

from .torch_cap import cap_torch_at_cuda_init, cap_torch_on_import

#: cuDeviceGetCount's answer before cuInit (CUDA driver API, CUresult).
_CUDA_ERROR_NOT_INITIALIZED = 3


def bind(env: dict[str, str]) -> None:
    """Bind this worker, started warm (no GPU visible), to a lease's slice.

    Called once by the agent, through a silent ``execute_request``, before the
    lease's owner gets the connection. ``env``: the slice's variables
    (:func:`gpupool.node.enforcement.slice_environment`), put into
    ``os.environ``; CUDA reads ``CUDA_VISIBLE_DEVICES`` and the MPS limits
    when it initialises, so they bind as if the process had started with
    them. The PyTorch memory cap is armed as for a cold worker: on import, or
    at CUDA's lazy initialisation when ``torch`` was preloaded.

    Raises RuntimeError, changing nothing, when the worker is already bound
    (a warm worker serves one lease) or when CUDA is already initialised in
    this process (the variables would no longer hold).
    """
    bound = os.environ.get("GPUPOOL_LEASE_ID")
    if bound:
        raise RuntimeError(f"this worker is already bound to lease {bound}")
    if cuda_initialised():
        raise RuntimeError("CUDA is already initialised in this worker: it can no longer be bound to a GPU")
    os.environ.update(env)
    if not env.get("GPUPOOL_MEMORY_LIMIT"):
        return
    torch = sys.modules.get("torch")
    if torch is None:
        cap_torch_on_import()
    else:
        cap_torch_at_cuda_init(torch)


def cuda_initialised() -> bool:
    """True when CUDA was initialised in this process: PyTorch says so, or
    the CUDA driver library is loaded and answers anything but
    CUDA_ERROR_NOT_INITIALIZED (covers JAX, CuPy, TensorFlow alike)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    try:  # RTLD_NOLOAD: only a library this process loaded already; never loads it
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    count = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED
