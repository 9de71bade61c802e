"""The ``%gpu`` magics.

A session::

    In [1]: %load_ext gpupool.magics
    In [2]: %gpu acquire 0.5
    gpupool: attached L-3f2a9c1e07b4: 0.50 of NVIDIA A100-SXM4-80GB (GPU 0) on node-1,
             39.6 GiB; idle timeout 30m. Cells now run on the worker; %gpu release detaches.
    In [3]: import os; os.environ["GPUPOOL_LEASE_ID"]
    Out[3]: 'L-3f2a9c1e07b4'
    In [4]: %gpu release
    gpupool: released L-3f2a9c1e07b4 after 1m 2s (0.01 GPU-hours); brought back 1 variable: os (module)

While attached, an input transformer prefixes ``%%gpu`` to every cell that
does not start with ``%gpu``, ``%%gpu`` or ``%%local``, so ordinary cells run
on the worker (ipyparallel's ``%autopx`` swaps ``run_cell`` instead; the
transformer keeps IPython's own cell handling intact).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display
from traitlets import Float

from gpupool.api import ServiceClient
from gpupool.errors import GPUPoolError
from gpupool.schema import LeaseRequest, LeaseState
from gpupool.traits import ByteSize
from gpupool.transfer import describe
from gpupool.units import format_bytes, format_duration, parse_bytes, parse_duration, parse_gpu_amount

from .attachment import Attachment, ended_message
from gpupool.tables import lease_table, pool_table

ROUTED_PREFIXES = ("%gpu", "%%gpu", "%%local")


def _say(text: str) -> None:
    print(f"gpupool: {text}", flush=True)


@magics_class
class GPUMagics(Magics):
    """``%gpu acquire|release|status|pool|push|pull``, ``%%gpu`` and ``%%local``."""

    release_state_cap = ByteSize(
        2 * 1024**3,
        help="""Most bytes of worker variables brought back by `%gpu release` (default 2GiB).
        Larger state stays listed by name. Example: c.GPUMagics.release_state_cap = "8GiB".""",
    ).tag(config=True)
    start_timeout = Float(
        300.0, help="Seconds `%gpu acquire` waits for the worker to start (default 300).").tag(config=True)

    def __init__(self, shell, **kwargs) -> None:
        super().__init__(shell, **kwargs)
        self.attachment: Attachment | None = None
        self._client: ServiceClient | None = None

    # -- plumbing ---------------------------------------------------------------

    @property
    def client(self) -> ServiceClient:
        if self._client is None:
            self._client = ServiceClient.from_env()
        return self._client

    def route(self, lines: list[str]) -> list[str]:
        """Input transformer: send the cell to the worker while attached."""
        if self.attachment is None:
            return lines
        first = next((line.lstrip() for line in lines if line.strip()), "")
        if not first or first.startswith(ROUTED_PREFIXES):
            return lines
        return ["%%gpu\n", *lines]

    def _attached(self) -> Attachment:
        if self.attachment is None:
            raise UsageError("not attached to a GPU; run %gpu acquire 0.5 first")
        ended = self.attachment.ended
        if ended is not None:
            self._drop()
            raise UsageError(f"{ended_message(ended)}. The worker and its variables are gone; "
                             "this cell did not run. Run %gpu acquire to attach again.")
        return self.attachment

    def _drop(self) -> None:
        if self.attachment is not None:
            self.attachment.heartbeat.stop()
            self.attachment.remote.close()
            self.attachment = None

    # -- %gpu ---------------------------------------------------------------------

    @line_magic
    def gpu(self, line: str) -> Any:
        """Attach to a pooled GPU and manage the attachment.

        %gpu acquire 0.5 [--memory 20GiB] [--model A100] [--idle-timeout 30m]
        %gpu acquire 2               two whole GPUs on one node
        %gpu release [--discard]     variables come back unless --discard
        %gpu status                  lease, GPU, memory, idle countdown
        %gpu pool                    nodes and GPUs of the pool
        %gpu push NAME...            copy local variables to the worker
        %gpu pull NAME...            copy worker variables here
        """
        command, _, rest = line.strip().partition(" ")
        handlers = {"acquire": self._acquire, "release": self._release, "status": self._status,
                    "pool": self._pool, "push": self._push, "pull": self._pull}
        if command not in handlers:
            raise UsageError(f"unknown %gpu command {command!r}; use one of: {', '.join(handlers)}")
        try:
            return handlers[command](rest)
        except GPUPoolError as exc:
            raise UsageError(exc.message) from None

    @magic_arguments()
    @argument("amount", help="a fraction of one GPU (0.5) or a count of whole GPUs (2)")
    @argument("--memory", help="GPU memory for the slice, e.g. 20GiB (default: the fraction's share)")
    @argument("--model", help="only GPUs whose name contains this, e.g. A100")
    @argument("--idle-timeout", help="release after this long without a running cell, e.g. 10m")
    def _acquire(self, rest: str) -> None:
        args = _parse(self._acquire, rest)
        if self.attachment is not None and self.attachment.ended is None:
            raise UsageError(f"already attached to {self.attachment.lease.id}; run %gpu release first")
        self._drop()
        try:
            fraction, count = parse_gpu_amount(args.amount)
            request = LeaseRequest(
                fraction=fraction, gpu_count=count,
                memory=parse_bytes(args.memory) if args.memory else None, model=args.model,
                idle_timeout=parse_duration(args.idle_timeout) if args.idle_timeout else None,
                kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        started = time.monotonic()
        lease = self.client.create_lease(request)
        try:
            lease = self._wait_started(lease, started)
            self.attachment = Attachment.connect(self.client, lease)
        except BaseException:  # interrupted or failed: never leave the slice held
            self._cancel(lease.id)
            raise
        gpu = lease.gpus[0] if lease.gpus else {}
        share = f"{lease.fraction:.2f} of" if lease.gpu_count == 1 else f"{lease.gpu_count} x"
        _say(f"attached {lease.id}: {share} {gpu.get('name', 'GPU')} (GPU {gpu.get('index', '?')}) on {lease.node}, "
             f"{format_bytes(lease.memory)}; idle timeout {format_duration(lease.idle_timeout)} "
             f"[{time.monotonic() - started:.1f}s]. Cells now run on the worker; %gpu release detaches.")

    def _wait_started(self, lease, started: float):
        """Long-poll until the lease leaves ``starting``, showing progress."""
        while lease.state in (LeaseState.queued, LeaseState.starting):
            if time.monotonic() - started > self.start_timeout:
                raise GPUPoolError("start_timeout", f"no worker started within {self.start_timeout:.0f}s "
                                   "(c.GPUMagics.start_timeout); the request was cancelled", 504)
            print(f"\rgpupool: {lease.id} {lease.state.value} on {lease.node or 'the pool'}... "
                  f"{time.monotonic() - started:.0f}s", end="", flush=True)
            lease = self.client.get_lease(lease.id, wait=2, state=lease.state.value)
        print("\r", end="", flush=True)
        if lease.state is not LeaseState.active:
            raise GPUPoolError("lease_failed", f"the lease could not start: {ended_message(lease)}", 502)
        return lease

    def _cancel(self, lease_id: str) -> None:
        try:
            self.client.release(lease_id, reason="acquire cancelled")
        except GPUPoolError as exc:
            print(f"gpupool: could not cancel {lease_id}: {exc.message}", file=sys.stderr)

    @magic_arguments()
    @argument("--discard", action="store_true", help="do not bring the worker's variables back")
    def _release(self, rest: str) -> None:
        args = _parse(self._release, rest)
        attachment = self._attached()
        note = ""
        if not args.discard:
            values, items, errors = attachment.pull(None, max_bytes=self.release_state_cap)
            self.shell.user_ns.update(values)
            note = _transfer_note("brought back", items, errors)
        lease = attachment.release(reason="%gpu release")
        self.attachment = None
        used = lease.usage_gpu_seconds / 3600
        held = _held_seconds(lease)
        _say(f"released {lease.id} after {format_duration(held)} ({used:.2f} GPU-hours){note}")

    def _status(self, rest: str) -> None:
        if rest.strip():
            raise UsageError("%gpu status takes no arguments")
        if self.attachment is None:
            leases = self.client.list_leases(kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"))
            if not leases:
                _say("not attached; %gpu acquire 0.5 attaches half a GPU")
                return
        else:
            leases = [self.attachment.refresh()]
        text, html = lease_table(leases)
        display({"text/plain": text, "text/html": html}, raw=True)

    def _pool(self, rest: str) -> None:

        text, html = pool_table(self.client.pool())
        display({"text/plain": text, "text/html": html}, raw=True)

    def _push(self, rest: str) -> None:
        names = rest.split()
        if not names:
            raise UsageError("%gpu push needs variable names: %gpu push X y")
        missing = [n for n in names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"not defined here: {', '.join(missing)}; nothing was sent")
        items, errors = self._attached().push({n: self.shell.user_ns[n] for n in names})
        _say(_transfer_note("pushed", items, errors).lstrip("; "))

    def _pull(self, rest: str) -> None:
        names = rest.split()
        if not names:
            raise UsageError("%gpu pull needs variable names: %gpu pull model history")
        values, items, errors = self._attached().pull(names)
        self.shell.user_ns.update(values)
        _say(_transfer_note("pulled", items, errors).lstrip("; "))

    # -- %%gpu and %%local --------------------------------------------------------

    @cell_magic("gpu")
    def gpu_cell(self, line: str, cell: str) -> None:
        """Run this cell on the attached worker (what every cell does while attached).

        %%gpu
        import torch; torch.cuda.is_available()
        """
        if line.strip():
            raise UsageError("%%gpu takes no arguments")
        attachment = self._attached()
        try:
            attachment.run_cell(cell)
        except GPUPoolError as exc:
            if exc.code == "lease_lost":
                self._drop()
            raise UsageError(exc.message) from None

    @cell_magic
    def local(self, line: str, cell: str) -> None:
        """Run this cell in the local CPU kernel while attached.

        %%local
        df.describe()
        """
        saved, self.attachment = self.attachment, None
        try:
            self.shell.run_cell(cell, store_history=False)
        finally:
            self.attachment = saved


def _parse(method, rest: str):
    try:
        return parse_argstring(method, rest)
    except UsageError:
        raise
    except SystemExit:  # argparse exits on bad arguments; IPython's parser raises UsageError
        raise UsageError(f"bad arguments: {rest!r}") from None


def _transfer_note(verb: str, items: list[dict[str, Any]], errors: dict[str, str]) -> str:
    parts = []
    if items:
        count = f"{len(items)} variable{'s' if len(items) != 1 else ''}"
        parts.append(f"{verb} {count}: {describe(items)}")
    if errors:
        parts.append("not moved: " + "; ".join(f"{name} ({why})" for name, why in errors.items()))
    return "; " + "; ".join(parts) if parts else ""


def _held_seconds(lease) -> float | None:
    from gpupool.schema import parse_time

    start, end = parse_time(lease.started_at), parse_time(lease.ended_at)
    return (end - start).total_seconds() if start and end else None
