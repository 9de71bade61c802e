"""``KubernetesLauncher``: the settings of workers that run as pods on the
agent's node (``c.KubernetesLauncher.image = "registry.example.org/singleuser:1"``),
turned into :class:`~.pods.PodSettings`, and the agent's pod template.

This class holds the settings and builds a worker's pod and Secret and the
API client; :mod:`.workers` (``c.AgentWorkers.worker_launcher = "kubernetes"``)
runs the workers with them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from traitlets import Dict, Float, Integer, Unicode, default
from traitlets.config import LoggingConfigurable

from gpupool.traits import ByteSize

from .client import PodClient, PodError
from .pods import OwnerPod, PodSettings, WorkerPorts

#: The namespace of the pod's service account, where the kubelet mounts it.
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class KubernetesLauncher(LoggingConfigurable):
    """Workers as pods on the agent's node (:mod:`.pods`, :mod:`.client`)."""

    namespace = Unicode(
        "", help="""Namespace of the worker pods: the agent's own (its RBAC reaches no other). Default: the
        namespace of the agent's service account. ``c.KubernetesLauncher.namespace = "gpupool-agents"``.""",
    ).tag(config=True)

    @default("namespace")
    def _default_namespace(self) -> str:
        try:
            return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
        except OSError:
            return os.environ.get("POD_NAMESPACE", "")

    node_name = Unicode(
        "", help="""The agent's node (every worker pod's ``nodeName``). Default: the NODE_NAME variable (the
        downward API's ``spec.nodeName``). ``c.KubernetesLauncher.node_name = "gpu-1"``.""",
    ).tag(config=True)

    @default("node_name")
    def _default_node_name(self) -> str:
        return os.environ.get("NODE_NAME", "")

    image = Unicode(
        "", help="""Image of the worker pods: the notebooks' singleuser image, so the user's packages are there
        (empty, the default: the template's container ``worker``'s). ``c.KubernetesLauncher.image =
        "registry.example.org/gpupool/singleuser:1.2.0"``.""",
    ).tag(config=True)

    python = Unicode(
        "/opt/conda/bin/python", help="""The image's Python, which runs the worker kernel (default
        ``/opt/conda/bin/python``, the Jupyter Docker Stacks').
        ``c.KubernetesLauncher.python = "/usr/bin/python3"``.""",
    ).tag(config=True)

    gpu_resource = Unicode(
        "nvidia.com/gpu", help="""The extended resource of one whole GPU (default ``nvidia.com/gpu``, the NVIDIA
        device plugin's). ``c.KubernetesLauncher.gpu_resource = "nvidia.com/gpu"``.""",
    ).tag(config=True)

    slice_resource = Unicode(
        "", help="""What a slice's pod asks for: a shared or MIG resource the admin set up, e.g.
        ``nvidia.com/gpu.shared`` (the device plugin's time-slicing with renameByDefault) or
        ``nvidia.com/mig-1g.10gb``. Empty (default): a slice takes one whole GPU.
        ``c.KubernetesLauncher.slice_resource = "nvidia.com/gpu.shared"``.""",
    ).tag(config=True)

    home_claim = Unicode(
        "", help="""PersistentVolumeClaim of the users' homes, mounted in each worker pod (empty, the default:
        none). ``c.KubernetesLauncher.home_claim = "gpupool-home"``.""",
    ).tag(config=True)

    home_mount = Unicode(
        "/home/{username}", help="""Where a worker pod mounts its owner's home; ``{username}`` is the owner's
        escaped name (default ``/home/{username}``). ``c.KubernetesLauncher.home_mount = "/home/jovyan"``.""",
    ).tag(config=True)

    home_subpath = Unicode(
        "{username}", help="""The owner's folder in the home claim (default ``{username}``, as Zero to
        JupyterHub's static storage). ``c.KubernetesLauncher.home_subpath = "home/{username}"``.""",
    ).tag(config=True)

    cpus = Float(
        1.0, min=0.001, help="""CPU cores of a worker pod whose lease names none (requests = limits; default 1).
        ``c.KubernetesLauncher.cpus = 2``.""",
    ).tag(config=True)

    memory = ByteSize(
        4 * 2**30, help="""Memory of a worker pod whose lease names none, bytes or ``"8GiB"`` (requests =
        limits; default 4GiB). ``c.KubernetesLauncher.memory = "8GiB"``.""",
    ).tag(config=True)

    run_as_user = Integer(1000, min=1, help="""uid of the worker's container (default 1000, jovyan).
        ``c.KubernetesLauncher.run_as_user = 1000``.""").tag(config=True)
    run_as_group = Integer(100, min=0, help="""gid of the worker's container (default 100, users).
        ``c.KubernetesLauncher.run_as_group = 100``.""").tag(config=True)
    fs_group = Integer(100, min=0, help="""fsGroup of the worker pod's volumes (default 100).
        ``c.KubernetesLauncher.fs_group = 100``.""").tag(config=True)

    first_port = Integer(
        50000, min=1024, max=65530, help="""The first of the six ports a worker binds in its pod (shell, iopub,
        stdin, control, heartbeat, transfer; default 50000). ``c.KubernetesLauncher.first_port = 50000``.""",
    ).tag(config=True)

    pod_template_file = Unicode(
        "", help="""YAML file of the agent's worker pod template (a PodTemplateSpec: its labels, tolerations,
        imagePullSecrets, priorityClassName, runtimeClassName, a container ``worker`` with more env or mounts);
        empty, the default: none. ``c.KubernetesLauncher.pod_template_file = "/etc/gpupool/worker-pod.yaml"``.""",
    ).tag(config=True)

    labels = Dict(
        {}, help="""More labels on every worker pod (default none). ``c.KubernetesLauncher.labels =
        {"team": "ml"}``.""",
    ).tag(config=True)

    owner_name = Unicode(
        "", help="""Name of the pod that owns the worker pods (the agent's; they are deleted with it). Default:
        the POD_NAME variable (downward API ``metadata.name``). ``c.KubernetesLauncher.owner_name = "agent-x"``.""",
    ).tag(config=True)

    @default("owner_name")
    def _default_owner_name(self) -> str:
        return os.environ.get("POD_NAME", "")

    owner_uid = Unicode(
        "", help="""uid of that pod. Default: the POD_UID variable (downward API ``metadata.uid``); without it no
        owner reference is set. ``c.KubernetesLauncher.owner_uid = "..."``.""",
    ).tag(config=True)

    @default("owner_uid")
    def _default_owner_uid(self) -> str:
        return os.environ.get("POD_UID", "")

    api_url = Unicode(
        "", help="""URL of the Kubernetes API server (empty, the default: the in-cluster one, with the pod's service
        account). For an agent outside the cluster, e.g. through ``kubectl proxy``:
        ``c.KubernetesLauncher.api_url = "http://127.0.0.1:8001"``.""",
    ).tag(config=True)

    api_token_file = Unicode(
        "", help="""File holding the bearer token sent to ``api_url`` (empty, the default: none, as through
        ``kubectl proxy``). Unused in-cluster. ``c.KubernetesLauncher.api_token_file = "/etc/gpupool/k8s-token"``.""",
    ).tag(config=True)

    poll_interval = Float(
        5.0, min=0.1, help="""Seconds between two reads of a running worker's pod, to learn that it ended (one GET per
        worker per period, whatever the heartbeat; default 5). ``c.KubernetesLauncher.poll_interval = 5``.""",
    ).tag(config=True)

    def client(self) -> PodClient:
        """The API client of ``namespace``: in-cluster, or ``api_url`` with the token of ``api_token_file``.
        PodError when neither can be had (outside a cluster without ``api_url``, an unreadable token file)."""
        if not self.api_url:
            return PodClient.in_cluster(self.namespace)
        token = ""
        if self.api_token_file:
            try:
                token = Path(self.api_token_file).read_text().strip()
            except OSError as exc:
                raise PodError(f"cannot read the API token file {self.api_token_file}: {exc.strerror or exc} "
                               "(c.KubernetesLauncher.api_token_file)") from None
        return PodClient.for_host(self.namespace, self.api_url, token)

    def pod_settings(self) -> PodSettings:
        """The pure settings of :func:`~.pods.worker_pod`. ValueError for a bad combination."""
        owner = OwnerPod(self.owner_name, self.owner_uid) if self.owner_name and self.owner_uid else None
        return PodSettings(namespace=self.namespace, node_name=self.node_name, image=self.image, python=self.python,
                           gpu_resource=self.gpu_resource, slice_resource=self.slice_resource,
                           home_claim=self.home_claim, home_mount=self.home_mount, home_subpath=self.home_subpath,
                           cpus=self.cpus, memory=self.memory, run_as_user=self.run_as_user,
                           run_as_group=self.run_as_group, fs_group=self.fs_group, ports=WorkerPorts(self.first_port),
                           owner=owner, labels=dict(self.labels))

    def template(self) -> dict[str, Any]:
        """The pod template from ``pod_template_file`` ({} without one).
        ValueError naming the file when it is not a YAML mapping."""
        if not self.pod_template_file:
            return {}
        import yaml

        try:
            body = yaml.safe_load(Path(self.pod_template_file).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"cannot read the worker pod template {self.pod_template_file}: {exc} "
                             "(c.KubernetesLauncher.pod_template_file)") from None
        if not isinstance(body, dict):
            raise ValueError(f"the worker pod template {self.pod_template_file} is not a YAML mapping "
                             "(c.KubernetesLauncher.pod_template_file)")
        return body
