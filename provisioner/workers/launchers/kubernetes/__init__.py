"""Workers as Kubernetes pods on the agent's node (docs/launchers.md, "Kubernetes").

- :mod:`.pods`: a lease's worker pod and its connection Secret (pure: the
  lease, the agent's pod template and the settings in, manifests out);
- :mod:`.client`: :class:`PodClient`, the API calls (official ``kubernetes``
  client, ``gpupool[kubernetes]``), kept apart so the builder stays pure;
- :mod:`.launcher`: :class:`KubernetesLauncher`, the settings
  (``c.KubernetesLauncher.image = ...``).

Nothing here imports ``kubernetes`` until a :class:`PodClient` is made.
"""

from .client import PodClient, PodError
from .launcher import KubernetesLauncher
from .pods import OwnerPod, PodSettings, WorkerPorts, connection_info, connection_secret, pod_name, worker_pod

__all__ = ["KubernetesLauncher", "OwnerPod", "PodClient", "PodError", "PodSettings", "WorkerPorts",
           "connection_info", "connection_secret", "pod_name", "worker_pod"]
