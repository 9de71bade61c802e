"""The Kubernetes API calls of the pod launcher, in the agent's namespace, with
the official ``kubernetes`` client (``pip install gpupool[kubernetes]``),
behind one small class so the pod builder (:mod:`.pods`) stays pure.

What it needs of RBAC (deploy/kubernetes/overlays/pods/agents/rbac.yaml): in its own
namespace, ``pods``: create, get, list, watch, delete; ``secrets``: create,
get, delete. Nothing cluster-wide. The client's calls block, so each runs in a
thread: the agent's event loop never waits on the API server.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping


class PodError(Exception):
    """A Kubernetes API call failed; the message names the call, the status and the API server's words."""


class PodClient:
    """Pods and Secrets of one ``namespace`` through ``api``, a
    ``kubernetes.client.CoreV1Api`` (see :meth:`in_cluster`)."""

    def __init__(self, namespace: str, api: Any) -> None:
        self.namespace = namespace
        self.api = api

    @classmethod
    def in_cluster(cls, namespace: str) -> "PodClient":
        """With the pod's service account (``load_incluster_config``). PodError outside a cluster."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException as exc:
            raise PodError(f"not in a Kubernetes pod with a service account token: {exc}") from None
        return cls(namespace, client.CoreV1Api())

    @classmethod
    def for_host(cls, namespace: str, host: str, token: str = "") -> "PodClient":
        """Against the API server at ``host`` (e.g. from a kubeconfig's cluster), with a bearer ``token``."""
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = host
        if token:
            configuration.api_key = {"authorization": token}
            configuration.api_key_prefix = {"authorization": "Bearer"}
        return cls(namespace, client.CoreV1Api(client.ApiClient(configuration)))

    async def _call(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return await asyncio.to_thread(getattr(self.api, method), *args, **kwargs)
        except ApiException as exc:
            raise PodError(f"{what} in namespace {self.namespace} failed: {exc.status} {exc.reason}: "
                           f"{(exc.body or '')[:300]}") from None

    def _plain(self, obj: Any) -> dict[str, Any]:
        return self.api.api_client.sanitize_for_serialization(obj)

    async def create_pod(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Create the pod; returns it as the API server stored it (with its ``metadata.uid``)."""
        made = await self._call(f"creating pod {manifest['metadata']['name']}", "create_namespaced_pod",
                                self.namespace, dict(manifest))
        return self._plain(made)

    async def create_secret(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        made = await self._call(f"creating secret {manifest['metadata']['name']}", "create_namespaced_secret",
                                self.namespace, dict(manifest))
        return self._plain(made)

    async def pod(self, name: str) -> dict[str, Any] | None:
        """The pod called ``name``, or None when there is none. PodError."""
        from kubernetes.client.exceptions import ApiException

        try:
            found = await asyncio.to_thread(self.api.read_namespaced_pod, name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise PodError(f"reading pod {name} in namespace {self.namespace} failed: {exc.status} {exc.reason}") \
                from None
        return self._plain(found)

    async def pods(self, selector: str) -> list[dict[str, Any]]:
        """The pods whose labels match ``selector`` (e.g. ``gpupool.io/node=gpu-1``): to sweep leftovers."""
        found = await self._call(f"listing pods {selector}", "list_namespaced_pod", self.namespace,
                                 label_selector=selector)
        return [self._plain(item) for item in found.items]

    async def delete_pod(self, name: str, grace_seconds: int = 10) -> bool:
        """Delete the pod (its Secret goes with it: it owns it); False when it was gone already."""
        from kubernetes.client.exceptions import ApiException

        try:
            await asyncio.to_thread(self.api.delete_namespaced_pod, name, self.namespace,
                                    grace_period_seconds=grace_seconds)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise PodError(f"deleting pod {name} in namespace {self.namespace} failed: {exc.status} {exc.reason}") \
                from None
        return True
