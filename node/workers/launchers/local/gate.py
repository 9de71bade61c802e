"""The start gate: a local worker's first process joins its cgroup
(:mod:`gpupool.node.cgroups`) before it runs a line of Python.

A kernel booted through jupyter_client (not forked from a template:
:mod:`.template`) is started behind a shell *start gate*
(:data:`START_GATE`) that waits on its stdin until the agent has put its pid
into the cgroup, then execs the kernel (same pid). So nothing the worker
starts, not even during ipykernel's own start, can be outside the cgroup; a
``preexec_fn`` would do the same but is unsafe in a process with threads
(the agent has ZMQ's and asyncio's), and runs after the switch to the worker
user, who may not move processes between cgroups.

Only the local launcher uses it: a Slurm job or step and a pod get their
cgroups from slurmd and the kubelet.
"""

from __future__ import annotations

import os
from typing import Any

from ....cgroups import LeaseCgroup
from ...kernel import WorkerKernelManager

#: The start gate (see the module's docstring): the kernel command follows
#: it; it runs the kernel only once the agent wrote ``go`` to its stdin,
#: which it then replaces with /dev/null.
START_GATE = ["/bin/sh", "-c", 'IFS= read -r go && [ "$go" = go ] && exec "$@" </dev/null', "gpupool-start-gate"]


class GatedKernelManager(WorkerKernelManager):
    """A :class:`~...kernel.WorkerKernelManager` whose ``cgroup``, when
    set, is joined through the :data:`START_GATE` before the kernel runs."""

    cgroup: LeaseCgroup | None = None

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        cmd = super().format_kernel_cmd(extra_arguments)
        return [*START_GATE, *cmd] if self.cgroup is not None else cmd

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        if self.cgroup is None:
            await super()._async_launch_kernel(kernel_cmd, **kw)
            return
        gate, opener = os.pipe()
        try:
            try:
                await super()._async_launch_kernel(kernel_cmd, stdin=gate, **kw)
            finally:
                os.close(gate)
            # The gate waits on its stdin: nothing of the worker runs yet.
            self.cgroup.add(self.provisioner.process.pid)
            os.write(opener, b"go\n")
        finally:
            os.close(opener)  # without "go", the gate exits (code 1) and the start fails
