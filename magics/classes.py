"""Which class a notebook's lease asks for: ``interactive`` unless told.

``%gpu acquire 0.5 --batch`` asks for ``batch``; so does any acquire in a
kernel whose environment sets ``GPUPOOL_LEASE_CLASS=batch`` (a kernelspec's
``env``, or a runner such as papermill: ``GPUPOOL_LEASE_CLASS=batch papermill
in.ipynb out.ipynb``). Nothing is guessed from how the kernel was started.
"""

from __future__ import annotations

from typing import Mapping

from gpupool.schema import LEASE_CLASSES

ENV_CLASS = "GPUPOOL_LEASE_CLASS"


def requested_class(batch: bool, environ: Mapping[str, str]) -> str:
    """``"batch"`` when ``batch`` (the flag) or ``environ[GPUPOOL_LEASE_CLASS]``
    says so, else ``"interactive"``. Raises ValueError naming the variable and
    the classes for an unknown value in it."""
    named = environ.get(ENV_CLASS, "").strip()
    if named and named not in LEASE_CLASSES:
        raise ValueError(f"{ENV_CLASS}={named!r:.40} is not a lease class; use one of {', '.join(LEASE_CLASSES)} "
                         "(or unset it)")
    return "batch" if batch else named or "interactive"


def class_note(lease) -> str:
    """``"; batch, preemptible"`` for what of ``lease`` is not the default, else ``""`` (the attach line)."""
    notes = [lease.lease_class] * (lease.lease_class != "interactive") + ["preemptible"] * bool(lease.preemptible)
    return "; " + ", ".join(notes) if notes else ""
