"""Workers as Slurm jobs: whole GPUs as a lease's own job, slices as steps of
a share job that holds their GPU (docs/launchers.md, "Slurm"; its modules:
docs/code.md).
"""

from .commands import SlurmCommands, SlurmError
from .launcher import SlurmLauncher
from .record import SlurmWorkerRecord
from .request import JobSettings, Submission
from .state import SlurmJob, SlurmStep, end_reason

__all__ = ["JobSettings", "SlurmCommands", "SlurmError", "SlurmJob", "SlurmLauncher", "SlurmStep",
           "SlurmWorkerRecord", "Submission", "end_reason"]
