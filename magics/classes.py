"""Which class a notebook's lease asks for: the default class (``interactive``,
the table's first: :mod:`gpupool.leaseclasses`) unless told.

``%gpu acquire 0.5 --class NAME`` asks for any class of the table;
``%gpu acquire 0.5 --batch`` (short for ``--class batch``) asks for ``batch``; so does any acquire in a
kernel whose environment sets ``GPUPOOL_LEASE_CLASS=batch`` (a kernelspec's
``env``, or a runner such as papermill: ``GPUPOOL_LEASE_CLASS=batch papermill
in.ipynb out.ipynb``). Nothing is guessed from how the kernel was started.
"""

from __future__ import annotations

from typing import Mapping

from gpupool import leaseclasses

ENV_CLASS = "GPUPOOL_LEASE_CLASS"
#: The class ``--batch`` names (a shorthand for ``--class batch``).
BATCH = "batch"


def requested_class(batch: bool, environ: Mapping[str, str], named: str | None = None) -> str:
    """``named`` (``--class``) when given, else ``"batch"`` when ``batch`` (the flag),
    else ``environ[GPUPOOL_LEASE_CLASS]`` when set, else the default class. Raises
    ValueError in words naming the classes for an unknown class (naming the
    variable when it came from there), and for ``--batch`` with another ``--class``."""
    choices = ", ".join(leaseclasses.names())
    if named is not None:
        if batch and named != BATCH:
            raise ValueError(f"--batch asks for class batch, --class for {named!r:.40}: say one of them")
        try:
            return leaseclasses.lease_class(named).name
        except ValueError:
            raise ValueError(f"--class {named!r:.40} is not a lease class; use one of {choices}") from None
    named = environ.get(ENV_CLASS, "").strip()
    if named and named not in leaseclasses.names():
        raise ValueError(f"{ENV_CLASS}={named!r:.40} is not a lease class; use one of {choices} (or unset it)")
    return BATCH if batch else named or leaseclasses.default().name


def class_note(lease) -> str:
    """``"; batch, preemptible"`` for what of ``lease`` is not the default, else ``""`` (the attach line)."""
    notes = ([lease.lease_class] * (lease.lease_class != leaseclasses.default().name)
             + ["preemptible"] * bool(lease.preemptible))
    return "; " + ", ".join(notes) if notes else ""
