"""``c.AgentWorkers.worker_launcher = "kubernetes"``: every lease's worker is a
pod on the agent's node (:mod:`.pods`), made through the API server
(:mod:`.client`) with the settings ``c.KubernetesLauncher.*`` (:mod:`.launcher`),
and watched and stopped through it (:mod:`.handles`). Its start, restart,
stop and what it does not do: docs/launchers.md, "Kubernetes".
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import zmq

from gpupool.errors import GPUPoolError, Reason

from ...handle import Worker
from ...kernel import kernel_arguments
from ...records import CONNECTION_PREFIX, WorkerRecord
from ...spec import WorkerSpec, WorkerStartError
from ...stopping import quietly, remove_files
from ..base import WorkerLauncher
from .client import PodClient, PodError
from .handles import PodGroup, PodProcess, PodWatch
from .launcher import KubernetesLauncher
from .pods import COMPONENT_LABEL, LEASE_LABEL, NODE_LABEL, PodSettings, connection_info, connection_secret, \
    label_value, worker_pod
from .status import end_words, ended, pending_words, running_ip

#: Seconds between two reads of a starting pod.
START_POLL_S = 0.25
#: IPython's history of a worker pod: in memory (a file in the owner's home would be shared with
#: their notebook's kernel, kernel_arguments).
HISTORY = Path(":memory:")


class KubernetesWorkers(WorkerLauncher):
    """The ``kubernetes`` launcher: lease workers as pods (module docstring).
    ``settings.config``: the agent's traitlets config, read for
    ``c.KubernetesLauncher.*``. GPUPoolError ``not_configured`` for settings
    that cannot make a pod or reach the API server."""

    keeps_warm = False
    accounts_refusal = ("the Kubernetes launcher runs workers as c.KubernetesLauncher.run_as_user "
                        "(c.AgentWorkers.worker_user is not supported with worker_launcher = 'kubernetes')")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self.settings.config
        self.k8s = KubernetesLauncher(config=config, log=self.log) if config is not None \
            else KubernetesLauncher(log=self.log)
        try:
            self.pods: PodSettings = self.k8s.pod_settings()
            self.template = self.k8s.template()
            self.client: PodClient = self.k8s.client()
        except (ValueError, PodError) as exc:
            raise GPUPoolError(Reason.not_configured, f"worker_launcher = 'kubernetes': {exc}") from None

    # -- start ------------------------------------------------------------------

    async def cold(self, spec: WorkerSpec) -> Worker:
        """Start ``spec``'s worker as a pod and wait until it answers
        ``kernel_info``. WorkerStartError in words (Kubernetes', when the pod
        did not run); nothing is left in the cluster then."""
        self.refuse_accounts(spec)
        info = self._connection()
        try:
            manifest = worker_pod(spec, self.pods, self.template, self._environment(spec),
                                  kernel_arguments(self.settings.extensions, HISTORY))
        except ValueError as exc:
            raise WorkerStartError(f"cannot make the worker pod of lease {spec.lease_id}: {exc}") from None
        name = manifest["metadata"]["name"]
        try:
            made = await self.client.create_pod(manifest)
        except PodError as exc:
            raise WorkerStartError(f"could not start the worker of lease {spec.lease_id}: {exc}") from None
        watch = PodWatch(self.client, name, made["metadata"]["uid"], asyncio.get_running_loop(), self.log)
        try:
            await self.client.create_secret(connection_secret(spec, self.pods, json.dumps(info), watch.uid))
            pod, ip = await self._running(watch, spec.lease_id)
        except PodError as exc:
            await quietly(watch.delete(0, self.settings.stop_timeout))  # its Secret, owned by it, goes with it
            raise WorkerStartError(f"could not start the worker of lease {spec.lease_id}: {exc}") from None
        except (WorkerStartError, asyncio.CancelledError):  # cancelled: the agent stops while it starts
            await quietly(watch.delete(0, self.settings.stop_timeout))
            raise
        try:
            worker = self._worker(spec, self._local_file(info, ip), watch, pod, ip)
        except (OSError, ValueError) as exc:
            await quietly(watch.delete(0, self.settings.stop_timeout))
            raise WorkerStartError(f"could not start the worker of lease {spec.lease_id}: its connection file: "
                                   f"{exc}") from None
        await self.ready(worker)  # a failed one is stopped: its pod deleted (PodProcess.shutdown)
        self.log.info("lease %s: worker in pod %s at %s (node %s)", spec.lease_id, name, ip, self.pods.node_name)
        return worker

    def _connection(self) -> dict[str, Any]:
        """The worker's connection file as the pod reads it: a fresh HMAC key,
        the fixed ports, every address of the pod; a fresh CurveZMQ key pair
        when the agent encrypts worker traffic (``curve``)."""
        info = connection_info(secrets.token_hex(32), self.pods)
        if self.settings.encryption == "curve":
            public, secret = zmq.curve_keypair()
            info.update(curve_publickey=public.decode("ascii"), curve_secretkey=secret.decode("ascii"))
        return info

    def _environment(self, spec: WorkerSpec) -> dict[str, str]:
        """The worker's variables: its slice's (the enforcement mode's), and
        nothing of the agent's own environment (the pod's image brings its own)."""
        settings = self.settings
        return dict(settings.enforcement.environment(spec.gpus, spec.fraction, spec.memory, spec.lease_id,
                                                     spec.owner, settings.node))

    async def _running(self, watch: PodWatch, lease_id: str) -> tuple[dict[str, Any], str]:
        """``(pod, ip)`` once the pod runs with an IP. WorkerStartError with
        Kubernetes' words when it ended first, or still had not run after
        ``start_timeout`` seconds."""
        timeout = self.settings.start_timeout
        deadline = time.monotonic() + timeout
        pod = None
        while True:
            pod = await watch.read()
            ip = running_ip(pod) if pod is not None else None
            if ip is not None:
                return pod, ip
            if pod is None or ended(pod):
                raise WorkerStartError(f"the worker of lease {lease_id} did not start: {end_words(watch.name, pod)}")
            if time.monotonic() >= deadline:
                raise WorkerStartError(f"the worker pod {watch.name} of lease {lease_id} did not run within "
                                       f"{timeout:g} s (c.AgentWorkers.worker_start_timeout): {pending_words(pod)}")
            await asyncio.sleep(START_POLL_S)

    def _local_file(self, info: dict[str, Any], ip: str) -> Path:
        """The agent's copy of the connection file, with the pod's ``ip``:
        what its kernel managers, the IOPub watch and a restarted agent read."""
        path = self.settings.workers_dir / f"{CONNECTION_PREFIX}{secrets.token_hex(16)}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({**info, "ip": ip}, out)
        return path

    def _worker(self, spec: WorkerSpec, connection_file: Path, watch: PodWatch, pod: dict[str, Any],
                ip: str) -> Worker:
        """The agent's handle on the worker in ``pod`` at ``ip``."""
        try:
            manager = self.kernels.existing(connection_file)
        except (OSError, ValueError):
            remove_files(connection_file)
            raise
        worker = Worker(spec, manager, PodProcess(watch, self.k8s.poll_interval, pod),
                        self.settings.workers_dir / f"lease-{spec.lease_id}.log", ip, spec.lease_id, PodGroup(watch))
        worker.launcher_state = {"pod": watch.name, "uid": watch.uid, "node": self.pods.node_name, "ip": ip}
        return worker

    async def warm(self) -> Worker:
        raise WorkerStartError("the Kubernetes launcher keeps no warm workers: a pod's GPUs are fixed when it is "
                               "made (c.AgentWorkers.warm_workers = 0)")

    # -- after an agent restart -------------------------------------------------

    async def adopt(self, record: WorkerRecord, spec: WorkerSpec) -> Worker | None:
        """The worker of ``record`` if its pod (same name and uid) still runs
        with the lease's label, at the IP of the record; else None."""
        state = record.launcher or {}
        try:
            name, uid, ip = str(state["pod"]), str(state["uid"]), str(state["ip"])
        except KeyError as exc:
            self.log.warning("cannot re-adopt the worker pod of lease %s: its record lacks %s", record.lease_id, exc)
            return None
        watch = PodWatch(self.client, name, uid, asyncio.get_running_loop(), self.log)
        try:
            pod = await watch.read()
        except PodError as exc:
            self.log.warning("cannot re-adopt the worker pod of lease %s: %s", record.lease_id, exc)
            return None
        labels = (pod or {}).get("metadata", {}).get("labels") or {}
        if pod is None or running_ip(pod) != ip or labels.get(LEASE_LABEL) != label_value(record.lease_id):
            return None
        try:
            worker = self._worker(spec, Path(record.connection_file), watch, pod, ip)
        except (OSError, ValueError) as exc:
            self.log.warning("cannot re-adopt the worker of lease %s: its connection file: %s", record.lease_id, exc)
            return None
        self.log.info("lease %s: re-adopted its worker in pod %s at %s", record.lease_id, name, ip)
        return worker

    async def sweep(self, kept: list[Worker]) -> None:
        """Delete every worker pod labelled with this node that no worker of
        ``kept`` holds (an earlier agent's, whose lease ended meanwhile or
        whose record is gone)."""
        held = {worker.launcher_state.get("uid") for worker in kept if worker.launcher_state}
        selector = f"{COMPONENT_LABEL}=worker,{NODE_LABEL}={label_value(self.pods.node_name)}"
        try:
            found = await self.client.pods(selector)
        except PodError as exc:
            self.log.error("could not look for worker pods an earlier agent left: %s", exc)
            return
        strays = [pod["metadata"]["name"] for pod in found if pod["metadata"].get("uid") not in held]
        for name in strays:
            try:
                await self.client.delete_pod(name, grace_seconds=0)
            except PodError as exc:
                self.log.error("could not delete worker pod %s: %s", name, exc)
        if strays:
            self.log.warning("deleted %d worker pod(s) an earlier agent left on %s that no live worker of it holds: "
                             "%s", len(strays), self.pods.node_name, ", ".join(strays))
