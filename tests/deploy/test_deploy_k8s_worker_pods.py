"""deploy/kubernetes/overlays/pods, the agent whose workers are pods: it renders with
``kubectl kustomize`` and every object validates strictly (kubernetes-validate); the agent
runs unprivileged (no GPU, no host PIDs, no capabilities, not root) in the agents' namespace,
which enforces Pod Security ``baseline`` here, with RBAC limited to that namespace; its config
file names only real settings; and the worker pod that config and the overlay's pod template
build lands in that namespace (beside its owner, the agent's pod), passes ``baseline``,
validates, is selected by the overlay's worker NetworkPolicy on its ports, mounts its owner's
folder of that namespace's home claim where the notebook has it and runs the notebooks' image.
The rest of the overlay (service, monitoring, URLs) is checked with the others in
tests/deploy/test_deploy_k8s.py and tests/deploy/test_deploy_k8s_pods.py.

Skips, saying why, without kubectl. No cluster runs here: deploy/kubernetes/README.md,
"Workers as pods", says what only a cluster can show.
"""

from __future__ import annotations

import json

import pytest
import yaml
from deploy_k8s import AGENTS_NS, MONITORING_NS, USERS_NS, WORKER_PODS, namespace, one, render, z2jh_values
from deploy_parse import baseline_violations, check_command, config_assignments
from traitlets.config import Config, PyFileConfigLoader

from gpupool.node.workers import WorkerSpec
from gpupool.node.workers.launchers import available
from gpupool.node.workers.launchers.kubernetes import (KubernetesLauncher, connection_info,
                                                              connection_secret, worker_pod)
from gpupool.wire.nodes import GPUInfo

#: What the overlay's config sets that takes effect with the launcher's second phase (docs/launchers.md).
PHASE_2 = {("AgentWorkers", "worker_launcher")}


@pytest.fixture(scope="module")
def objects(tmp_path_factory) -> list[dict]:
    return render(tmp_path_factory.mktemp("k8s"), f"overlays/{WORKER_PODS}")


def pooled_image() -> str:
    """The image of the z2jh profile "CPU + pooled GPU": the notebooks that attach to the pool."""
    [profile] = [p for p in z2jh_values()["singleuser"]["profileList"] if p["display_name"] == "CPU + pooled GPU"]
    return profile["kubespawner_override"]["image"]


def agent(objects) -> tuple[dict, dict]:
    daemonset = one(objects, "DaemonSet", "gpupool-agent")
    pod = daemonset["spec"]["template"]["spec"]
    return pod, next(c for c in pod["containers"] if c["name"] == "agent")


def test_every_object_validates_strictly(objects):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate.utils import latest_version

    kinds = {o["kind"] for o in objects}
    assert {"DaemonSet", "Deployment", "Role", "RoleBinding", "NetworkPolicy", "ConfigMap", "Secret"} <= kinds
    for obj in objects:
        if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(obj, latest_version(), strict=True)
        assert namespace(obj) in (USERS_NS, AGENTS_NS, MONITORING_NS, None)
    # What this mode adds lives with the agents, and the agent with it.
    for kind, name in (("Role", "gpupool-agent-workers"), ("RoleBinding", "gpupool-agent-workers"),
                       ("NetworkPolicy", "gpupool-worker-pods"), ("ConfigMap", "gpupool-worker-template"),
                       ("ConfigMap", "gpupool-agent-config"), ("DaemonSet", "gpupool-agent")):
        assert namespace(one(objects, kind, name)) == AGENTS_NS, f"{kind} {name}"


def test_the_agent_runs_unprivileged_with_no_gpu_of_its_own(objects):
    pod, container = agent(objects)
    assert not pod.get("hostPID") and "runtimeClassName" not in pod
    assert pod["automountServiceAccountToken"] is True and pod["serviceAccountName"] == "gpupool-agent"
    assert pod["securityContext"]["runAsNonRoot"] is True
    security = container["securityContext"]
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert security["capabilities"] == {"drop": ["ALL"], "add": []}
    env = {e["name"]: e for e in container["env"]}
    assert "NVIDIA_VISIBLE_DEVICES" not in env and "NVIDIA_DRIVER_CAPABILITIES" not in env
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "limits" not in container["resources"] or "nvidia.com/gpu" not in container["resources"]["limits"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/home" not in mounts and "/etc/gpupool/worker-pod.yaml" in mounts
    tokens = next(v for v in pod["volumes"] if v["name"] == "tokens")
    assert tokens["secret"]["defaultMode"] == 0o440  # the agent's group reads them, not root alone
    assert {v["name"] for v in pod["volumes"]} >= {"config", "tokens", "state", "worker-template"}
    check_command([*container["command"], *container.get("args", [])])
    # It reserves only itself (the workers' pods reserve theirs), Guaranteed, so it is evicted last.
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert set(container["resources"]["limits"]) == {"cpu", "memory"}


def test_the_agents_namespace_enforces_baseline_and_the_agent_passes_it(objects):
    labels = one(objects, "Namespace", AGENTS_NS)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
    pod, _ = agent(objects)
    assert baseline_violations(pod) == []
    # No policy left open for workers inside the agent's pod: notebooks reach worker pods only.
    assert not [p for p in objects if p["kind"] == "NetworkPolicy" and p["metadata"]["name"] == "gpupool-agent-workers"]


def test_rbac_is_limited_to_its_namespace_and_to_pods_and_their_secrets(objects):
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = one(objects, "Role", "gpupool-agent-workers", AGENTS_NS)
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]}
    assert rules == {(("",), ("pods",)): {"create", "get", "list", "watch", "delete"},
                     (("",), ("pods/log",)): {"get"}, (("",), ("secrets",)): {"create", "get", "delete"}}
    binding = one(objects, "RoleBinding", "gpupool-agent-workers")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "gpupool-agent-workers"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpupool-agent", "namespace": AGENTS_NS}]
    assert namespace(one(objects, "ServiceAccount", "gpupool-agent")) == AGENTS_NS


