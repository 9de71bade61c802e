"""IPython extension loaded into every worker kernel on a GPU node.

The agent starts each worker with ``--IPKernelApp.extra_extensions`` naming
this package. It gives the worker what the notebook's client relies on:

- the ``gpupool.transfer`` comm target (:mod:`.comm`; its requests are
  :mod:`gpupool.wire.transfer`'s), through which the
  client pushes variables into the worker and pulls them back (see
  :mod:`gpupool.transfer` for the wire shape); GPU tensors are moved to the
  CPU before they travel, with the device they were on, and a push can ask
  for them to be put back on it (:mod:`.devices`); the ``have`` and
  ``versions`` ops let the client send along only the names a cell needs and
  warn about package mismatches (docs/api.md); big buffers go over the
  worker's data plane (:mod:`.dataplane`, on the
  ``transfer_port`` of its connection file) instead of the comm message;
- ``%gpu`` inside a cell, asked of the notebook kernel (:mod:`.notebook_magic`);
- the PyTorch memory cap of the slice (:mod:`.torch_cap`): when the user's
  code imports ``torch`` and CUDA is available,
  ``torch.cuda.set_per_process_memory_fraction`` is set from
  ``GPUPOOL_MEMORY_LIMIT`` (PyTorch has no environment variable for it,
  unlike JAX's ``XLA_PYTHON_CLIENT_MEM_FRACTION``, which the agent sets).

The agent binds a warm worker to its lease with :func:`bind` (:mod:`.binding`).
"""

from __future__ import annotations

import os
import sys

from gpupool.wire.transfer import TARGET
from . import dataplane

from .binding import bind
from .comm import serve
from .notebook_magic import front_end_stdin, notebook_magic
from .torch_cap import cap_torch_on_import

__all__ = ["bind", "load_ipython_extension"]


def load_ipython_extension(ip) -> None:
    """Register the transfer comm target, the ``%gpu`` line magic that asks
    the notebook kernel (:func:`.notebook_magic.notebook_magic`), the front
    end's stdin rule and the PyTorch cap hook."""
    plane = dataplane.start_for_kernel()
    ip.kernel.comm_manager.register_target(TARGET, lambda comm, msg: serve(ip, comm, msg, plane))
    ip.register_magic_function(lambda line: notebook_magic(ip, line), "line", "gpu")
    ip.events.register("pre_run_cell", lambda info: front_end_stdin(ip))
    if os.environ.get("GPUPOOL_MEMORY_LIMIT") and "torch" not in sys.modules:
        cap_torch_on_import()
