"""The IPython extension of gpupool: ``%load_ext gpupool.magics``.

Adds ``%gpu``, ``%%gpu`` and ``%%local`` (see :mod:`gpupool.magics.magics`)
and the input transformer that routes cells to the worker while attached.
The gpupool kernelspec loads it for you.
"""

from __future__ import annotations

import atexit

from .magics import GPUMagics

__all__ = ["GPUMagics", "load_ipython_extension", "unload_ipython_extension"]

_STATE: dict[int, GPUMagics] = {}


def load_ipython_extension(ip) -> None:
    """Register the magics and the routing transformer on shell ``ip``."""
    magics = GPUMagics(ip)
    ip.register_magics(magics)
    ip.input_transformers_cleanup.append(magics.route)
    _STATE[id(ip)] = magics
    # A kernel stopped without the gpupool provisioner still gives its slice back.
    atexit.register(_release_on_exit, magics)


def unload_ipython_extension(ip) -> None:
    """Detach (discarding the worker's state) and remove the transformer."""
    magics = _STATE.pop(id(ip), None)
    if magics is None:
        return
    if magics.route in ip.input_transformers_cleanup:
        ip.input_transformers_cleanup.remove(magics.route)
    _release_on_exit(magics)


def _release_on_exit(magics: GPUMagics) -> None:
    attachment, magics.attachment = magics.attachment, None
    if attachment is not None:
        try:
            attachment.release(reason="the notebook kernel exited")
        except Exception:  # best effort at exit; the service's heartbeat TTL is the backstop
            pass
