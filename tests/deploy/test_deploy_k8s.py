"""deploy/kubernetes: every overlay renders with ``kubectl kustomize``, each object
validates against the Kubernetes schemas (kubernetes-validate), the alert rules pass
``promtool``, every gpupool container's command line and config file parse with the real
gpupool, every environment variable is one gpupool reads, and names, ports, URLs and
NetworkPolicies line up across the two namespaces and the Zero to JupyterHub values
(validated against the chart's schema). The pods themselves (namespaces, Pod Security, the
agent's pod, homes): tests/deploy/test_deploy_k8s_pods.py; the pods overlay's agent and the worker
pods it makes: tests/deploy/test_deploy_k8s_worker_pods.py.

Without ``kubectl`` (or ``promtool``, or the z2jh reference folder) the tests that need it
skip and say why. Nothing here talks to a cluster: deploy/kubernetes/README.md says what
only a real cluster can show.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_k8s import (AGENTS_NS, DOWNWARD, K8S, MONITORING_NS, USERS_NS, WORKER_PODS, Z2JH_REF,
                        config_text, config_value, env_values, expanded_command, find, gpupool_containers, matches,
                        merged, namespace, one, option, pod_spec, rendered, service_url, workloads, z2jh_values)
from deploy_parse import ROOT, check_command, check_config_sections, config_assignments, environment_names_read

__all__ = ["rendered"]  # the fixture
#: Variables a gpupool container is given that the scan of gpupool's sources (GPUPOOL_*, JUPYTERHUB_*,
#: CUDA_* names) does not find, and who reads them.
OTHER_READERS = {
    "NODE_NAME": "the agent's command line, $(NODE_NAME)",
    "POD_IP": "the agent's command line, $(POD_IP), and its readiness probe",
    "NVIDIA_VISIBLE_DEVICES": "the NVIDIA container runtime",
    "NVIDIA_DRIVER_CAPABILITIES": "the NVIDIA container runtime",
    "POD_NAME": "the pod launcher, the worker pods' owner (c.KubernetesLauncher.owner_name)",
    "POD_UID": "the pod launcher, the worker pods' owner (c.KubernetesLauncher.owner_uid)",
    "POD_NAMESPACE": "the pod launcher, the worker pods' namespace (c.KubernetesLauncher.namespace)",
}
RUNBOOKS = ROOT / "docs" / "runbooks.md"
LAUNCHER_SOURCE = ROOT / "node" / "workers" / "launchers" / "kubernetes" / "launcher.py"


# -- rendering and schemas -------------------------------------------------------------------------------------

def test_every_object_validates_against_the_kubernetes_schemas(rendered):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate.utils import latest_version

    version = latest_version()
    for overlay, objects in rendered.items():
        kinds = {o["kind"] for o in objects}
        assert {"Deployment", "DaemonSet", "Service", "Secret", "NetworkPolicy", "ServiceAccount", "Namespace",
                "PriorityClass", "PersistentVolume", "PersistentVolumeClaim", "ServiceMonitor", "PrometheusRule",
                "ConfigMap"} <= kinds, overlay
        for obj in objects:
            if obj["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # no schema there: checked below (promtool, names)
            kubernetes_validate.validate(obj, version, strict=True)
    assert find(rendered["evaluation"], "StatefulSet", "gpupool-postgres", USERS_NS)
    assert not find(rendered["production"], "StatefulSet")


def test_a_broken_object_fails_validation():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate.utils import latest_version

    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"ports": [{"port": "eighty"}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, latest_version(), strict=True)


def test_the_store_comes_from_a_secret_and_migrations_run_at_start(rendered):
    import base64

    for overlay, objects in rendered.items():
        text = config_text(objects, "gpupool-service-config")
        assert 'c.GPUPool.db_url = Path("/etc/gpupool/db/db_url")' in text
        db = [s for s in find(objects, "Secret") if s["metadata"]["name"].startswith("gpupool-db-")]
        assert len(db) == 1 and "db_url" in db[0]["data"] and namespace(db[0]) == USERS_NS, overlay
        url = base64.b64decode(db[0]["data"]["db_url"]).decode()
        assert url.startswith("postgresql+psycopg://"), overlay
        if overlay == "evaluation":
            service, port = service_url(objects, url.replace("postgresql+psycopg", "http", 1), USERS_NS)
            assert matches(service["spec"]["selector"],
                           one(objects, "StatefulSet", "gpupool-postgres")["spec"]["template"]["metadata"]["labels"])
            [postgres] = pod_spec(one(objects, "StatefulSet", "gpupool-postgres"))["containers"]
            assert postgres["livenessProbe"]["exec"]["command"][0] == "pg_isready"
            assert postgres["livenessProbe"]["initialDelaySeconds"] >= 30  # initdb on the first start
            assert set(postgres["resources"]["requests"]) == set(postgres["resources"]["limits"]) == {"cpu", "memory"}
            # The service starts once the store answers, at the address of its URL (no restarts while initdb runs).
            [wait] = pod_spec(one(objects, "Deployment", "gpupool-service"))["initContainers"]
            parts = urlsplit(url.replace("postgresql+psycopg", "http", 1))
            assert f"pg_isready -h {parts.hostname} -p {parts.port} " in wait["command"][-1]
            assert wait["image"] == postgres["image"] and wait["securityContext"]["allowPrivilegeEscalation"] is False
        else:
            assert "initContainers" not in pod_spec(one(objects, "Deployment", "gpupool-service"))
        deployment = one(objects, "Deployment", "gpupool-service")
        assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    # The service migrates the store before it listens, so readiness means migrated.
    from gpupool.hub_plugin import app

    source = Path(app.__file__).read_text()
    assert source.index("store.migrate()") < source.index("bind_sockets(self.port")


def test_the_worker_pods_image_follows_the_overlays_images(rendered, tmp_path):
    """overlays/pods: the workers' image (c.KubernetesLauncher.image, in a config file kustomize's images:
    cannot read) is the overlay's images: entry gpupool-singleuser, copied there by a replacement, so the
    agent's and the workers' images cannot drift apart silently."""
    from deploy_k8s import render

    def worker_image(objects) -> str:
        configmap = one(objects, "ConfigMap", "gpupool-agent-config", AGENTS_NS)
        image = config_value(configmap["data"]["gpupool_config.py"], "KubernetesLauncher.image")
        assert image == configmap["data"]["worker-image"]
        compile(configmap["data"]["gpupool_config.py"], "gpupool_config.py", "exec")
        return image

    kustomization_path = K8S / "overlays" / WORKER_PODS / "kustomization.yaml"
    images = {i["name"]: i for i in yaml.safe_load(kustomization_path.read_text())["images"]}
    singleuser = images["gpupool-singleuser"]
    objects = rendered[WORKER_PODS]
    image = worker_image(objects)
    assert image == f"{singleuser['newName']}:{singleuser['newTag']}"
    agent_image = pod_spec(one(objects, "DaemonSet", "gpupool-agent"))["containers"][0]["image"]
    assert agent_image.rpartition("/")[0] == image.rpartition("/")[0], (agent_image, image)  # the same registry
    assert agent_image.rpartition(":")[2] == image.rpartition(":")[2], (agent_image, image)  # and version
    # Another registry and tag in images: reach the config file.
    kustomization = yaml.safe_load(kustomization_path.read_text())
    for entry in kustomization["images"]:
        if entry["name"] == "gpupool-singleuser":
            entry.update(newName="other.example.net/team/notebook", newTag="9.9.9")
    other = render(tmp_path, f"overlays/{WORKER_PODS}",
                   {f"overlays/{WORKER_PODS}/kustomization.yaml": yaml.safe_dump(kustomization)})
    assert worker_image(other) == "other.example.net/team/notebook:9.9.9"


def test_agents_roll_by_hand_and_keep_their_saved_workers_on_the_node(rendered):
    """Replacing an agent pod interrupts running cells (in-pod workers are saved to the node's disk and
    resumed by the next pod) or ends its leases (worker pods are owned by the agent's pod): every
    overlay rolls agents by hand (OnDelete; the README and the runbook say how). Where the workers are
    saved, the agent's state folder is on the node and the pod has the time the saves may take."""
    from deploy_k8s import IN_AGENT_POD

    for overlay, objects in rendered.items():
        daemonset = one(objects, "DaemonSet", "gpupool-agent", AGENTS_NS)
        assert daemonset["spec"]["updateStrategy"]["type"] == "OnDelete", overlay
        pod = daemonset["spec"]["template"]["spec"]
        [state] = [v for v in pod["volumes"] if v["name"] == "state"]
        if overlay in IN_AGENT_POD:
            assert state["hostPath"]["path"] == "/var/lib/gpupool/agent", state
            assert pod["terminationGracePeriodSeconds"] > 240 + 30, "park_on_stop_timeout and the stop itself"
        else:
            assert state == {"name": "state", "emptyDir": {}}, "Pod Security baseline: no hostPath"
    for text in ((ROOT / "docs" / "runbooks.md").read_text(), (K8S / "README.md").read_text()):
        assert "ends every lease on that node" in text and "gpupool status --all-users" in text


def test_one_worker_account_says_it_keeps_users_apart_from_nobody(rendered):
    """Where every lease runs as the one uid of every home and the agent mounts the whole share, the
    config beside the setting, the README and docs/security.md say so, and name overlays/pods."""
    from deploy_k8s import IN_AGENT_POD

    for overlay in IN_AGENT_POD:
        text = config_text(rendered[overlay], "gpupool-agent-config")
        assert config_value(text, "AgentWorkers.worker_user") == "jovyan"
        assert "WHOLE home share" in text and "overlays/pods" in text
    for doc in ((ROOT / "docs" / "security.md").read_text(), (K8S / "README.md").read_text()):
        assert "every other user's home" in " ".join(doc.split()) and "overlays/pods" in doc


def test_generated_secrets_are_found_by_label(rendered):
    """kustomize hashes the generated Secrets' names (gpupool-db-ggfd457b8m): the runbooks and the README
    find them by ``gpupool.io/secret``, their name without gpupool- and the hash."""
    docs = (ROOT / "docs" / "runbooks.md").read_text() + (K8S / "README.md").read_text()
    assert "-l gpupool.io/secret=db" in docs
    for overlay, objects in rendered.items():
        secrets = [s for s in find(objects, "Secret") if s["metadata"]["name"].startswith("gpupool-")]
        assert {s["metadata"]["labels"]["gpupool.io/secret"] for s in secrets} >= {"db", "tokens"}, overlay
        for secret in secrets:
            label = secret["metadata"]["labels"]["gpupool.io/secret"]
            assert re.fullmatch(rf"gpupool-{label}-[a-z0-9]{{10}}", secret["metadata"]["name"]), secret["metadata"]
    # No command or sentence names a generated Secret by its bare name.
    assert not re.search(r"(Secret|secrets?) `?gpupool-(db|tokens)\b(?!-)|get secrets? gpupool-", docs)


# -- command lines, config files, environment ------------------------------------------------------------------

def test_every_container_command_parses_with_the_real_cli(rendered):
    from gpupool.hub_plugin.app import ServiceApp
    from gpupool.node.agent import NodeAgent

    seen = set()
    for objects in rendered.values():
        for workload, container in gpupool_containers(objects):
            argv = expanded_command(container)
            check_command(argv)
            seen.add(argv[1])
            probe = container["readinessProbe"].get("exec")
            if probe:  # sh -c 'exec gpupool health "http://$POD_IP:8766/health"', as the shell expands it
                assert probe["command"][:2] == ["sh", "-c"]
                shell = re.sub(r"\$(\w+)", lambda m: env_values(container)[m.group(1)], probe["command"][2])
                from deploy_parse import gpupool_commands

                [words] = gpupool_commands(shell.removeprefix("exec "))
                check_command(words)
                seen.add("health")
        for name, app in (("gpupool-service-config", ServiceApp()), ("gpupool-agent-config", NodeAgent())):
            settings = config_assignments(config_text(objects, name))
            # The pod launcher's settings (the pods overlay): the agent lists its class with the launcher's
            # phase 2 (docs/launchers.md); until then they are checked against the class itself.
            for trait in settings.pop("KubernetesLauncher", []):
                from gpupool.node.workers.launchers.kubernetes import KubernetesLauncher

                assert trait in KubernetesLauncher.class_traits(config=True), f"{name}: KubernetesLauncher.{trait}"
            check_config_sections(app, settings, name)
            compile(config_text(objects, name), name, "exec")
    assert seen == {"service", "agent", "health"}


def test_every_environment_variable_is_one_gpupool_reads(rendered):
    known = environment_names_read()
    assert "GPUPOOL_AGENT_TOKEN" in known and "JUPYTERHUB_API_URL" in known  # the scan finds them
    for objects in rendered.values():
        for workload, container in gpupool_containers(objects):
            words = " ".join(container.get("command", []) + container.get("args", []))
            for env in container.get("env", []):
                name = env["name"]
                assert name in known or name in OTHER_READERS, f"{workload['metadata']['name']}: {name} is read by nobody"
                if name.startswith("POD_") and name != "POD_IP":
                    assert f'"{name}"' in LAUNCHER_SOURCE.read_text(), f"the pod launcher does not read {name}"
                if name == "NODE_NAME":
                    assert f"$({name})" in words


# -- names, ports and URLs line up -----------------------------------------------------------------------------

def test_services_select_pods_of_their_namespace_and_name_their_ports(rendered):
    for objects in rendered.values():
        for service in find(objects, "Service"):
            pods = [w for w in workloads(objects) if namespace(w) == namespace(service)
                    and matches(service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
            assert pods, f"Service {service['metadata']['name']} selects no pod of its namespace"
            for port in service["spec"]["ports"]:
                names = {p.get("name") for w in pods for c in pod_spec(w)["containers"] for p in c.get("ports", [])}
                assert port["targetPort"] in names, service["metadata"]["name"]


def test_ports_and_urls_line_up(rendered):
    for objects in rendered.values():
        service_workload = one(objects, "Deployment", "gpupool-service")
        service_pod, agent_pod = pod_spec(service_workload), pod_spec(one(objects, "DaemonSet", "gpupool-agent"))
        service_argv = expanded_command(service_pod["containers"][0])
        agent = agent_pod["containers"][0]
        agent_argv = expanded_command(agent)
        service_port = int(option(service_argv, "port"))
        agent_port = int(option(agent_argv, "port"))
        assert service_pod["containers"][0]["ports"][0]["containerPort"] == service_port
        assert agent["ports"][0]["containerPort"] == agent_port
        assert option(service_argv, "ip") == "0.0.0.0" and option(agent_argv, "ip") == DOWNWARD["status.podIP"]

        text = config_text(objects, "gpupool-service-config")
        base_url = config_value(text, "GPUPool.base_url")
        public = config_value(text, "GPUPool.public_url")
        env = {e["name"]: e.get("value") for e in service_pod["containers"][0]["env"]}
        assert env["JUPYTERHUB_SERVICE_PREFIX"] == base_url == f"/services/{env['JUPYTERHUB_SERVICE_NAME']}/"
        assert env["JUPYTERHUB_CLIENT_ID"] == f"service-{env['JUPYTERHUB_SERVICE_NAME']}"
        assert env["JUPYTERHUB_OAUTH_CALLBACK_URL"] == base_url + "oauth_callback"
        # Kernels (the users' namespace) and agents (their own) reach the service at the Service in front of it.
        for url, from_ns in ((public, USERS_NS), (option(agent_argv, "service-url"), AGENTS_NS)):
            service, port = service_url(objects, url, from_ns)
            assert port["targetPort"] == "http" and urlsplit(url).path.rstrip("/") + "/" == base_url
            assert namespace(service) == namespace(service_workload) == USERS_NS
            assert matches(service["spec"]["selector"], service_workload["spec"]["template"]["metadata"]["labels"])
        for probe in ("readinessProbe", "livenessProbe"):
            assert service_pod["containers"][0][probe]["httpGet"]["port"] == "http"
        assert service_pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == base_url + "api/v1/health"
        # The agent's readiness asks its own /health (503 with words when it refuses); liveness /health/live.
        assert f'"http://$POD_IP:{agent_port}/health"' in agent["readinessProbe"]["exec"]["command"][2]
        assert agent["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
        from gpupool.node.agent_http import agent_routes

        assert {"/health", "/health/live"} <= {path for path, _ in agent_routes()}
        for monitor in find(objects, "ServiceMonitor"):
            target = [s for s in find(objects, "Service", ns=namespace(monitor))
                      if matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
            assert len(target) == 1, monitor["metadata"]["name"]
            endpoint = monitor["spec"]["endpoints"][0]
            assert endpoint["port"] in {p["name"] for p in target[0]["spec"]["ports"]}
            expected = base_url + "metrics" if target[0]["metadata"]["name"] == "gpupool-service" else "/metrics"
            assert endpoint["path"] == expected
            # The metrics token, never a user's: the same Secret key the service and agents mount, in the
            # ServiceMonitor's own namespace (the operator reads it there).
            secret = endpoint["authorization"]["credentials"]
            assert secret["key"] == "metrics_token" and one(objects, "Secret", secret["name"], namespace(monitor))
        assert "--metrics-token-file=/etc/gpupool/secrets/metrics_token" in agent_argv
        assert 'c.GPUPool.metrics_token_file = str(secrets / "metrics_token")' in text
        # Each namespace's pods mount the token Secret of their own namespace.
        for workload in workloads(objects):
            for volume in pod_spec(workload).get("volumes", []):
                if "secret" in volume:
                    assert one(objects, "Secret", volume["secret"]["secretName"], namespace(workload))


def peers(spec: dict, own_ns: str) -> list[tuple[str | None, dict | None]]:
    """``(namespace or None for "any labelled", pod labels or None for every pod)`` per ingress source."""
    out = []
    for rule in spec["ingress"]:
        for source in rule["from"]:
            ns_labels = source.get("namespaceSelector", {}).get("matchLabels")
            pods = source.get("podSelector", {}).get("matchLabels")
            if ns_labels is None:
                ns = own_ns
            else:
                ns = ns_labels.get("kubernetes.io/metadata.name") or f"labelled {ns_labels}"
            out.append((ns, pods))
    return out


def admits(spec: dict, direction: str, own_ns: str, peer_ns: str, peer_labels: dict, port: int) -> bool:
    """Whether one policy's ``direction`` ("ingress" or "egress") rules admit TCP ``port`` with a pod
    labelled ``peer_labels`` in ``peer_ns`` (a namespace's only label here: its name), as the
    NetworkPolicy API reads them: a rule without ``from``/``to`` admits every peer, one without
    ``ports`` every port."""
    for rule in spec.get(direction, []):
        sources = rule.get("from" if direction == "ingress" else "to")
        if sources is not None and not any(
                matches(s.get("namespaceSelector", {}).get("matchLabels", {}), {"kubernetes.io/metadata.name": peer_ns})
                and (peer_ns == own_ns or "namespaceSelector" in s)
                and matches(s.get("podSelector", {}).get("matchLabels", {}), peer_labels) for s in sources):
            continue
        if "ports" not in rule or any(p.get("protocol", "TCP") == "TCP" and p["port"] <= port <= p.get("endPort", p["port"])
                                      for p in rule["ports"]):
            return True
    return False


def worker_ports(objects) -> dict[str, int]:
    """The fixed ports of a worker pod, from the pods overlay's agent config (or the launcher's default)."""
    from gpupool.node.workers.launchers.kubernetes import KubernetesLauncher, WorkerPorts

    text = config_text(objects, "gpupool-agent-config")
    first = config_value(text, "KubernetesLauncher.first_port") if "KubernetesLauncher.first_port" in text \
        else KubernetesLauncher.class_traits()["first_port"].default_value
    return WorkerPorts(first).by_name()


def test_network_policies_open_only_what_is_used_across_the_namespaces(rendered):
    notebook = {"component": "singleuser-server"}
    service_pods = {"app.kubernetes.io/name": "gpupool", "app.kubernetes.io/component": "service"}
    agent_pods = {"app.kubernetes.io/name": "gpupool", "app.kubernetes.io/component": "agent"}
    monitoring = ("labelled {'gpupool.io/monitoring': 'true'}", None)
    for overlay, objects in rendered.items():
        policies = {p["metadata"]["name"]: p for p in find(objects, "NetworkPolicy")}
        for name, policy in policies.items():
            if name == "gpupool-worker-pods":
                continue  # it selects the pods the agent makes: tests/deploy/test_deploy_k8s_worker_pods.py
            assert any(namespace(w) == namespace(policy) and matches(policy["spec"]["podSelector"]["matchLabels"],
                                                                    w["spec"]["template"]["metadata"]["labels"])
                       for w in workloads(objects)), f"{name} selects no pod of its namespace"
        spec = {name: p["spec"] for name, p in policies.items()}
        own = {name: namespace(p) for name, p in policies.items()}
        agent_argv = expanded_command(pod_spec(one(objects, "DaemonSet", "gpupool-agent"))["containers"][0])
        agent_port = int(option(agent_argv, "port"))
        service_port = one(objects, "Service", "gpupool-service")["spec"]["ports"][0]["port"]

        def ports(policy):
            return [(p["port"], p.get("endPort", p["port"])) for rule in policy["ingress"] for p in rule["ports"]]

        # Only the service (from the users' namespace) and Prometheus reach the agents' HTTP port; only
        # notebooks (from the users' namespace) the workers' ports; the service hears its notebooks, hub,
        # proxy, the agents from theirs, and Prometheus.
        assert ports(spec["gpupool-agent-http"]) == [(agent_port, agent_port)]
        # ... and the other agents: a parked lease resuming on another node has its agent fetch the spill
        # from the agent that holds it (GET /workers/{id}/spill).
        assert peers(spec["gpupool-agent-http"], AGENTS_NS) == [(USERS_NS, service_pods), monitoring,
                                                                (AGENTS_NS, agent_pods)]
        assert peers(spec["gpupool-service"], USERS_NS) == [
            (USERS_NS, notebook), (USERS_NS, {"component": "hub"}), (USERS_NS, {"component": "proxy"}),
            (AGENTS_NS, agent_pods), monitoring]
        assert own["gpupool-agent-http"] == AGENTS_NS and own["gpupool-service"] == USERS_NS
        assert ports(spec["gpupool-service"]) == [(service_port, service_port)]
        if overlay == WORKER_PODS:
            # Workers are pods of their own beside the agent, on fixed ports: notebooks and the agents
            # reach those ports, and nothing reaches the agent's pod but its HTTP port.
            assert "gpupool-agent-workers" not in spec
            worker_pods = {"app.kubernetes.io/name": "gpupool", "app.kubernetes.io/component": "worker"}
            assert spec["gpupool-worker-pods"]["podSelector"]["matchLabels"] == worker_pods
            assert own["gpupool-worker-pods"] == AGENTS_NS
            # Notebooks and agents on every kernel port; the other workers on the transfer port alone (a
            # move between nodes: the new worker fetches the old one's variables), both ways.
            transfer = worker_ports(objects)["transfer_port"]
            assert peers(spec["gpupool-worker-pods"], AGENTS_NS) == [
                (USERS_NS, notebook), (AGENTS_NS, agent_pods), (AGENTS_NS, worker_pods)]
            assert ports(spec["gpupool-worker-pods"]) == [(50000, 50005), (transfer, transfer)]
            assert admits(spec["gpupool-worker-pods"], "ingress", AGENTS_NS, AGENTS_NS, worker_pods, transfer)
            assert admits(spec["gpupool-worker-pods"], "egress", AGENTS_NS, AGENTS_NS, worker_pods, transfer)
            assert not admits(spec["gpupool-worker-pods"], "ingress", AGENTS_NS, AGENTS_NS, worker_pods, transfer - 5)
            assert not admits(spec["gpupool-worker-pods"], "egress", AGENTS_NS, AGENTS_NS, agent_pods, agent_port)
            assert admits(spec["gpupool-worker-pods"], "egress", AGENTS_NS, "kube-system", {"k8s-app": "kube-dns"}, 53)
        else:
            # Workers run inside the agents' pods: a move between nodes is agent pod to agent pod, to the
            # old worker's transfer_port, a free port like its ZeroMQ ones.
            assert peers(spec["gpupool-agent-workers"], AGENTS_NS) == [(USERS_NS, notebook), (AGENTS_NS, agent_pods)]
            assert admits(spec["gpupool-agent-workers"], "ingress", AGENTS_NS, AGENTS_NS, agent_pods, 40123)
            assert own["gpupool-agent-workers"] == AGENTS_NS and "gpupool-worker-pods" not in spec
            worker_ranges = ports(spec["gpupool-agent-workers"])
            assert not any(lo <= agent_port <= hi for lo, hi in worker_ranges)
            assert sum(hi - lo + 1 for lo, hi in worker_ranges) == 65535 - 1024 + 1 - 1  # every unprivileged port but the agent's
            # The workers' ZeroMQ ports and their data plane's transfer_port are free ports the kernel
            # picks (binding port 0): all of its ephemeral range must be admitted to notebooks.
            low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
            assert all(any(lo <= p <= hi for lo, hi in worker_ranges) for p in range(low, high + 1) if p != agent_port)
        if "gpupool-postgres" in spec:
            assert peers(spec["gpupool-postgres"], USERS_NS) == [(USERS_NS, service_pods)]
        # The namespaces named in policies are the ones the objects live in.
        assert {namespace(w) for w in workloads(objects)} == {USERS_NS, AGENTS_NS}


def test_no_api_access_for_gpupool_pods_but_the_pod_launching_agent(rendered):
    for overlay, objects in rendered.items():
        assert not find(objects, "ClusterRole") and not find(objects, "ClusterRoleBinding")
        if overlay == WORKER_PODS:  # the agent's Role over its namespace's pods: test_deploy_k8s_worker_pods.py
            [binding] = find(objects, "RoleBinding")
            assert namespace(binding) == namespace(one(objects, "Role", binding["roleRef"]["name"])) == AGENTS_NS
            assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpupool-agent", "namespace": AGENTS_NS}]
        else:
            assert not find(objects, "Role") and not find(objects, "RoleBinding")
        for account in find(objects, "ServiceAccount"):
            assert account["automountServiceAccountToken"] is False
        for workload in workloads(objects):
            pod = pod_spec(workload)
            token = overlay == WORKER_PODS and workload["metadata"]["name"] == "gpupool-agent"
            assert pod["automountServiceAccountToken"] is token, workload["metadata"]["name"]
            for container in pod["containers"]:
                context = container["securityContext"]
                if context.get("privileged"):  # the agent (test_deploy_k8s_pods.py): its namespace only
                    assert namespace(workload) == AGENTS_NS
                    continue
                assert context["allowPrivilegeEscalation"] is False
                assert "ALL" in context["capabilities"]["drop"]


# -- Prometheus rules and the Grafana dashboard ----------------------------------------------------------------

def rule_groups(objects) -> dict:
    return one(objects, "PrometheusRule", "gpupool")["spec"]


def alerts_of(objects) -> dict[str, dict]:
    return {r["alert"]: r for g in rule_groups(objects)["groups"] for r in g["rules"]}


def test_monitoring_objects_are_found_by_kube_prometheus_stack(rendered):
    component = yaml.safe_load((K8S / "components" / "kube-prometheus-stack" / "release-label.yaml").read_text())
    release = component["labels"]["release"]
    for overlay, objects in rendered.items():
        assert "../../components/kube-prometheus-stack" in yaml.safe_load(
            (K8S / "overlays" / overlay / "kustomization.yaml").read_text())["components"]
        for obj in [*find(objects, "ServiceMonitor"), *find(objects, "PrometheusRule")]:
            assert obj["metadata"]["labels"]["release"] == release, obj["metadata"]["name"]
        assert not [o for o in objects if o["kind"] not in ("ServiceMonitor", "PrometheusRule")
                    and "release" in o["metadata"].get("labels", {})]
        dashboard = one(objects, "ConfigMap", "gpupool-grafana-dashboard")
        assert namespace(dashboard) == namespace(one(objects, "PrometheusRule", "gpupool")) == MONITORING_NS
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_every_alert_has_a_runbook(rendered):
    headings = {re.sub(r"[^a-z0-9 -]", "", line[3:].strip().lower()).replace(" ", "-")
                for line in RUNBOOKS.read_text().splitlines() if line.startswith("## ")}
    for name, alert in alerts_of(rendered["evaluation"]).items():
        url = alert["annotations"]["runbook_url"]
        assert url.startswith("https://github.com/gpupool/gpupool/blob/main/docs/runbooks.md#"), url
        assert url.rpartition("#")[2] == name.lower() and name.lower() in headings, f"{name}: no runbook section"


def test_alert_rules_pass_promtool(rendered, tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package 'prometheus'; make install adds it as root)")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule_groups(rendered["evaluation"])))
    result = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # ... and they fire: a node lost for 3 minutes, a pool 100% allocated and refusing.
    alerts = alerts_of(rendered["evaluation"])

    def annotations(alert: str, labels: dict, value: str = "") -> dict:
        def fill(text: str) -> str:
            text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)
            return text.replace("{{ $value | humanizePercentage }}", value)
        return {k: fill(v) for k, v in alerts[alert]["annotations"].items()}

    lost = {"node": "gpu-1", "state": "lost"}
    # The agents' pods are the DaemonSet's (its name and Kubernetes' 5 characters); the pods overlay's workers
    # share their namespace.
    from gpupool.node.workers.launchers.kubernetes import pod_name

    agent_pod, worker_pod = DOWNWARD["metadata.name"], pod_name("0f0e0d0c-0000-4000-8000-000000000001")
    for objects in rendered.values():
        daemonset = one(objects, "DaemonSet", "gpupool-agent")
        assert namespace(daemonset) == AGENTS_NS and agent_pod.startswith(daemonset["metadata"]["name"] + "-")
    tests = tmp_path / "tests.yaml"
    tests.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": 'gpupool_nodes{node="gpu-1",state="lost"}', "values": "1x20"},
            {"series": 'gpupool_gpu_allocated_ratio{node="gpu-1",gpu="0"}', "values": "1x40"},
            {"series": 'gpupool_lease_refusals_total{reason="no_fraction"}', "values": "0+1x40"},
        ],
        "alert_rule_test": [
            {"eval_time": "1m", "alertname": "GPUPoolNodeLost", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "GPUPoolNodeLost",
             "exp_alerts": [{"exp_labels": {"severity": "warning", **lost},
                             "exp_annotations": annotations("GPUPoolNodeLost", lost)}]},
            {"eval_time": "35m", "alertname": "GPUPoolFull",
             "exp_alerts": [{"exp_labels": {"severity": "info"},
                             "exp_annotations": annotations("GPUPoolFull", {}, "100%")}]},
            # No target at all (the ServiceMonitor not selected): Down cannot fire, Absent does.
            {"eval_time": "15m", "alertname": "GPUPoolServiceDown", "exp_alerts": []},
            {"eval_time": "15m", "alertname": "GPUPoolServiceAbsent",
             "exp_alerts": [{"exp_labels": {"severity": "critical", "service": "gpupool-service"},
                             "exp_annotations": annotations("GPUPoolServiceAbsent", {})}]},
        ]}, {
        # An agent pod not ready fires; a worker pod of overlays/pods (same namespace) still starting does not.
        "interval": "1m",
        "input_series": [
            {"series": f'kube_pod_status_ready{{namespace="{AGENTS_NS}",pod="{agent_pod}",condition="false"}}',
             "values": "1x20"},
            {"series": f'kube_pod_status_ready{{namespace="{AGENTS_NS}",pod="{worker_pod}",condition="false"}}',
             "values": "1x20"}],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": "GPUPoolAgentNotReady",
             "exp_alerts": [{"exp_labels": {"severity": "warning", "namespace": AGENTS_NS, "pod": agent_pod},
                             "exp_annotations": annotations("GPUPoolAgentNotReady", {"pod": agent_pod})}]}],
        }, {
        "interval": "1m",
        "input_series": [{"series": 'up{service="gpupool-service",job="gpupool-service"}', "values": "1x20"},
                         {"series": 'up{service="gpupool-agent",job="gpupool-agent"}', "values": "1x20"}],
        "alert_rule_test": [{"eval_time": "15m", "alertname": "GPUPoolServiceAbsent", "exp_alerts": []},
                            {"eval_time": "15m", "alertname": "GPUPoolAgentsAbsent", "exp_alerts": []}],
        }]}))
    result = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def exported_metric_names() -> set[str]:
    """Sample names the service's and the agent's registries export."""
    from gpupool.hub_plugin.db import Store
    from gpupool.hub_plugin.metrics import Metrics
    from gpupool.node.agent_metrics import AgentMetrics
    from gpupool.wire.nodes import GPUInfo
    from prometheus_client.parser import text_string_to_metric_families
    import tempfile

    names = set()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"sqlite:///{tmp}/s.sqlite")
        store.migrate()
        texts = [Metrics(store, 0).render().decode()]
        store.close()
    gpu = GPUInfo("GPU-1", "NVIDIA A100-SXM4-80GB", 0, 80 * 2**30)
    agent = AgentMetrics("gpu-node-1")
    agent.update([gpu], [{"uuid": "GPU-1", "memory_used": 1, "utilization": 50.0}], {"GPU-1": 1}, None)
    texts.append(agent.render().decode())
    for text in texts:
        for family in text_string_to_metric_families(text):
            names.add(family.name)
            names.update({f"{family.name}{s}" for s in ("_total", "_bucket", "_sum", "_count")})
    return names


