"""The Kubernetes launcher's pod builder (pure: a lease, the agent's pod template
and the settings in, a Pod and its connection Secret out): every manifest it
builds validates with kubernetes-validate, strictly (unknown fields fail),
against the newest Kubernetes it knows; the fields that matter are checked
one by one. Its API calls (:class:`PodClient`, the official ``kubernetes``
client) are checked against a stand-in for the API server: no cluster runs here.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from traitlets.config import Config

from gpupool.node.workers import WorkerSpec
from gpupool.node.workers.launchers.kubernetes import (KubernetesLauncher, OwnerPod, PodClient, PodError,
                                                              PodSettings, WorkerPorts, connection_info,
                                                              connection_secret, pod_name, worker_pod)
from gpupool.node.workers.launchers.kubernetes.pods import escape_username, label_value
from gpupool.wire.nodes import GPUInfo

kubernetes_validate = pytest.importorskip("kubernetes_validate")
from kubernetes_validate.utils import latest_version  # noqa: E402

GiB = 2**30
GPUS = tuple(GPUInfo(f"GPU-{i}", "NVIDIA A100-SXM4-80GB", i, 80 * GiB) for i in range(4))
SITE = PodSettings(namespace="gpupool-agents", node_name="gpu-1", image="registry.example.org/gpupool/singleuser:1.2.0",
                   home_claim="gpupool-home",
                   owner=OwnerPod("gpupool-agent-x7k2p", "6f1b96b0-aaaa-4bbb-8ccc-0123456789ab"))
TEMPLATE = {
    "metadata": {"labels": {"team": "ml", "gpupool.io/lease": "template-must-not-win"},
                 "annotations": {"example.org/cost-centre": "42"}},
    "spec": {
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "imagePullSecrets": [{"name": "registry"}],
        "priorityClassName": "interactive",
        "runtimeClassName": "nvidia",
        "containers": [{"name": "worker", "imagePullPolicy": "IfNotPresent",
                        "env": [{"name": "HF_HOME", "value": "/cache/hf"}, {"name": "OMP_NUM_THREADS", "value": "1"}],
                        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]},
                       {"name": "log-shipper", "image": "registry.example.org/shipper:1"}],
        "volumes": [{"name": "cache", "emptyDir": {"sizeLimit": "10Gi"}}],
    },
}
ENV = {"PATH": "/opt/conda/bin:/usr/bin", "OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "GPU-0",
       "NVIDIA_VISIBLE_DEVICES": "all", "GPUPOOL_LEASE_ID": "L-1"}


def lease(lease_id="L-1", owner="ann", gpus=1, fraction=1.0, cpus=None, memory=None) -> WorkerSpec:
    return WorkerSpec(lease_id, owner, GPUS[:gpus], fraction, 40 * GiB, cpus=cpus, host_memory=memory)


LEASES = [lease(), lease("L-2", "bob", gpus=4, cpus=16, memory=128 * GiB), lease("L-half", fraction=0.5, cpus=0.5),
          lease("l" * 100, "Ann.Smith@example.org", fraction=0.25), lease("x.y_z-9", "ünïcode", gpus=2)]
SETTINGS = [SITE, PodSettings(namespace="ns", node_name="n1", image="img:1"),
            PodSettings(namespace="gpupool-agents", node_name="gpu-2", image="img:2",
                        slice_resource="nvidia.com/gpu.shared",
                        labels={"site": "lab"}, ports=WorkerPorts(40000)),
            PodSettings(namespace="gpupool-agents", node_name="gpu-3", image="img:3",
                        slice_resource="nvidia.com/mig-1g.10gb",
                        gpu_resource="nvidia.com/gpu", home_claim="homes", home_mount="/home/jovyan",
                        home_subpath="home/{username}")]


def validate(obj) -> None:
    kubernetes_validate.validate(obj, latest_version(), strict=True)


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("template", [{}, TEMPLATE])
def test_every_pod_and_secret_it_builds_validates_strictly(settings, template):
    for one in LEASES:
        pod = worker_pod(one, settings, template, ENV, ["--IPKernelApp.extra_extensions=gpupool.x"])
        validate(pod)
        uid = "0f0e0d0c-0000-4000-8000-000000000001"
        validate(connection_secret(one, settings, json.dumps(connection_info("k" * 64, settings)), uid))
        assert re.match(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", pod["metadata"]["name"])


def test_a_broken_pod_fails_validation():
    pod = worker_pod(lease(), SITE, {}, ENV)
    pod["spec"]["containers"][0]["resourcez"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(pod)


def container(pod) -> dict:
    assert pod["spec"]["containers"][0]["name"] == "worker"
    return pod["spec"]["containers"][0]


def test_whole_gpus_cpus_and_memory_are_requested_and_limited():
    pod = worker_pod(lease("L-2", gpus=4, cpus=3.5, memory=16 * GiB + 1), SITE, {}, ENV)
    assert container(pod)["resources"] == {"requests": {"cpu": "3500m", "memory": "16385Mi"},
                                           "limits": {"cpu": "3500m", "memory": "16385Mi", "nvidia.com/gpu": "4"}}
    defaults = container(worker_pod(lease(), SITE, {}, ENV))["resources"]
    assert defaults["requests"] == {"cpu": "1000m", "memory": "4096Mi"}  # the settings' when the lease names none


def test_a_slice_asks_for_the_resource_the_admin_names_else_a_whole_gpu():
    half = lease("L-half", fraction=0.5)
    assert container(worker_pod(half, SITE, {}, ENV))["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for name in ("nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb"):
        limits = container(worker_pod(half, PodSettings(namespace="n", node_name="x", image="i", slice_resource=name),
                                      {}, ENV))["resources"]["limits"]
        assert limits[name] == "1" and "nvidia.com/gpu" not in limits
    whole = PodSettings(namespace="n", node_name="x", image="i", slice_resource="nvidia.com/gpu.shared")
    assert container(worker_pod(lease(gpus=2), whole, {}, ENV))["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_the_pod_runs_on_the_agents_node_owned_by_the_agents_pod():
    pod = worker_pod(lease(), SITE, {}, ENV)
    spec = pod["spec"]
    assert spec["nodeName"] == "gpu-1" and spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert pod["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Pod", "name": "gpupool-agent-x7k2p",
                                                   "uid": "6f1b96b0-aaaa-4bbb-8ccc-0123456789ab",
                                                   "controller": False, "blockOwnerDeletion": False}]
    assert "ownerReferences" not in worker_pod(lease(), SETTINGS[1], {}, ENV)["metadata"]
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
    assert container(pod)["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def test_labels_select_the_lease_and_annotations_keep_what_labels_cannot():
    long_id = "l" * 100
    pod = worker_pod(lease(long_id, "Ann.Smith@example.org"), SITE, TEMPLATE, ENV)
    meta = pod["metadata"]
    assert meta["labels"]["app.kubernetes.io/component"] == "worker"
    assert meta["labels"]["gpupool.io/node"] == "gpu-1" and meta["labels"]["team"] == "ml"
    assert meta["labels"]["gpupool.io/lease"] == label_value(long_id) != long_id
    assert len(meta["labels"]["gpupool.io/lease"]) <= 63
    assert meta["annotations"] == {"example.org/cost-centre": "42", "gpupool.io/lease-id": long_id,
                                   "gpupool.io/owner": "Ann.Smith@example.org"}
    assert worker_pod(lease("L-9"), SITE, TEMPLATE, ENV)["metadata"]["labels"]["gpupool.io/lease"] == "L-9"
    assert pod_name("L-1") != pod_name("l-1")  # lease ids differ by case: pods must too


def test_the_owners_home_is_mounted_and_the_connection_file_comes_from_a_secret():
    pod = worker_pod(lease(owner="Ann.Smith@example.org"), SITE, {}, ENV)
    mounts = container(pod)["volumeMounts"]
    assert {"name": "home", "mountPath": "/home/-41nn-2e-53mith-40example-2eorg",
            "subPath": "-41nn-2e-53mith-40example-2eorg"} in mounts
    assert {"name": "connection", "mountPath": "/var/run/gpupool", "readOnly": True} in mounts
    assert container(pod)["workingDir"] == "/home/-41nn-2e-53mith-40example-2eorg"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["home"] == {"name": "home", "persistentVolumeClaim": {"claimName": "gpupool-home"}}
    assert volumes["connection"]["secret"]["secretName"] == connection_secret(lease(), SITE, "{}")["metadata"]["name"]
    assert container(pod)["command"][:5] == ["/opt/conda/bin/python", "-m", "gpupool.kernelapp", "-f",
                                             "/var/run/gpupool/kernel.json"]
    assert escape_username("ünïcode") == "-c3-bcn-c3-afcode"


def test_the_connection_ports_are_fixed_and_exposed():
    pod = worker_pod(lease(), SETTINGS[2], {}, ENV)
    ports = {p["name"]: p["containerPort"] for p in container(pod)["ports"]}
    assert ports == {"shell": 40000, "iopub": 40001, "stdin": 40002, "control": 40003, "hb": 40004,
                     "transfer": 40005}
    info = connection_info("secret-key", SETTINGS[2])
    assert info["ip"] == "0.0.0.0" and info["shell_port"] == 40000 and info["transfer_port"] == 40005
    secret = connection_secret(lease(), SITE, json.dumps(info), "uid-1")
    assert json.loads(secret["stringData"]["kernel.json"])["key"] == "secret-key"
    assert secret["metadata"]["ownerReferences"][0]["name"] == pod_name("L-1")


def test_the_template_is_kept_and_the_workers_own_fields_win():
    pod = worker_pod(lease(), SITE, TEMPLATE, ENV)
    spec = pod["spec"]
    assert spec["tolerations"] == TEMPLATE["spec"]["tolerations"] and spec["priorityClassName"] == "interactive"
    assert spec["runtimeClassName"] == "nvidia" and spec["imagePullSecrets"] == [{"name": "registry"}]
    assert [c["name"] for c in spec["containers"]] == ["worker", "log-shipper"]
    env = {e["name"]: e["value"] for e in container(pod)["env"]}
    assert env["HF_HOME"] == "/cache/hf" and env["OMP_NUM_THREADS"] == "4"  # the lease's environment wins
    assert "CUDA_VISIBLE_DEVICES" not in env and "NVIDIA_VISIBLE_DEVICES" not in env  # the device plugin's to set
    assert container(pod)["imagePullPolicy"] == "IfNotPresent"
    assert {"name": "cache", "mountPath": "/cache"} in container(pod)["volumeMounts"]
    assert {v["name"] for v in spec["volumes"]} == {"cache", "connection", "home"}
    assert TEMPLATE["spec"]["containers"][0]["env"] == [{"name": "HF_HOME", "value": "/cache/hf"},
                                                        {"name": "OMP_NUM_THREADS", "value": "1"}]  # not changed


def test_bad_settings_and_templates_are_refused_in_words():
    with pytest.raises(ValueError, match="no image for the worker pod"):
        worker_pod(lease(), PodSettings(namespace="n", node_name="x"), {}, ENV)
    with pytest.raises(ValueError, match="PodTemplateSpec"):
        worker_pod(lease(), SITE, {"spec": ["not", "a", "mapping"]}, ENV)
    with pytest.raises(ValueError, match="extended resource"):
        PodSettings(namespace="n", node_name="x", slice_resource="gpu shared")
    with pytest.raises(ValueError, match="namespace and the agent's node"):
        PodSettings(namespace="", node_name="x")
    with pytest.raises(ValueError, match="label"):
        PodSettings(namespace="n", node_name="x", labels={"team": "ML team"})
    with pytest.raises(ValueError, match="ports"):
        WorkerPorts(80)


def test_settings_come_from_config_and_the_template_from_a_yaml_file(tmp_path, monkeypatch):
    monkeypatch.setenv("NODE_NAME", "gpu-7")
    monkeypatch.setenv("POD_NAME", "gpupool-agent-abc")
    monkeypatch.setenv("POD_UID", "uid-7")
    template = tmp_path / "worker-pod.yaml"
    template.write_text("metadata:\n  labels: {team: ml}\nspec:\n  priorityClassName: interactive\n")
    config = Config()
    config.KubernetesLauncher.namespace = "gpupool-agents"
    config.KubernetesLauncher.image = "img:1"
    config.KubernetesLauncher.slice_resource = "nvidia.com/gpu.shared"
    config.KubernetesLauncher.memory = "8GiB"
    config.KubernetesLauncher.pod_template_file = str(template)
    launcher = KubernetesLauncher(config=config)
    settings = launcher.pod_settings()
    assert (settings.node_name, settings.owner, settings.memory) == ("gpu-7", OwnerPod("gpupool-agent-abc", "uid-7"),
                                                                     8 * GiB)
    pod = worker_pod(lease(), settings, launcher.template(), ENV)
    validate(pod)
    assert pod["spec"]["priorityClassName"] == "interactive" and pod["metadata"]["namespace"] == "gpupool-agents"
    for name, trait in KubernetesLauncher.class_own_traits(config=True).items():
        assert "c.KubernetesLauncher." in trait.help, name
    template.write_text("- a list\n")
    with pytest.raises(ValueError, match="not a YAML mapping"):
        launcher.template()
    launcher.pod_template_file = str(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="cannot read the worker pod template"):
        launcher.template()


# -- the API calls, against a stand-in API server ----------------------------------------------------------

class _APIServer(BaseHTTPRequestHandler):
    """Pods and Secrets of namespaces, in memory, as the API server answers them (the paths and shapes the
    official client uses; a 404 or 409 Status where the real one sends them)."""

    objects: dict = {}
    requests: list = []

    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str, message: str) -> None:
        self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                          "message": message, "code": code})

    def _route(self):
        parts = urlsplit(self.path)
        match = re.match(r"^/api/v1/namespaces/([^/]+)/(pods|secrets)(?:/([^/]+))?$", parts.path)
        return match, parse_qs(parts.query)

    def do_POST(self) -> None:
        match, _ = self._route()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(("POST", self.path, body, self.headers.get("Authorization")))
        key = (match.group(1), match.group(2), body["metadata"]["name"])
        if key in self.objects:
            self._status(409, "AlreadyExists", f'{match.group(2)} "{key[2]}" already exists')
            return
        body["metadata"]["uid"] = f"uid-{len(self.objects) + 1}"
        self.objects[key] = body
        self._send(201, body)

    def do_GET(self) -> None:
        match, query = self._route()
        self.requests.append(("GET", self.path, None, self.headers.get("Authorization")))
        ns, kind, name = match.groups()
        if name:
            found = self.objects.get((ns, kind, name))
            if found is None:
                self._status(404, "NotFound", f'{kind} "{name}" not found')
            else:
                self._send(200, found)
            return
        wanted = dict(pair.split("=", 1) for pair in query.get("labelSelector", [""])[0].split(",") if pair)
        items = [o for (n, k, _), o in self.objects.items() if n == ns and k == kind
                 and all(o["metadata"].get("labels", {}).get(a) == b for a, b in wanted.items())]
        self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})

    def do_DELETE(self) -> None:
        match, query = self._route()
        self.requests.append(("DELETE", self.path, None, self.headers.get("Authorization")))
        found = self.objects.pop(match.groups(), None)
        if found is None:
            self._status(404, "NotFound", "not found")
        else:
            self._send(200, found)


@pytest.fixture
def api_server():
    pytest.importorskip("kubernetes")
    _APIServer.objects, _APIServer.requests = {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _APIServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _APIServer
    server.shutdown()
    server.server_close()
    thread.join()


def test_the_client_creates_reads_lists_and_deletes_worker_pods(api_server):
    import asyncio

    url, server = api_server
    client = PodClient.for_host("gpupool-agents", url, token="sa-token")
    pod = worker_pod(lease(), SITE, TEMPLATE, ENV)

    async def scenario():
        made = await client.create_pod(pod)
        assert made["metadata"]["uid"] == "uid-1" and made["spec"]["nodeName"] == "gpu-1"
        secret = connection_secret(lease(), SITE, json.dumps(connection_info("k", SITE)), made["metadata"]["uid"])
        await client.create_secret(secret)
        assert (await client.pod(pod["metadata"]["name"]))["metadata"]["labels"]["gpupool.io/lease"] == "L-1"
        assert await client.pod("gpupool-worker-none") is None
        assert [p["metadata"]["name"] for p in await client.pods("gpupool.io/node=gpu-1")] == [pod["metadata"]["name"]]
        assert await client.pods("gpupool.io/node=gpu-2") == []
        with pytest.raises(PodError, match=r"creating pod gpupool-worker-l-1-\w+ in namespace gpupool-agents failed: "
                                           r"409 Conflict"):
            await client.create_pod(pod)
        assert await client.delete_pod(pod["metadata"]["name"]) is True
        assert await client.delete_pod(pod["metadata"]["name"]) is False

    asyncio.run(scenario())
    sent = server.requests[0]
    assert sent[:2] == ("POST", "/api/v1/namespaces/gpupool-agents/pods") and sent[3] == "Bearer sa-token"
    assert sent[2]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert ("POST", "/api/v1/namespaces/gpupool-agents/secrets") == server.requests[1][:2]
    assert all(path.startswith("/api/v1/namespaces/gpupool-agents/") for _, path, _, _ in server.requests)


def test_outside_a_cluster_the_in_cluster_client_says_so(monkeypatch):
    pytest.importorskip("kubernetes")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(PodError, match="not in a Kubernetes pod with a service account token"):
        PodClient.in_cluster("gpupool-agents")
