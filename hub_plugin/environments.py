"""The worker environment a lease asks for, decided before it is placed:
whether the pool offers it at all, so that a request naming an environment
no node has is refused at once (409 ``unknown_environment``, listing what the
pool offers) instead of waiting for a node that will never come, and what
``prefer_env`` picks (docs/api.md, "Worker environments").
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpupool.errors import GPUPoolError, Reason

from .models import Node


def lease_environment(env: str | None, prefer: str | None, offered: Collection[str]) -> str | None:
    """The environment the lease's placement must honour (None: any node, its default).
    ``offered``: the names some node reports usable. Raises ValueError when
    ``env`` is given and not offered (the caller says so: :func:`unknown_environment`)."""
    if env is not None:
        if env not in offered:
            raise ValueError(env)
        return env
    return prefer if prefer is not None and prefer in offered else None


def unknown_environment(env: str, offered: Collection[str], unusable: dict[str, str]) -> GPUPoolError:
    """The 409 for a request naming ``env`` that no node offers. ``unusable``: node ->
    why ``env`` cannot run workers there, for nodes that have it configured."""
    names = ", ".join(sorted(offered)) or "none (no agent with GPUs has registered)"
    words = f"no node offers the worker environment {env!r}; the pool offers: {names}"
    if unusable:
        words += "; " + "; ".join(f"on {node} it cannot run workers: {why}" for node, why in sorted(unusable.items()))
    words += (" (%gpu pool or gpupool pool lists them per node; leave --env out for the node's default, or ask an "
              "admin to add it in c.AgentWorkers.environments)")
    return GPUPoolError(Reason.unknown_environment, words, 409, env=env, environments=sorted(offered))


def unusable_on(session: Session, env: str) -> dict[str, str]:
    """Node -> the agent's words, for nodes that report ``env`` but not usable
    (read only when a request is refused, so it may scan every node)."""
    found = {}
    for name, envs in session.execute(select(Node.name, Node.environments)):
        for reported in envs or []:
            if reported.get("name") == env and not reported.get("usable"):
                found[name] = reported.get("problem") or "no reason given"
    return found