def test_rules_and_dashboard_use_metrics_that_exist(rendered):
    exported = exported_metric_names()
    used = set(re.findall(r"\bgpupool_[a-z_]+", json.dumps(rule_groups(rendered["evaluation"]))))
    dashboard = json.loads((K8S / "base" / "monitoring" / "grafana" / "gpupool-dashboard.json").read_text())
    used_dash = set(re.findall(r"\bgpupool_[a-z_]+", json.dumps(dashboard)))
    assert used and used_dash
    assert used <= exported, used - exported
    assert used_dash <= exported, used_dash - exported
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("allocation", "per user", "queue", "reclaim"):
        assert topic in titles
    configmap = one(rendered["evaluation"], "ConfigMap", "gpupool-grafana-dashboard")
    assert json.loads(configmap["data"]["gpupool-dashboard.json"]) == dashboard


# -- Zero to JupyterHub values ---------------------------------------------------------------------------------

def test_z2jh_values_validate_against_the_chart_schema():
    jsonschema = pytest.importorskip("jsonschema")
    if not (Z2JH_REF / "values.schema.yaml").is_file():
        pytest.skip(f"no Zero to JupyterHub reference at {Z2JH_REF} (values.schema.yaml, values.yaml)")
    schema = yaml.safe_load((Z2JH_REF / "values.schema.yaml").read_text())
    defaults = yaml.safe_load((Z2JH_REF / "values.yaml").read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(merged(defaults, z2jh_values()))]
    assert not errors, errors
    typo = merged(defaults, {"singleuser": {"extraEnvs": {"GPUPOOL_URL": "x"}}})  # the schema catches typos
    assert list(validator.iter_errors(typo))


