"""A stand-in for a Kubernetes API server and the kubelet of one node, for the
``kubernetes`` worker launcher's tests: no cluster runs here.

The API part answers the REST calls :class:`PodClient` makes through the real
``kubernetes`` client (POST, GET, DELETE and list with ``labelSelector`` of
``/api/v1/namespaces/NS/pods``; POST, GET, DELETE of ``.../secrets``), keeps
the objects as JSON, and deletes a pod's Secret with it (the garbage
collector's part: the Secret's ``ownerReferences``).

The kubelet part runs each pod's worker container as a real local process:
once the Secret its ``connection`` volume names exists, it writes the
Secret's files into a folder of the pod's own (standing for the mount at
``CONNECTION_DIR``), rewrites the container command's mount path to that
folder, and runs the command with the container's ``env`` over this
process's environment (the "image's"). The pod goes Pending -> Running with
its IP; when the process exits, Succeeded or Failed with the container's
exit code and reason (``Completed``, ``Error``, or ``OOMKilled`` after
:meth:`KubeletStandin.oom_kill`). A DELETE marks the pod deleted, sends its
process SIGTERM, SIGKILL after the grace period, and removes the pod once
the process is gone.

Every pod here shares the host's network, so each gets an IP of its own on
the loopback (``127.0.0.2``, ``127.0.0.3``...: all of 127/8 is this host's)
and its connection file's ``ip`` (``0.0.0.0`` in the Secret: every address of
the pod) is written as that IP, as the pod's own network namespace would
confine it: so the fixed ports of ``c.KubernetesLauncher.first_port`` never
clash between pods, and the agent must reach each kernel at its pod's IP.
The tests pick a ``first_port`` whose six ports are free on this host.

Knobs for the tests: :attr:`KubeletStandin.pending` (new pods stay Pending
with that PodScheduled condition), :meth:`oom_kill`, :meth:`pods`.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from gpupool.node.workers.launchers.kubernetes.pods import CONNECTION_DIR

#: Seconds the kubelet waits for a pod's Secret before it leaves the pod waiting for good.
SECRET_WAIT_S = 30.0


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeletStandin:
    """The API server and kubelet stand-in; :meth:`start` gives its URL."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="kubelet-standin-"))
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.lock = threading.RLock()
        self.procs: dict[str, subprocess.Popen] = {}  # pod uid -> its worker container's process
        self.oom: set[str] = set()  # uids whose process the stand-in killed as out of memory
        self.pending: dict[str, str] | None = None  # a PodScheduled condition that keeps new pods Pending
        self._next = 0
        self._last_ip = 1  # pods get 127.0.0.2, 127.0.0.3...
        self._server: ThreadingHTTPServer | None = None
        self.url = ""

    # -- the server -------------------------------------------------------------

    def start(self) -> str:
        standin = self

        class Handler(_Handler):
            owner = standin

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self.url

    def stop(self) -> None:
        """Kill every pod's process and stop serving."""
        with self.lock:
            procs = list(self.procs.values())
        for proc in procs:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(10)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- what the tests look at and do ------------------------------------------

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [copy.deepcopy(o) for (ns, kind, _), o in self.objects.items()
                    if kind == "pods" and namespace in (None, ns)]

    def secrets(self) -> list[dict[str, Any]]:
        with self.lock:
            return [copy.deepcopy(o) for (_, kind, _), o in self.objects.items() if kind == "secrets"]

    def process(self, name: str) -> subprocess.Popen | None:
        with self.lock:
            pod = next((o for (_, k, n), o in self.objects.items() if k == "pods" and n == name), None)
            return self.procs.get(pod["metadata"]["uid"]) if pod is not None else None

    def oom_kill(self, name: str) -> None:
        """Kill pod ``name``'s process as the kernel's OOM killer would (its
        container then terminates as ``OOMKilled``, exit code 137)."""
        proc = self.process(name)
        with self.lock:
            uid = next(o["metadata"]["uid"] for (_, k, n), o in self.objects.items() if k == "pods" and n == name)
            self.oom.add(uid)
        _signal_group(proc, signal.SIGKILL)

    def add_pod(self, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """Create a pod as a POST would (for a test's stray pod)."""
        return self._create(namespace, "pods", copy.deepcopy(manifest))

    # -- the API ------------------------------------------------------------------

    def _create(self, namespace: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self._next += 1
            meta = body.setdefault("metadata", {})
            meta.update(namespace=namespace, uid=f"uid-{self._next:04d}-{os.urandom(4).hex()}", creationTimestamp=now(),
                        resourceVersion=str(self._next))
            self.objects[(namespace, kind, meta["name"])] = body
            if kind == "pods":
                self._last_ip = self._last_ip % 250 + 1
                body["status"] = {"phase": "Pending", "conditions": [], "hostIP": "127.0.0.1",
                                  "podIP": f"127.0.0.{self._last_ip}", "qosClass": "Guaranteed"}
                self._set_waiting(body, "ContainerCreating")
                if self.pending is not None:
                    body["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", **self.pending,
                                                     "lastTransitionTime": now()}]
                    body["status"].pop("podIP")
                    body["status"].pop("containerStatuses")
                else:
                    threading.Thread(target=self._run_pod, args=(namespace, meta["name"], meta["uid"]),
                                     daemon=True).start()
            return copy.deepcopy(body)

    def _delete(self, namespace: str, kind: str, name: str, grace: float) -> dict[str, Any] | None:
        with self.lock:
            found = self.objects.get((namespace, kind, name))
            if found is None:
                return None
            if kind != "pods":
                return self.objects.pop((namespace, kind, name))
            found["metadata"].setdefault("deletionTimestamp", now())
            proc = self.procs.get(found["metadata"]["uid"])
            if proc is None or proc.poll() is not None:
                self._remove_pod(namespace, name)
            else:
                threading.Thread(target=self._terminate, args=(proc, grace), daemon=True).start()
            return copy.deepcopy(found)

    def _remove_pod(self, namespace: str, name: str) -> None:
        """The pod goes, and the Secrets it owns with it (the garbage collector's part)."""
        with self.lock:
            pod = self.objects.pop((namespace, "pods", name), None)
            if pod is None:
                return
            uid = pod["metadata"]["uid"]
            for key, obj in list(self.objects.items()):
                if any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences", [])):
                    del self.objects[key]
            self.procs.pop(uid, None)
        shutil.rmtree(self.root / uid, ignore_errors=True)

    # -- the kubelet ----------------------------------------------------------------

    def _run_pod(self, namespace: str, name: str, uid: str) -> None:
        with self.lock:
            pod = self.objects.get((namespace, "pods", name))
            volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "connection")
        secret = self._wait_secret(namespace, volume["secret"]["secretName"])
        with self.lock:
            pod = self.objects.get((namespace, "pods", name))
            if pod is None or pod["metadata"]["uid"] != uid or secret is None or \
                    pod["metadata"].get("deletionTimestamp"):
                if pod is not None and pod["metadata"].get("deletionTimestamp"):
                    self._remove_pod(namespace, name)
                return
            proc = self._start(pod, secret)
            self.procs[uid] = proc
            status = pod["status"]
            status.update(phase="Running", startTime=now(),
                          conditions=[{"type": "Ready", "status": "True", "lastTransitionTime": now()}])
            self._set_state(pod, {"running": {"startedAt": now()}}, ready=True)
        code = proc.wait()
        with self.lock:
            pod = self.objects.get((namespace, "pods", name))
            if pod is None:
                return
            reason = "OOMKilled" if uid in self.oom else "Completed" if code == 0 else "Error"
            exit_code = 128 - code if code < 0 else code
            pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
            self._set_state(pod, {"terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": now()}},
                            ready=False)
            if pod["metadata"].get("deletionTimestamp"):
                self._remove_pod(namespace, name)

    def _wait_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        deadline = time.monotonic() + SECRET_WAIT_S
        while time.monotonic() < deadline:
            with self.lock:
                found = self.objects.get((namespace, "secrets", name))
            if found is not None:
                return copy.deepcopy(found)
            time.sleep(0.05)
        return None

    def _start(self, pod: dict[str, Any], secret: dict[str, Any]) -> subprocess.Popen:
        """The worker container's command as a local process: the Secret's files in the pod's folder, the
        mount path rewritten to it, the connection file's ``ip`` made the pod's."""
        uid, ip = pod["metadata"]["uid"], pod["status"]["podIP"]
        mount = self.root / uid / "connection"
        mount.mkdir(parents=True)
        files = {key: base64.b64decode(value).decode() for key, value in (secret.get("data") or {}).items()}
        files.update(secret.get("stringData") or {})
        for key, text in files.items():
            if key.endswith(".json"):
                info = json.loads(text)
                if info.get("ip") == "0.0.0.0":
                    info["ip"] = ip  # the pod's network namespace: its kernel binds the pod's address only
                text = json.dumps(info)
            (mount / key).write_text(text)
        container = pod["spec"]["containers"][0]
        command = [arg.replace(CONNECTION_DIR, str(mount)) for arg in container["command"]]
        env = {**os.environ, **{e["name"]: e.get("value", "") for e in container.get("env", [])}}
        log = open(self.root / uid / "worker.log", "ab")
        try:
            return subprocess.Popen(command, env=env, cwd=str(self.root / uid), stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def _terminate(self, proc: subprocess.Popen, grace: float) -> None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(max(grace, 0.1))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)

    @staticmethod
    def _set_waiting(pod: dict[str, Any], reason: str) -> None:
        KubeletStandin._set_state(pod, {"waiting": {"reason": reason}}, ready=False)

    @staticmethod
    def _set_state(pod: dict[str, Any], state: dict[str, Any], ready: bool) -> None:
        container = pod["spec"]["containers"][0]
        pod["status"]["containerStatuses"] = [{"name": container["name"], "image": container.get("image", ""),
                                               "imageID": "", "ready": ready, "restartCount": 0, "started": ready,
                                               "state": state}]


