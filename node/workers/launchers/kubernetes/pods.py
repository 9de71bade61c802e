"""A lease's worker as a Kubernetes pod (pure: a lease, the agent's pod
template and the settings in, manifests as dicts out), in the manner of
kubespawner's ``objects.py``.

The pod runs the user's image (the singleuser image: the user's packages are
there) on the agent's node (``nodeName``), asks for its GPUs as an extended
resource (``nvidia.com/gpu``, or for a slice the shared or MIG resource the
admin names) and for the lease's CPUs and memory (requests = limits, so the
kubelet's cgroups hold it there and it is not the first evicted), mounts its
owner's home, exposes its kernel's ports, is owned by the agent's pod (the
garbage collector deletes it with that pod) and carries the labels
NetworkPolicies and metrics select by. Its connection file (with the HMAC
key) comes from a Secret of its own (:func:`connection_secret`), owned by the
worker's pod. The kubelet then applies the cgroups and the device plugin the
GPU, so the node keeps its device plugin and the agent needs no privilege.
"""

from __future__ import annotations

import copy
import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..resources import LeaseResources

#: Where the connection Secret is mounted in the worker's container, and its file.
CONNECTION_DIR = "/var/run/gpupool"
CONNECTION_FILE = "kernel.json"
#: Label keys.
LEASE_LABEL = "gpupool.io/lease"
NODE_LABEL = "gpupool.io/node"
COMPONENT_LABEL = "app.kubernetes.io/component"
#: Annotation keys: values a label cannot hold (any lease id, any user name).
LEASE_ANNOTATION = "gpupool.io/lease-id"
OWNER_ANNOTATION = "gpupool.io/owner"
#: The kernel's channels, in the order of :class:`WorkerPorts`.
CHANNELS = ("shell", "iopub", "stdin", "control", "hb")
#: Variables the device plugin sets from the GPUs it hands the pod: never passed from the agent.
GRANTED_BY_KUBELET = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")

_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")


@dataclass(frozen=True)
class WorkerPorts:
    """The ports a worker's kernel binds in its pod (a network namespace of
    its own, so fixed numbers never clash): ``first`` for shell, then iopub,
    stdin, control, heartbeat and the data plane's transfer port."""

    first: int = 50000

    def __post_init__(self) -> None:
        if not 1024 <= self.first <= 65535 - len(CHANNELS):
            raise ValueError(f"worker ports must lie in 1024-65535, not from {self.first}")

    def by_name(self) -> dict[str, int]:
        names = (*(f"{c}_port" for c in CHANNELS), "transfer_port")
        return {name: self.first + i for i, name in enumerate(names)}


@dataclass(frozen=True)
class OwnerPod:
    """The pod that owns the workers' pods (the agent's: downward API
    ``metadata.name`` and ``metadata.uid``)."""

    name: str
    uid: str


@dataclass(frozen=True)
class PodSettings:
    """The site's settings for every worker pod of one node (from
    :class:`~.launcher.KubernetesLauncher`).

    ``namespace``; ``node_name`` (the agent's node: ``nodeName``);
    ``image`` (the singleuser image; empty: the template's container's);
    ``python`` (the image's interpreter); ``gpu_resource`` (whole GPUs,
    ``nvidia.com/gpu``); ``slice_resource`` (what one slice asks for, e.g.
    ``nvidia.com/gpu.shared`` of the device plugin's time-slicing or
    ``nvidia.com/mig-1g.10gb``; empty: a slice takes one whole
    ``gpu_resource``); ``home_claim`` (the users' homes' PVC; empty: none),
    mounted at ``home_mount`` from ``home_subpath`` (``{username}`` is the
    owner's escaped name); ``cpus``/``memory``: what a lease that names none
    gets (cores, bytes); ``run_as_user``/``run_as_group``/``fs_group``;
    ``owner`` (:class:`OwnerPod`; None: no owner reference); ``labels``:
    more labels on every worker pod."""

    namespace: str
    node_name: str
    image: str = ""
    python: str = "/opt/conda/bin/python"
    gpu_resource: str = "nvidia.com/gpu"
    slice_resource: str = ""
    home_claim: str = ""
    home_mount: str = "/home/{username}"
    home_subpath: str = "{username}"
    cpus: float = 1.0
    memory: int = 4 * 2**30
    run_as_user: int = 1000
    run_as_group: int = 100
    fs_group: int = 100
    ports: WorkerPorts = WorkerPorts()
    owner: OwnerPod | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.namespace or not self.node_name:
            raise ValueError("worker pods need a namespace and the agent's node name "
                             "(c.KubernetesLauncher.namespace, NODE_NAME)")
        for resource in (self.gpu_resource, self.slice_resource):
            if resource and not re.match(r"^[a-z0-9.-]+/[A-Za-z0-9._-]+$", resource):
                raise ValueError(f"{resource!r} is not an extended resource name such as 'nvidia.com/gpu'")
        for key, value in self.labels.items():
            if not _LABEL_VALUE.match(value):
                raise ValueError(f"label {key}={value!r}: a label value is up to 63 letters, digits, '-', '_' "
                                 "or '.', beginning and ending with a letter or digit")