def load_config(objects, tmp_path) -> Config:
    text = one(objects, "ConfigMap", "gpupool-agent-config")["data"]["gpupool_config.py"]
    (tmp_path / "gpupool_config.py").write_text(text)
    return PyFileConfigLoader("gpupool_config.py", path=str(tmp_path)).load_config()


def test_the_agent_config_names_real_settings(objects, tmp_path):
    from gpupool.node.settings import AgentWorkers

    text = one(objects, "ConfigMap", "gpupool-agent-config")["data"]["gpupool_config.py"]
    sections = config_assignments(text)
    assert set(sections) == {"AgentWorkers", "KubernetesLauncher"}
    for name in sections["KubernetesLauncher"]:
        assert name in KubernetesLauncher.class_traits(config=True), name
    config = load_config(objects, tmp_path)
    for name in sections["AgentWorkers"]:
        assert name in AgentWorkers.class_traits(config=True), name
        if ("AgentWorkers", name) in PHASE_2 and "kubernetes" not in available():
            continue  # refused until the launcher is installed under that name: checked below
        setattr(AgentWorkers(), name, config.AgentWorkers[name])
    if "kubernetes" not in available():
        with pytest.raises(Exception, match="worker_launcher"):
            AgentWorkers(config=config)


def test_the_worker_pod_it_builds_validates_and_fits_the_overlay(objects, tmp_path, monkeypatch):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate.utils import latest_version

    template = yaml.safe_load(one(objects, "ConfigMap", "gpupool-worker-template")["data"]["worker-pod.yaml"])
    (tmp_path / "worker-pod.yaml").write_text(yaml.safe_dump(template))
    config = load_config(objects, tmp_path)
    config.KubernetesLauncher.pod_template_file = str(tmp_path / "worker-pod.yaml")
    monkeypatch.setenv("NODE_NAME", "gpu-node-1")
    monkeypatch.setenv("POD_NAME", "gpupool-agent-x7k2p")
    monkeypatch.setenv("POD_UID", "6f1b96b0-aaaa-4bbb-8ccc-0123456789ab")
    # The downward API's values for the agent's pod: its namespace is the DaemonSet's.
    monkeypatch.setenv("POD_NAMESPACE", namespace(one(objects, "DaemonSet", "gpupool-agent")))
    launcher = KubernetesLauncher(config=config)
    gpu = GPUInfo("GPU-0", "NVIDIA A100-SXM4-80GB", 0, 80 * 2**30)
    for spec in (WorkerSpec("L-1", "ann", (gpu,), 1.0, 80 * 2**30, cpus=4, host_memory=32 * 2**30),
                 WorkerSpec("L-2", "bob", (gpu,), 0.5, 40 * 2**30)):
        settings = launcher.pod_settings()
        pod = worker_pod(spec, settings, launcher.template(), {"PATH": "/opt/conda/bin:/usr/bin"})
        kubernetes_validate.validate(pod, latest_version(), strict=True)
        kubernetes_validate.validate(connection_secret(spec, settings, json.dumps(connection_info("k", settings)),
                                                       "0f0e0d0c-0000-4000-8000-000000000001"),
                                     latest_version(), strict=True)
        # Beside its owner (an owner reference names a pod of the same namespace), within the Role's
        # reach, and within the namespace's Pod Security level: it runs the users' image.
        assert pod["metadata"]["namespace"] == AGENTS_NS and pod["spec"]["nodeName"] == "gpu-node-1"
        assert pod["metadata"]["ownerReferences"][0]["name"] == "gpupool-agent-x7k2p"
        assert baseline_violations(pod["spec"], pod["metadata"].get("annotations")) == []
        policy = one(objects, "NetworkPolicy", "gpupool-worker-pods", AGENTS_NS)
        selector = policy["spec"]["podSelector"]["matchLabels"]
        assert all(pod["metadata"]["labels"].get(k) == v for k, v in selector.items())
        allowed = policy["spec"]["ingress"][0]["ports"][0]
        ports = [p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]]
        assert all(allowed["port"] <= p <= allowed["endPort"] for p in ports)
        # The owner's folder of the share, at the notebook's own path (z2jh's static storage).
        claim = next(v for v in pod["spec"]["volumes"] if v["name"] == "home")["persistentVolumeClaim"]["claimName"]
        assert one(objects, "PersistentVolumeClaim", claim, AGENTS_NS)
        storage = z2jh_values()["singleuser"]["storage"]
        [mount] = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "home"]
        assert mount["mountPath"] == storage["homeMountPath"].format(username=spec.owner)
        assert mount["subPath"] == storage["static"]["subPath"].format(username=spec.owner)
        assert pod["spec"]["containers"][0]["workingDir"] == mount["mountPath"]
        assert pod["spec"]["containers"][0]["image"] == pooled_image()  # the pooled notebooks' image
        assert pod["spec"]["tolerations"] == template["spec"]["tolerations"]
        assert {"key": "gpupool.io/pool", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
