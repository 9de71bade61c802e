"""Workers as Kubernetes pods on the agent's node (docs/launchers.md,
"Kubernetes"; its modules: docs/code.md). Nothing here imports
``kubernetes`` until a :class:`PodClient` is made.
"""

from .client import PodClient, PodError
from .launcher import KubernetesLauncher
from .pods import OwnerPod, PodSettings, WorkerPorts, connection_info, connection_secret, pod_name, worker_pod

__all__ = ["KubernetesLauncher", "OwnerPod", "PodClient", "PodError", "PodSettings", "WorkerPorts",
           "connection_info", "connection_secret", "pod_name", "worker_pod"]
