"""The ``gpupool.status`` comm: front end <-> notebook kernel (docs/api.md,
"The status comm"). The front end (the JupyterLab extension,
``labextension/src/status.ts``) opens it; the gpupool kernel keeps it
(:mod:`gpupool.magics.events`) and sends :func:`state_message`,
:func:`event_message` and, for each request, :func:`reply_message`.

The extension's TypeScript declares the same names by hand (its
``ILeaseState``, ``IReply``, ``IDefaults`` and ``TARGET``);
``tests/core/test_wire_comms.py`` checks them against these.
"""

from __future__ import annotations

from typing import Any

TARGET = "gpupool.status"
#: What ``state["phase"]`` can be.
PHASES = ("detached", "queued", "starting", "attached", "parked")
#: What a front end may ask (``{"request": KIND, "id": ID, ...}``).
REQUESTS = ("acquire", "release", "status", "defaults", "resume")
#: The keys of a state, every one always there (None where not known or not applicable).
STATE_KEYS = ("lease", "share", "fraction", "gpu_count", "gpu_model", "gpu_indices", "node", "node_state",
              "memory_used", "memory_limit", "idle_timeout", "idle_deadline", "idle_warning", "on_idle",
              "queue_position", "eta", "reason", "preempt_at", "moving_from", "phase")
#: The keys a reply may have: the request's kind and id, then the answer's.
REPLY_KEYS = ("reply", "id", "ok", "message", "output", "defaults", "details", "holders")
#: The keys of a ``defaults`` reply's ``defaults`` (``error``: only when the service did not answer).
DEFAULTS_KEYS = ("amount", "max_idle_timeout", "max_lease_gpus", "models", "error")
#: The keys of a ``status`` reply's ``holders``.
HOLDERS_KEYS = ("columns", "rows", "notes")


def state_message(state: dict[str, Any]) -> dict[str, Any]:
    """``{"state": STATE}``: what the lease is now (STATE_KEYS)."""
    return {"state": state}


def event_message(kind: str, message: str, **extra: Any) -> dict[str, Any]:
    """``{"event": KIND, "message": WORDS, **extra}``: a notice, or what a cell said."""
    return {"event": kind, "message": message, **extra}


def reply_message(request: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """``{"reply": KIND, "id": ID, "ok", "message", ...}``: ``answer`` to
    ``request`` (``{"request": KIND, "id": ID, ...}``)."""
    return {"reply": request.get("request"), "id": request.get("id"), **answer}


def refusal(message: str) -> dict[str, Any]:
    """The reply to a message that is no request: ``{"reply": None, "ok": False, "message": WORDS}``."""
    return {"reply": None, "ok": False, "message": message}