def escape_username(name: str) -> str:
    """A user name as kubespawner's ``escape`` slug scheme writes ``{username}``
    (escapism with the safe set a-z0-9 and escape character ``-``, then
    lower-cased): ``Ann@x.org`` -> ``-41nn-40x-2eorg``. kubespawner 7's
    default ``safe`` scheme writes names differently: match
    ``c.KubernetesLauncher.home_subpath`` to the hub's storage settings."""
    out = []
    for char in name:
        if "a" <= char <= "z" or "0" <= char <= "9":
            out.append(char)
        else:
            out.extend(f"-{byte:X}" for byte in char.encode())
    return "".join(out).lower()


def label_value(text: str) -> str:
    """``text`` as a label value: itself when it is one, else a readable
    prefix and a hash (the full text goes into an annotation)."""
    if _LABEL_VALUE.match(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    prefix = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:50]
    return f"{prefix}-{digest}" if prefix else digest


def pod_name(lease_id: str) -> str:
    """The worker pod's name: a DNS label of at most 63 characters, unique per lease id."""
    slug = re.sub(r"[^a-z0-9]+", "-", lease_id.lower()).strip("-")[:36].strip("-")
    digest = hashlib.sha256(lease_id.encode()).hexdigest()[:8]
    return f"gpupool-worker-{slug}-{digest}" if slug else f"gpupool-worker-{digest}"


def secret_name(lease_id: str) -> str:
    return pod_name(lease_id).replace("gpupool-worker-", "gpupool-conn-", 1)


def gpu_limits(lease: LeaseResources, settings: PodSettings) -> dict[str, str]:
    """The extended resources of ``lease``'s pod: N whole GPUs, or one
    ``slice_resource`` (one whole GPU when the admin named none)."""
    if len(lease.gpus) == 1 and lease.fraction < 1.0 and settings.slice_resource:
        return {settings.slice_resource: "1"}
    return {settings.gpu_resource: str(max(1, len(lease.gpus)))}


def quantity_cpu(cores: float) -> str:
    """Cores as a Kubernetes CPU quantity, in millicores rounded up (``1500m``)."""
    return f"{max(1, math.ceil(cores * 1000 - 1e-6))}m"


def quantity_memory(size: int) -> str:
    """Bytes as a Kubernetes memory quantity (``Mi``, rounded up)."""
    return f"{max(1, math.ceil(size / 2**20))}Mi"


def labels(lease: LeaseResources, settings: PodSettings) -> dict[str, str]:
    """The worker pod's labels: gpupool's app labels, the component
    (``worker``, what NetworkPolicies select), the lease and the node."""
    return {**settings.labels, "app.kubernetes.io/name": "gpupool", COMPONENT_LABEL: "worker",
            LEASE_LABEL: label_value(lease.lease_id), NODE_LABEL: label_value(settings.node_name)}


def kernel_command(settings: PodSettings, kernel_args: Sequence[str]) -> list[str]:
    """The worker's command: gpupool's worker kernel on the mounted connection file."""
    return [settings.python, "-m", "gpupool.kernelapp", "-f", f"{CONNECTION_DIR}/{CONNECTION_FILE}", *kernel_args]


def connection_info(key: str, settings: PodSettings) -> dict[str, Any]:
    """The connection file of a worker pod: its fixed ports, bound on every
    address of the pod (clients reach it at the pod's IP), HMAC ``key``."""
    return {"ip": "0.0.0.0", "transport": "tcp", "signature_scheme": "hmac-sha256", "key": key,
            **settings.ports.by_name()}


