"""The gpupool kernel's application: :class:`gpupool.kernelapp.NoSubshellKernelApp`
(no shell-channel thread: the gpupool kernel has no subshells, since a
forwarded cell's sockets belong to the main thread) with the gpupool
kernel and output stream classes.

The kernel provisioner runs ``python -m gpupool.magics.kernelapp`` in place
of the kernelspec's ``-m ipykernel_launcher``.
"""

from __future__ import annotations

from traitlets import DottedObjectName, Type

from gpupool import ipykernel_private
from gpupool.kernelapp import NoSubshellKernelApp


class GPUPoolKernelApp(NoSubshellKernelApp):
    """The gpupool kernel's application."""

    name = "gpupool-kernel"
    private_names = ipykernel_private.NAMES
    kernel_class = Type("gpupool.magics.kernel.GPUPoolKernel", klass="gpupool.kernelapp.NoSubshellKernel",
                        help="The kernel class (default: gpupool's forwarding kernel).").tag(config=True)
    outstream_class = DottedObjectName("gpupool.magics.outstream.QuietOutStream",
                                       help="The class of sys.stdout and sys.stderr in the kernel (default: "
                                            "gpupool's, which skips empty flushes).").tag(config=True)


if __name__ == "__main__":
    GPUPoolKernelApp.launch_instance()
