"""Workers as Slurm jobs: whole GPUs as a lease's own job, slices as steps of
a share job that holds their GPU (docs/launchers.md, "Slurm").

- :mod:`.request`: what is asked of Slurm for a lease (pure: sbatch and srun
  command lines, GRES, CPUs, memory, the site's partition/account/QOS);
- :mod:`.state`: what Slurm says of a job or step (pure: scontrol's output
  parsed; the words a lease ends with when Slurm ended its job);
- :mod:`.record`: what the agent records to find a worker's job again (JSON);
- :mod:`.commands`: Slurm's clients, run without blocking the event loop;
- :mod:`.shares`: the share jobs that hold whole GPUs for slices;
- :mod:`.launcher`: :class:`SlurmLauncher`, the settings
  (``c.SlurmLauncher.partition = "gpu"``) and a worker's life in Slurm;
- :mod:`.handles`: the worker code's process and cgroup contracts over a
  Slurm job or step (liveness and Slurm's words, scancel, suspend);
- :mod:`.workers`: ``SlurmWorkers``, the agent's ``slurm`` launcher
  (``c.NodeAgent.worker_launcher = "slurm"``): start, re-adopt, sweep.

A separate package, not part of the ``local`` launcher's modules: nothing of
it runs unless a node's agent is configured for Slurm, and the local worker
code never imports it.
"""

from .commands import SlurmCommands, SlurmError
from .launcher import SlurmLauncher
from .record import SlurmWorkerRecord
from .request import JobSettings, Submission
from .state import SlurmJob, SlurmStep, end_reason

__all__ = ["JobSettings", "SlurmCommands", "SlurmError", "SlurmJob", "SlurmLauncher", "SlurmStep",
           "SlurmWorkerRecord", "Submission", "end_reason"]
