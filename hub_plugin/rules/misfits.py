"""Why a lease request did not fit, kept structured until it is printed (as
HAMi keeps its ``FitError`` tally). Pure.

A :class:`Misfit` is one reason a GPU was ruled out. The scheduler counts
GPUs per misfit (:class:`.scheduler.Refusal`); the metrics count refusals
under the misfit's code (``gpupool_lease_refusals_total{reason}``); a person
reads its :attr:`~Misfit.words`, in the refusal's message and as the keys of
the 409's ``reasons`` (docs/api.md). A refusal by a limit is counted as
:func:`limit_code`: a quota's as ``quota_LIMIT``, the pool's own (no node or
GPU has that much at all) as the misfit that rules out even its biggest node.
"""

from __future__ import annotations

from gpupool.strenum import StrEnum


class Misfit(StrEnum):
    """A reason a GPU (or its node's host) cannot take a request. The value
    is the metrics label (stable: a code may be added, none renamed);
    ``words`` is what a person reads."""

    words: str

    def __new__(cls, code: str, words: str) -> "Misfit":
        member = str.__new__(cls, code)
        member._value_ = code
        member.words = words
        return member

    node_lost = "node_lost", "node lost"
    node_degraded = "node_degraded", "node cannot read its GPUs (NVML)"
    gpu_unhealthy = "gpu_unhealthy", "unhealthy"
    no_environment = "no_environment", "no usable worker environment of that name on its node"
    model_mismatch = "model_mismatch", "model mismatch"
    whole_gpus_only = "whole_gpus_only", "whole GPUs only on its node (its enforcement mode does not share a GPU)"
    no_fraction = "no_fraction", "not enough free fraction"
    no_memory = "no_memory", "not enough free memory"
    few_on_node = "few_on_node", "too few free GPUs on its node"
    no_host_cpus = "no_host_cpus", "not enough free host CPUs on its node"
    no_host_memory = "no_host_memory", "not enough free host memory on its node"
    no_gpus = "no_gpus", "no GPUs"
    held_for_interactive = "held_for_interactive", "held for interactive requests"


#: The pool's own limits, by the ``limit`` its 400 names (:meth:`.admission.Admission.beyond_the_pool`: no
#: node or GPU of the pool could ever take the request), as the misfit that rules out even the biggest node.
POOL_LIMITS = {"gpu_count": Misfit.few_on_node, "memory": Misfit.no_memory, "model": Misfit.model_mismatch,
               "cpus": Misfit.no_host_cpus, "host_memory": Misfit.no_host_memory}


def limit_code(limit: str | None, quota: bool = True) -> str:
    """The label of a refusal by the limit ``limit`` (the ``limit`` of the
    GPUPoolError). A quota's or a per-user cap's (``quota``: the 429
    ``quota_exceeded``) is ``quota_max_gpus``, ``quota`` when it is not a
    plain name. The pool's own (``quota`` False: the 400 naming the biggest
    node's or GPU's) is its :data:`POOL_LIMITS` misfit, ``few_on_node`` for
    more whole GPUs than any node has, as the scheduler counts a node too
    small (docs/api.md, "Metrics"); ``bad_request`` for a limit not there
    (counting never fails the refusal it counts)."""
    if not quota:
        return str(POOL_LIMITS[limit]) if limit in POOL_LIMITS else "bad_request"
    if limit and limit.replace("_", "").isalnum():
        return f"quota_{limit}"
    return "quota"
