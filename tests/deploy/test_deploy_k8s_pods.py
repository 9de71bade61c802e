"""deploy/kubernetes, the pods: the agents live in a namespace of their own labelled for Pod
Security ``privileged`` (``baseline`` in the pods overlay, whose agent is unprivileged) and the
users' namespace is left as it is, with no pod there (ours, or the singleuser pod the z2jh values
make) breaking ``baseline``; where workers run inside it, the agent's pod gets what containment
needs and says it requires it and reserves its workers' resources (Guaranteed QoS); every agent
ranks high and tolerates the pool's taint; homes are one share at the same path in the notebook
and on the agent; the CDI component and the home migration Job render and validate. The pods
overlay's agent and worker pods: tests/deploy/test_deploy_k8s_worker_pods.py."""

from __future__ import annotations

import copy
import re

import pytest
import yaml
from deploy_k8s import (AGENTS_NS, IN_AGENT_POD, K8S, USERS_NS, WORKER_PODS, config_text, config_value, find,
                        namespace, one, pod_spec, render, rendered, workloads, z2jh_values)
from deploy_parse import baseline_violations

__all__ = ["rendered"]  # the fixture
GiB = 2**30


def quantity(text: str | int) -> float:
    """A Kubernetes quantity (``32``, ``500m``, ``256Gi``) as a number (cores or bytes)."""
    text = str(text)
    for suffix, factor in (("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("Ti", 2**40), ("m", 1e-3)):
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * factor
    return float(text)


def test_agents_have_a_namespace_of_their_own_and_the_users_namespace_is_untouched(rendered):
    for overlay, objects in rendered.items():
        [ns] = find(objects, "Namespace")  # only the agents' namespace is made here
        assert ns["metadata"]["name"] == AGENTS_NS
        labels = ns["metadata"]["labels"]
        level = "baseline" if overlay == WORKER_PODS else "privileged"  # an unprivileged agent needs no more
        assert labels["pod-security.kubernetes.io/enforce"] == level, overlay
        assert labels["pod-security.kubernetes.io/warn"] == labels["pod-security.kubernetes.io/audit"] == level
        cluster_wide = {"Namespace", "PriorityClass", "PersistentVolume"}
        for obj in objects:
            assert (namespace(obj) is None) == (obj["kind"] in cluster_wide), f"{obj['kind']} {obj['metadata']['name']}"
        assert {namespace(w) for w in workloads(objects) if w["kind"] == "DaemonSet"} == {AGENTS_NS}
        assert {namespace(w) for w in workloads(objects) if w["kind"] != "DaemonSet"} == {USERS_NS}
        # Nothing but agents in the privileged namespace.
        assert all(w["metadata"]["name"] == "gpupool-agent" for w in workloads(objects) if namespace(w) == AGENTS_NS)


def singleuser_pod(values: dict) -> dict:
    """The parts of the pod KubeSpawner makes from the z2jh values (chart defaults where they are
    silent: uid 1000, fsGid 100, no privilege escalation) that Pod Security looks at."""
    single = values["singleuser"]
    return {"securityContext": {"fsGroup": single.get("fsGid", 100)},
            "initContainers": copy.deepcopy(single.get("initContainers", [])),
            "containers": [{"name": "notebook", "securityContext": {
                "runAsUser": single.get("uid", 1000), "allowPrivilegeEscalation": single.get("allowPrivilegeEscalation", False)}}],
            "volumes": [{"name": "home", "persistentVolumeClaim": {"claimName": single["storage"]["static"]["pvcName"]}}]}


def test_no_pod_in_the_users_namespace_breaks_pod_security_baseline(rendered):
    for objects in rendered.values():
        users = [w for w in workloads(objects) if namespace(w) == USERS_NS]
        assert {w["metadata"]["name"] for w in users} >= {"gpupool-service"}
        for workload in users:
            assert baseline_violations(pod_spec(workload), workload["spec"]["template"]["metadata"].get("annotations")) == [], \
                workload["metadata"]["name"]
    assert baseline_violations(singleuser_pod(z2jh_values())) == []
    migrate = yaml.safe_load((K8S / "z2jh" / "migrate-home.yaml").read_text())
    assert baseline_violations(migrate["spec"]["template"]["spec"]) == []
    # The check bites: the agent's pod breaks baseline, which is why it lives elsewhere.
    agent = pod_spec(one(rendered["evaluation"], "DaemonSet", "gpupool-agent"))
    assert set(baseline_violations(agent)) == {"hostPID: true", "container agent: privileged", "volume state: hostPath"}
    assert baseline_violations({"containers": [{"name": "x", "securityContext": {
        "capabilities": {"add": ["SYS_ADMIN", "CHOWN"]}, "seccompProfile": {"type": "Unconfined"}}}],
        "volumes": [{"name": "h", "hostPath": {"path": "/"}}]}) == [
        "volume h: hostPath", "container x: adds capabilities ['SYS_ADMIN']", "container x: seccomp Unconfined"]


def test_the_agent_pod_gets_what_containment_needs_and_requires_it(rendered):
    for objects in (rendered[overlay] for overlay in IN_AGENT_POD):
        workload = one(objects, "DaemonSet", "gpupool-agent")
        pod = pod_spec(workload)
        [container] = pod["containers"]
        assert container["securityContext"] == {"privileged": True, "runAsUser": 0}  # cgroupfs rw, every GPU
        assert pod["hostPID"] is True and pod["runtimeClassName"] == "nvidia"
        assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in container["env"]
        assert "nvidia.com/gpu" not in str(container["resources"])  # none from the device plugin
        text = config_text(objects, "gpupool-agent-config")
        assert config_value(text, "AgentEnforcement.require_containment") is True
        assert config_value(text, "AgentEnforcement.enforcement_mode") == "mps"  # explicit, so it is required
        assert config_value(text, "AgentEnforcement.cgroup_mode") in ("auto", "v2", "v1")


def test_the_agent_ranks_high_tolerates_the_pool_taint_and_reserves_its_workers(rendered):
    for overlay, objects in rendered.items():
        pod = pod_spec(one(objects, "DaemonSet", "gpupool-agent"))
        priority = one(objects, "PriorityClass", pod["priorityClassName"])
        assert priority["value"] == 1_000_000_000 and priority["globalDefault"] is False  # the most a user class may
        assert pod["nodeSelector"] == {"gpupool.io/pool": "true"}
        assert {"key": "gpupool.io/pool", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        if overlay not in IN_AGENT_POD:
            continue  # its workers' pods reserve their own: tests/deploy/test_deploy_k8s_worker_pods.py
        resources = pod["containers"][0]["resources"]
        assert resources["requests"] == resources["limits"] and set(resources["limits"]) == {"cpu", "memory"}  # Guaranteed
        spare_cpus, spare_memory = headroom(resources, config_text(objects, "gpupool-agent-config"))
        assert fits_the_agent(spare_cpus, spare_memory), (spare_cpus, spare_memory / GiB)


def test_the_headroom_check_catches_a_config_that_offers_the_whole_pod(rendered):
    """The window above is not met by any config: one that offers leases all of the pod's cores, or
    leases and parked workers more memory than the pod has, fails it."""
    objects = rendered[IN_AGENT_POD[0]]
    resources = pod_spec(one(objects, "DaemonSet", "gpupool-agent"))["containers"][0]["resources"]
    text = config_text(objects, "gpupool-agent-config")
    limit = quantity(resources["limits"]["cpu"])
    greedy = [re.sub(r"(?m)^(\s*)c\.AgentInventory\.host_cpus = .*$",
                     rf"\g<1>c.AgentInventory.host_cpus = {limit:g}", text),
              re.sub(r"(?m)^(\s*)c\.AgentParking\.parked_memory = .*$",
                     r'\g<1>c.AgentParking.parked_memory = "1TiB"', text)]
    assert all(edited != text for edited in greedy), "the config names host_cpus and parked_memory"
    for edited in greedy:
        assert not fits_the_agent(*headroom(resources, edited)), edited


def headroom(resources: dict, config: str) -> tuple[float, float]:
    """``(cores, bytes)`` the agent's container (its Guaranteed ``resources``) keeps for the agent
    itself once an agent with ``config`` (its own reading of it) has offered leases its cores and
    memory, and the parked budget, which lives in this container too."""
    agent = agent_of(config)
    # Set in the config, or host_totals() would read this test machine's psutil, not the pod's.
    offered = agent.agent_inventory
    assert offered.host_cpus and offered.host_memory, (offered.host_cpus, offered.host_memory)
    offered_cpus, offered_memory = agent.host_totals()
    return (quantity(resources["limits"]["cpu"]) - offered_cpus,
            quantity(resources["limits"]["memory"]) - offered_memory - agent.parked_budget())


def fits_the_agent(spare_cpus: float, spare_memory: float) -> bool:
    """Room for the agent: 1-4 cores and 2-16 GiB (more would be capacity no lease can have)."""
    return 1 <= spare_cpus <= 4 and 2 * GiB <= spare_memory <= 16 * GiB


def test_homes_are_one_share_at_the_same_path_in_the_notebook_and_on_the_agent(rendered):
    values = z2jh_values()
    storage = values["singleuser"]["storage"]
    home = storage["homeMountPath"]
    assert home == "/home/" + storage["static"]["subPath"] == "/home/{username}"
    spawner = values["hub"]["config"]["KubeSpawner"]
    assert spawner["working_dir"] == spawner["notebook_dir"] == values["singleuser"]["extraEnv"]["HOME"] == home
    # The init step for NFS ownership mounts that very folder and only ever chowns it to the notebook user.
    [init] = values["singleuser"]["initContainers"]
    [mount] = init["volumeMounts"]
    assert mount["name"] == "home" and mount["subPath"] == storage["static"]["subPath"]
    assert f"chown 1000:100 {mount['mountPath']}" in init["command"][-1] and "$$(stat" in init["command"][-1]
    for overlay, objects in rendered.items():
        claims = {namespace(c): c for c in find(objects, "PersistentVolumeClaim", "gpupool-home")}
        assert set(claims) == {USERS_NS, AGENTS_NS} and storage["static"]["pvcName"] == "gpupool-home"
        volumes = {}
        for ns, claim in claims.items():
            volume = one(objects, "PersistentVolume", claim["spec"]["volumeName"])
            assert volume["spec"]["claimRef"] == {"namespace": ns, "name": "gpupool-home"}
            assert claim["spec"]["storageClassName"] == volume["spec"]["storageClassName"] == ""  # no provisioner
            assert "ReadWriteMany" in claim["spec"]["accessModes"] and "ReadWriteMany" in volume["spec"]["accessModes"]
            volumes[ns] = {k: v for k, v in volume["spec"].items() if k != "claimRef"}
        assert volumes[USERS_NS] == volumes[AGENTS_NS]  # the same share, for both namespaces
        if overlay not in IN_AGENT_POD:
            continue  # each worker pod mounts its owner's folder: tests/deploy/test_deploy_k8s_worker_pods.py
        pod = pod_spec(one(objects, "DaemonSet", "gpupool-agent"))
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        claim = [v for v in pod["volumes"] if v["name"] == "home"][0]["persistentVolumeClaim"]["claimName"]
        assert mounts["home"] == "/home" and claim == "gpupool-home"  # /home/{username} there is the notebook's folder


def test_a_rollout_can_be_opt_in_with_a_profile():
    profiles = z2jh_values()["singleuser"]["profileList"]
    default = [p for p in profiles if p.get("default")]
    pooled = [p for p in profiles if p["display_name"] == "CPU + pooled GPU"]
    assert len(default) == 1 and "kubespawner_override" not in default[0]  # the admin's current image
    assert len(pooled) == 1
    image = pooled[0]["kubespawner_override"]["image"]
    assert image.startswith("registry.example.org/gpupool/singleuser:")
    assert z2jh_values()["singleuser"]["image"]["name"] != image.rpartition(":")[0]


def test_the_home_migration_job_and_the_cdi_component_validate(tmp_path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate.utils import latest_version

    job = yaml.safe_load((K8S / "z2jh" / "migrate-home.yaml").read_text().replace("USERNAME", "ann"))
    kubernetes_validate.validate(job, latest_version(), strict=True)
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod_spec(job)["volumes"]}
    assert claims == {"claim-ann", "gpupool-home"}
    overlay = "overlays/cdi-check/kustomization.yaml"
    objects = render(tmp_path, "overlays/cdi-check", {
        overlay: "resources: [../production]\ncomponents: [../../components/cdi]\n"})
    for obj in objects:
        if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(obj, latest_version(), strict=True)
    template = one(objects, "DaemonSet", "gpupool-agent")["spec"]["template"]
    assert template["metadata"]["annotations"] == {"cdi.k8s.io/gpupool-agent": "nvidia.com/gpu=all"}
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in template["spec"]["containers"][0]["env"]


def agent_of(text: str):
    """A NodeAgent configured by the config file ``text``, as ``gpupool agent`` loads it, with its
    settings' parts built (not started)."""
    from traitlets.config import Config

    from gpupool.node.agent import NodeAgent

    config = Config()
    exec(compile(text, "gpupool_config.py", "exec"), {"c": config, "get_config": lambda: config})  # noqa: S102
    agent = NodeAgent(config=config)
    agent.read_settings()
    return agent