def _signal_group(proc: subprocess.Popen | None, signum: int) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signum)
    except OSError:
        pass


class _Handler(BaseHTTPRequestHandler):
    owner: KubeletStandin
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _missing(self, kind: str, name: str) -> None:
        self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                         "message": f'{kind} "{name}" not found', "code": 404})

    def _route(self) -> tuple[str, str, str | None, dict[str, list[str]]] | None:
        parts = urlsplit(self.path)
        match = re.match(r"^/api/v1/namespaces/([^/]+)/(pods|secrets)(?:/([^/]+))?$", parts.path)
        if match is None:
            self._send(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
            return None
        return match.group(1), match.group(2), match.group(3), parse_qs(parts.query)

    def _body(self) -> dict[str, Any] | None:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length)) if length else None

    def do_POST(self) -> None:
        route, body = self._route(), self._body()
        if route is None:
            return
        namespace, kind, _, _ = route
        with self.owner.lock:
            if (namespace, kind, body["metadata"]["name"]) in self.owner.objects:
                self._send(409, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 409,
                                 "reason": "AlreadyExists", "message": f'{kind} "{body["metadata"]["name"]}" exists'})
                return
            made = self.owner._create(namespace, kind, body)
        self._send(201, made)

    def do_GET(self) -> None:
        route = self._route()
        if route is None:
            return
        namespace, kind, name, query = route
        with self.owner.lock:
            if name:
                found = self.owner.objects.get((namespace, kind, name))
                found = copy.deepcopy(found) if found is not None else None
            else:
                wanted = dict(pair.split("=", 1) for pair in query.get("labelSelector", [""])[0].split(",") if pair)
                items = [copy.deepcopy(o) for (ns, k, _), o in self.owner.objects.items() if ns == namespace
                         and k == kind and all(o["metadata"].get("labels", {}).get(a) == b for a, b in wanted.items())]
        if name and found is None:
            self._missing(kind, name)
        elif name:
            self._send(200, found)
        else:
            self._send(200, {"kind": "PodList" if kind == "pods" else "SecretList", "apiVersion": "v1",
                             "metadata": {}, "items": items})

    def do_DELETE(self) -> None:
        route = self._route()
        self._body()
        if route is None:
            return
        namespace, kind, name, query = route
        grace = float(query.get("gracePeriodSeconds", ["30"])[0])
        found = self.owner._delete(namespace, kind, name or "", grace)
        if found is None:
            self._missing(kind, name or "")
        else:
            self._send(200, found)
