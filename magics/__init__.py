"""The IPython extension of gpupool: ``%load_ext gpupool.magics``.

Adds ``%gpu``, ``%%gpu`` and ``%%local`` (see :mod:`gpupool.magics.magics`)
to any IPython. The gpupool kernel (:mod:`gpupool.magics.kernel`, which the
gpupool kernelspec starts) has them built in and forwards an attached
notebook's cells to the worker; elsewhere cells stay local and ``%%gpu``
runs one on the worker.

The notebook host's other parts live here too: the kernel provisioner
(:mod:`.kernel_provisioner`, which a Jupyter server imports through
jupyter_client's entry point) and the kernelspec (:mod:`.kernelspec`). So
that importing them does not need IPython, this package imports the magics
only when IPython loads the extension.

The magics (:mod:`.magics`) read each ``%gpu`` line (:mod:`.commands`) and
hand it to one object per concern: :mod:`.lifecycle` (the attachment, set
and cleared there only; workers got by :mod:`.attach`), :mod:`.transfers`
(variables), :mod:`.wait` (the queue, a resume, a park) and :mod:`.status`;
:mod:`.tell` tells the JupyterLab extension.
"""

from __future__ import annotations

import atexit
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .magics import GPUMagics

__all__ = ["load_ipython_extension", "unload_ipython_extension"]

_STATE: dict[int, GPUMagics] = {}


def load_ipython_extension(ip) -> None:
    """Register the magics on shell ``ip`` (nothing to do in the gpupool kernel)."""
    if getattr(getattr(ip, "kernel", None), "gpu", None) is not None:
        return
    from .magics import GPUMagics

    magics = GPUMagics(ip)
    ip.register_magics(magics)
    _STATE[id(ip)] = magics
    # A kernel stopped without the gpupool provisioner still gives its slice back.
    atexit.register(_release_on_exit, magics)


def unload_ipython_extension(ip) -> None:
    """Detach (discarding the worker's state)."""
    magics = _STATE.pop(id(ip), None)
    if magics is not None:
        _release_on_exit(magics)


def _release_on_exit(magics: GPUMagics) -> None:
    magics.lifecycle.close(reason="the notebook kernel exited")