def test_z2jh_values_match_configure_and_the_manifests(rendered):
    from gpupool.hub_plugin.hub import custom_scopes, roles

    values = z2jh_values()
    objects = rendered["evaluation"]
    service_env = {e["name"]: e.get("value") or e.get("valueFrom")
                   for e in pod_spec(one(objects, "Deployment", "gpupool-service"))["containers"][0]["env"]}
    name = service_env["JUPYTERHUB_SERVICE_NAME"]
    entry = values["hub"]["services"][name]
    assert service_env["JUPYTERHUB_API_TOKEN"]["secretKeyRef"] == {"name": "hub", "key": f"hub.services.{name}.apiToken"}
    service, port = service_url(objects, entry["url"], USERS_NS)  # the hub runs in the users' namespace
    assert service["metadata"]["name"] == "gpupool-service"
    # Roles and scopes as configure() makes them (with admin_group="gpu-admins").
    expected = {r["name"]: {k: v for k, v in r.items() if k != "name" and v} for r in
                roles(name, user_groups=None, admin_group="gpu-admins", admin_users=())}
    assert values["hub"]["loadRoles"] == expected
    assert values["hub"]["config"]["JupyterHub"]["custom_scopes"] == custom_scopes()
    assert "custom:gpupool:use!user" in values["hub"]["config"]["KubeSpawner"]["server_token_scopes"]
    # Kernels reach the service at its public URL.
    public = config_value(config_text(objects, "gpupool-service-config"), "GPUPool.public_url")
    assert values["singleuser"]["extraEnv"]["GPUPOOL_URL"] == public.rstrip("/")
    # Singleuser egress opens exactly what the gpupool NetworkPolicies admit from notebooks, in the
    # namespaces those live in.
    policies = {p["metadata"]["name"]: p for p in find(objects, "NetworkPolicy")}
    egress = {rule["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: rule
              for rule in values["singleuser"]["networkPolicy"]["egress"]}
    assert egress["agent"]["ports"] == policies["gpupool-agent-workers"]["spec"]["ingress"][0]["ports"]
    assert egress["agent"]["to"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": namespace(policies["gpupool-agent-workers"])}
    assert egress["service"]["ports"] == policies["gpupool-service"]["spec"]["ingress"][0]["ports"]
    assert "namespaceSelector" not in egress["service"]["to"][0]  # the notebooks' own namespace
    # ... and to the worker pods of the pods overlay, on the ports and in the namespace of their policy.
    workers = one(rendered[WORKER_PODS], "NetworkPolicy", "gpupool-worker-pods")
    assert egress["worker"]["ports"] == workers["spec"]["ingress"][0]["ports"]
    assert egress["worker"]["to"][0]["podSelector"]["matchLabels"] == workers["spec"]["podSelector"]["matchLabels"]
    assert egress["worker"]["to"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": namespace(workers)}
    assert set(egress) == {"service", "agent", "worker"}


def test_z2jh_release_hook_reaches_the_service_route(tmp_path):
    """The inlined post_stop_hook POSTs what hub_events.py reads, with the service's token."""
    from traitlets.config import Config

    from gpupool.hub_plugin.handlers import hub_events

    c = Config()
    c.JupyterHub.services = [{"name": "gpupool", "url": "http://gpupool-service:8765", "api_token": "t0k"}]
    code = z2jh_values()["hub"]["extraConfig"]["gpupool-release-on-stop"]
    exec(compile(code, "extraConfig", "exec"), {"c": c})
    hook = c.KubeSpawner.post_stop_hook
    assert callable(hook)
    route = [path for path, handler in hub_events.routes if handler is hub_events.ServerStoppedHandler]
    assert route and f'"/services/gpupool/{route[0].lstrip("/")}"' in code


# -- Dockerfiles (their build context and pip steps: tests/deploy/test_deploy_images.py) -----------------------------

@pytest.mark.parametrize("name", ["Dockerfile.service", "Dockerfile.agent", "Dockerfile.singleuser"])
def test_dockerfiles_pin_their_bases_and_run_real_commands(name):
    from deploy_parse import dockerfile_instructions, gpupool_commands

    instructions = dockerfile_instructions(K8S / "docker" / name)
    assert instructions[0][0] in ("FROM", "ARG")
    ran, args = [], {}
    for op, rest in instructions:
        if op == "ARG":
            key, _, default = rest.partition("=")
            args[key.strip()] = default.strip()
        elif op in ("RUN", "CMD"):
            if rest.startswith("["):
                commands = [json.loads(rest)] if Path(json.loads(rest)[0]).name == "gpupool" else []
            else:
                commands = gpupool_commands(rest)
            for argv in commands:
                check_command(argv)
                ran.append(argv[1])
        elif op == "FROM":
            # The base is a build argument (the digest-or-tag knob) whose default is pinned by tag.
            knob = re.fullmatch(r"\$\{(\w+)\}", rest.split()[0])
            assert knob and knob.group(1) in args, f"{name}: FROM {rest}: the base should be an ARG"
            default = args[knob.group(1)]
            if name == "Dockerfile.agent":
                assert default == "", "the agent's base is the singleuser image you built: no default"
                continue
            assert default.startswith(("docker.io/library/", "quay.io/jupyter/")), default
            tag = default.rpartition(":")[2]
            assert "latest" not in tag and re.search(r"\d+[.-]\d+[.-]\d+", tag), f"{name}: {default} is not pinned"
    assert ran, f"{name} runs no gpupool command"
    assert "--version" in ran
