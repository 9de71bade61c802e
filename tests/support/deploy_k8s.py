"""What the Kubernetes tests share: the overlays rendered with ``kubectl kustomize`` (after
``make-secrets.sh``, as the README's first step), and lookups over the rendered objects, which
live in three namespaces (the users', the agents', monitoring's) and cluster-wide."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_parse import ROOT

K8S = ROOT / "deploy" / "kubernetes"
Z2JH_REF = ROOT.parent / "shared" / "reference" / "z2jh"
if not Z2JH_REF.is_dir():  # a worktree beside the main checkout (/work/wt-x and /work/shared)
    Z2JH_REF = Path("/work/shared/reference/z2jh")
OVERLAYS = ("evaluation", "production", "pods")
#: The overlays whose workers run inside the agent's (privileged) pod, and the one whose workers are pods
#: of their own beside an unprivileged agent (tests/deploy/test_deploy_k8s_worker_pods.py).
IN_AGENT_POD = ("evaluation", "production")
WORKER_PODS = "pods"
USERS_NS, AGENTS_NS, MONITORING_NS = "jupyterhub", "gpupool-agents", "monitoring"
#: What the downward API would give an agent's pod, to expand $(VAR) in command lines.
DOWNWARD = {"spec.nodeName": "gpu-node-1", "status.podIP": "10.1.2.3", "metadata.name": "gpupool-agent-x7k2p",
            "metadata.uid": "6f1b96b0-aaaa-4bbb-8ccc-0123456789ab", "metadata.namespace": AGENTS_NS}


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not on PATH (Debian 12's kubernetes-client is too old; install a current kubectl)")
    return path


def render(tmp: Path, overlay: str, extra: dict[str, str] | None = None) -> list[dict]:
    """The objects of ``overlay`` rendered from a copy of deploy/kubernetes under ``tmp`` after
    ``make-secrets.sh``; ``extra``: more files to write into the copy first (relative paths)."""
    binary = kubectl()
    copy_dir = tmp / "kubernetes"
    if not copy_dir.exists():
        shutil.copytree(K8S, copy_dir, ignore=shutil.ignore_patterns("*.env"))
        for base in OVERLAYS:
            args = [] if base == "evaluation" else ["--db-url", "postgresql+psycopg://gpupool:pw@db.example.org/gpupool"]
            subprocess.run(["sh", str(copy_dir / "make-secrets.sh"), f"overlays/{base}", *args], check=True,
                           capture_output=True)
    for name, text in (extra or {}).items():
        (copy_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (copy_dir / name).write_text(text)
    out = subprocess.run([binary, "kustomize", str(copy_dir / overlay)], check=True, capture_output=True,
                         text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """``{overlay: [object, ...]}`` of every overlay."""
    tmp = tmp_path_factory.mktemp("k8s")
    return {overlay: render(tmp, f"overlays/{overlay}") for overlay in OVERLAYS}


def namespace(obj: dict) -> str | None:
    return obj["metadata"].get("namespace")


def find(objects, kind: str, name: str | None = None, ns: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
            and (ns is None or namespace(o) == ns)]


def one(objects, kind: str, name: str, ns: str | None = None) -> dict:
    found = find(objects, kind, name, ns)
    assert len(found) == 1, f"expected one {kind} {name} (namespace {ns}), found {len(found)}"
    return found[0]


def workloads(objects):
    return [o for o in objects if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job")]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def gpupool_containers(objects):
    """``(workload, container)`` for each container that runs a gpupool image."""
    return [(w, c) for w in workloads(objects) for c in pod_spec(w)["containers"] if "gpupool/" in c["image"]]


def env_values(container) -> dict[str, str]:
    values = {}
    for env in container.get("env", []):
        ref = env.get("valueFrom", {}).get("fieldRef")
        values[env["name"]] = DOWNWARD[ref["fieldPath"]] if ref else env.get("value", "")
    return values


def expanded_command(container) -> list[str]:
    """The container's command and args with $(VAR) expanded as Kubernetes does."""
    values = env_values(container)
    words = [*container.get("command", []), *container.get("args", [])]
    return [re.sub(r"\$\(([A-Z_]+)\)", lambda m: values[m.group(1)], w) for w in words]


def option(argv: list[str], name: str) -> str:
    values = [w.split("=", 1)[1] for w in argv if w.startswith(f"--{name}=")]
    assert len(values) == 1, f"{argv}: expected one --{name}="
    return values[0]


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def service_url(objects, url: str, from_ns: str) -> tuple[dict, dict]:
    """The Service and port an in-cluster ``http://NAME[.NAMESPACE[.svc]]:PORT/...`` URL reaches
    from a pod in ``from_ns``."""
    parts = urlsplit(url)
    name, _, rest = parts.hostname.partition(".")
    ns = rest.split(".")[0] if rest else from_ns
    assert rest in ("", f"{ns}", f"{ns}.svc", f"{ns}.svc.cluster.local"), url
    service = one(objects, "Service", name, ns)
    ports = [p for p in service["spec"]["ports"] if p["port"] == parts.port]
    assert ports, f"{url}: Service {ns}/{name} has no port {parts.port}"
    return service, ports[0]


def config_text(objects, name: str) -> str:
    return one(objects, "ConfigMap", name)["data"]["gpupool_config.py"]


def config_value(text: str, setting: str) -> str:
    match = re.search(rf"^c\.{re.escape(setting)} = (.+)$", text, re.M)
    assert match, f"the config sets no c.{setting}"
    import ast

    return ast.literal_eval(match.group(1))


def z2jh_values() -> dict:
    return yaml.safe_load((K8S / "z2jh" / "config.yaml").read_text())


def merged(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