def worker_pod(lease: LeaseResources, settings: PodSettings, template: Mapping[str, Any],
               env: Mapping[str, str], kernel_args: Sequence[str] = ()) -> dict[str, Any]:
    """The Pod manifest of ``lease``'s worker, from the agent's pod
    ``template`` (a PodTemplateSpec as a dict: its metadata and spec are
    kept, its container named ``worker``, if any, is the base of the
    worker's container) with ``env`` (the worker's environment, less what the
    device plugin sets). ValueError for a template that is not one."""
    if not isinstance(template, Mapping) or not isinstance(template.get("spec", {}), Mapping):
        raise ValueError("the worker pod template must be a PodTemplateSpec: {metadata: ..., spec: ...}")
    meta = copy.deepcopy(dict(template.get("metadata") or {}))
    spec = copy.deepcopy(dict(template.get("spec") or {}))
    base = next((c for c in spec.get("containers", []) if c.get("name") == "worker"), {})
    username = escape_username(lease.owner)
    container = _container(lease, settings, base, env, kernel_args, username)
    volumes = [v for v in spec.get("volumes", []) if v.get("name") not in ("connection", "home")]
    volumes.append({"name": "connection", "secret": {"secretName": secret_name(lease.lease_id), "defaultMode": 0o400}})
    if settings.home_claim:
        volumes.append({"name": "home", "persistentVolumeClaim": {"claimName": settings.home_claim}})
    metadata = {
        **{k: v for k, v in meta.items() if k not in ("name", "namespace", "labels", "annotations")},
        "name": pod_name(lease.lease_id), "namespace": settings.namespace,
        "labels": {**meta.get("labels", {}), **labels(lease, settings)},
        "annotations": {**meta.get("annotations", {}), LEASE_ANNOTATION: lease.lease_id, OWNER_ANNOTATION: lease.owner},
    }
    if settings.owner is not None:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": settings.owner.name,
                                        "uid": settings.owner.uid, "controller": False,
                                        "blockOwnerDeletion": False}]
    security = {"runAsNonRoot": True, "runAsUser": settings.run_as_user, "runAsGroup": settings.run_as_group,
                "fsGroup": settings.fs_group, "seccompProfile": {"type": "RuntimeDefault"},
                **spec.get("securityContext", {})}
    spec.update({
        "nodeName": settings.node_name,  # the agent's node: the kubelet admits it against its device plugin
        "restartPolicy": "Never",  # a kernel started again is a new kernel: the lease ends instead
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": security,
        "containers": [container, *(c for c in spec.get("containers", []) if c.get("name") != "worker")],
        "volumes": volumes,
    })
    spec.setdefault("terminationGracePeriodSeconds", 10)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def _container(lease: LeaseResources, settings: PodSettings, base: Mapping[str, Any], env: Mapping[str, str],
               kernel_args: Sequence[str], username: str) -> dict[str, Any]:
    container = copy.deepcopy(dict(base))
    image = settings.image or container.get("image", "")
    if not image:
        raise ValueError("no image for the worker pod: set c.KubernetesLauncher.image (the singleuser image) "
                         "or the template's container 'worker'")
    ours = {name: value for name, value in env.items() if name not in GRANTED_BY_KUBELET}
    kept = [e for e in container.get("env", []) if e.get("name") not in ours]
    cpu = quantity_cpu(lease.cpus or settings.cpus)
    memory = quantity_memory(lease.host_memory or settings.memory)
    limits = {"cpu": cpu, "memory": memory, **gpu_limits(lease, settings)}
    mounts = [m for m in container.get("volumeMounts", []) if m.get("name") not in ("connection", "home")]
    mounts.append({"name": "connection", "mountPath": CONNECTION_DIR, "readOnly": True})
    workdir = container.get("workingDir")
    if settings.home_claim:
        home = settings.home_mount.format(username=username)
        mounts.append({"name": "home", "mountPath": home, "subPath": settings.home_subpath.format(username=username)})
        workdir = home
    container.update({
        "name": "worker",
        "image": image,
        "command": kernel_command(settings, kernel_args),
        "env": [*kept, *({"name": name, "value": str(value)} for name, value in sorted(ours.items()))],
        "ports": [{"name": name.removesuffix("_port"), "containerPort": port, "protocol": "TCP"}
                  for name, port in settings.ports.by_name().items()],
        "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": limits},
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            **container.get("securityContext", {})},
    })
    container.pop("args", None)
    if workdir:
        container["workingDir"] = workdir
    return container


def connection_secret(lease: LeaseResources, settings: PodSettings, connection_json: str,
                      pod_uid: str | None = None) -> dict[str, Any]:
    """The Secret holding the worker's connection file (its key): owned by
    the worker's pod once that exists (``pod_uid``), so it goes with it."""
    metadata: dict[str, Any] = {"name": secret_name(lease.lease_id), "namespace": settings.namespace,
                                "labels": labels(lease, settings), "annotations": {LEASE_ANNOTATION: lease.lease_id}}
    if pod_uid:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": pod_name(lease.lease_id),
                                        "uid": pod_uid, "controller": False, "blockOwnerDeletion": False}]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": metadata,
            "stringData": {CONNECTION_FILE: connection_json}}
