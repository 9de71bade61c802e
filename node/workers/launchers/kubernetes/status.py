"""What a worker pod's status says, in words (pure: a Pod as the API server
returns it, a dict with the API's camelCase keys, in; words out).

The words are the cluster's own (a condition's reason and message, a
container's waiting or terminated reason, the pod's status reason such as
``Evicted``), so a lease that ends or fails to start says what
``kubectl describe pod`` would.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping

#: The container that runs the kernel (:func:`.pods.worker_pod`).
WORKER_CONTAINER = "worker"


def _status(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return pod.get("status") or {}


def _worker_state(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The worker container's ``state`` (``{"waiting": ...}``, ``{"running": ...}``, ``{"terminated": ...}``); {}."""
    for container in _status(pod).get("containerStatuses") or ():
        if container.get("name") == WORKER_CONTAINER:
            return container.get("state") or {}
    return {}


def running_ip(pod: Mapping[str, Any]) -> str | None:
    """The pod's IP once it is Running with its worker container running; None before."""
    status = _status(pod)
    if status.get("phase") != "Running" or not status.get("podIP") or "running" not in _worker_state(pod):
        return None
    return str(status["podIP"])


def ended(pod: Mapping[str, Any] | None) -> bool:
    """True once the pod will run its kernel no more: gone (None), Failed or
    Succeeded, being deleted, or its worker container terminated."""
    if pod is None:
        return True
    return (_status(pod).get("phase") in ("Failed", "Succeeded") or "terminated" in _worker_state(pod)
            or bool((pod.get("metadata") or {}).get("deletionTimestamp")))


def exit_code(pod: Mapping[str, Any] | None) -> int | None:
    """The worker container's exit code as a process's: negative N for
    128 + N (killed by signal N, as a container runtime writes it: an
    OOMKilled container's 137 is -9); None while it runs, or when unknown."""
    terminated = _worker_state(pod).get("terminated") if pod is not None else None
    if not terminated or terminated.get("exitCode") is None:
        return None
    code = int(terminated["exitCode"])
    return -(code - 128) if 128 < code < 160 else code


def end_words(name: str, pod: Mapping[str, Any] | None) -> str:
    """Why the worker's pod ``name`` ended, for the lease's end: e.g.
    ``"the worker's pod P ended: its container was OOMKilled (exit code 137)"``."""
    if pod is None:
        return (f"the worker's pod {name} is gone (deleted outside gpupool: kubectl delete, an eviction, its "
                "node drained or removed)")
    status, parts = _status(pod), []
    if status.get("reason"):  # the pod's own: Evicted, DeadlineExceeded, OutOf<resource>...
        parts.append(_joined(status.get("reason"), status.get("message")))
    terminated = _worker_state(pod).get("terminated")
    if terminated:
        why = terminated.get("reason") or "it exited"
        words = f"its container was {why}" if why in ("OOMKilled", "Error", "Completed", "ContainerCannotRun") \
            else f"its container ended: {why}"
        code = terminated.get("exitCode")
        words += f" (exit code {code})" if code is not None else ""
        if terminated.get("message"):
            words += f": {terminated['message']}"
        parts.append(words)
    if not parts and (pod.get("metadata") or {}).get("deletionTimestamp"):
        parts.append("it is being deleted (outside gpupool: kubectl delete, an eviction, its node drained)")
    phase = status.get("phase") or "Unknown"
    return f"the worker's pod {name} ended ({phase}): " + ("; ".join(parts) or "Kubernetes said nothing of why")


def pending_words(pod: Mapping[str, Any]) -> str:
    """Why a pod is not running yet: its False conditions' reasons and
    messages (``PodScheduled: Unschedulable: 0/3 nodes are available...``)
    and its worker container's waiting reason (``ImagePullBackOff: ...``);
    ``"it is Pending"`` when Kubernetes says nothing more."""
    status = _status(pod)
    parts = [f"{cond.get('type')}: {_joined(cond.get('reason'), cond.get('message'))}"
             for cond in status.get("conditions") or () if cond.get("status") == "False"
             and (cond.get("reason") or cond.get("message"))]
    waiting = _worker_state(pod).get("waiting")
    if waiting and waiting.get("reason"):
        parts.append(f"its container is waiting: {_joined(waiting.get('reason'), waiting.get('message'))}")
    return "; ".join(parts) or f"it is {status.get('phase') or 'Pending'}"


def started_at(pod: Mapping[str, Any]) -> float:
    """The pod's ``status.startTime`` in epoch seconds; 0.0 when unknown."""
    text = _status(pod).get("startTime")
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp() if text else 0.0
    except ValueError:
        return 0.0


def _joined(reason: object, message: object) -> str:
    return ": ".join(str(part) for part in (reason, message) if part) or "no reason given"
