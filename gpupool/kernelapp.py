"""ipykernel's application without its shell-channel thread, for kernels
that have no subshells: the gpupool kernel and the workers.

ipykernel 7 reads the shell socket on a thread of its own and hands every
request to the main thread over an inproc socket pair, and every reply back
the same way, so that kernel subshells can run requests on other threads.
A kernel without subshells only pays for it: two thread hand-offs per
request. Without that thread, ipykernel reads the shell socket on the main
thread's event loop, as ipykernel 6 did (its code keeps that path).

A worker runs ``python -m gpupool.kernelapp -f CONNECTION_FILE`` (a plain
IPython kernel; the front end never asks a worker for a subshell, since the
gpupool kernel in front of it says it has none).
"""

from __future__ import annotations

from ipykernel.kernelapp import IPKernelApp

class NoSubshellKernelApp(IPKernelApp):
    """IPKernelApp whose shell socket is read on the main thread."""

    def init_sockets(self) -> None:
        super().init_sockets()
        self.shell_channel_thread = None  # made there, not started yet: init_kernel starts it


if __name__ == "__main__":
    NoSubshellKernelApp.launch_instance()
