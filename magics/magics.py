"""The ``%gpu`` magics.

A session::

    In [1]: %load_ext gpupool.magics
    In [2]: %gpu acquire 0.5
    gpupool: attached L-3f2a9c1e07b4: 0.50 of NVIDIA A100-SXM4-80GB (GPU 0) on node-1 in environment
             default, 39.6 GiB; idle timeout 30m. Cells now run on the worker; %gpu release detaches.
    In [3]: import os; os.environ["GPUPOOL_LEASE_ID"]
    Out[3]: 'L-3f2a9c1e07b4'
    In [4]: %gpu release
    gpupool: released L-3f2a9c1e07b4 after 1m 2s (0.01 GPU-hours); brought back 1 variable: os (module)

While attached, a routed cell first sends along the local variables it reads
that the worker lacks (``gpupool: sent along x (ndarray, 8.0 MiB)``); an idle
lease is parked shortly before the service would reclaim it (its variables
come here) and the next routed cell resumes on a slice of the same size::

    In [5]: loss
    gpupool: L-3f2a9c1e07b4 was parked after idle; brought back 2 variables: ...; acquiring 0.50 of a GPU again
    gpupool: resumed on L-77c0e1d2a9f3; restored 2 variables: ...

In the gpupool kernel (:mod:`gpupool.magics.kernel`) an attached notebook's
cells are forwarded to the worker by the kernel itself. Loaded into any other
IPython (``%load_ext gpupool.magics``) the magics still acquire, move
variables and release, but cells stay local: ``%%gpu`` runs one cell on the
worker, its output replayed through this kernel (no widgets, completion or
debugger there; docs/api.md, "Plain IPython kernels").
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display
from traitlets import Float, Unicode

from gpupool.api import ServiceClient
from gpupool.errors import GPUPoolError
from gpupool.schema import ENV_KERNEL_NAME, LeaseRequest, LeaseState, kernel_environment
from gpupool.traits import ByteSize, Duration
from gpupool.transfer import describe, package_versions, version_mismatches
from gpupool.units import format_bytes, format_duration, parse_bytes, parse_duration, parse_gpu_amount

from .attachment import Attachment, ended_message
from .classes import class_note, requested_class
from .park import MIN_IDLE_TIMEOUT
from .summary import summarize
from .quota import progress_words, quota_report
from .namespace import local_candidates
from gpupool.tables import gpu_utilization, lease_table, pool_table

#: %gpu commands that a cell running on the worker may not call mid-cell.
NOT_MID_CELL = {"acquire": "a second %gpu acquire", "release": "%gpu release", "restart": "%gpu restart",
                "push": "%gpu push", "pull": "%gpu pull"}


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
    max_output_bytes = ByteSize(
        16 * 1024**2,
        help="""Most output one routed cell relays into the notebook (stream text and display
        data), default 16MiB; the rest is cut with a note. Example: c.GPUMagics.max_output_bytes = "64MiB".""",
    ).tag(config=True)
    cell_lease = Unicode(
        "0.25",
        help="""What `%%gpu` acquires for one cell when not attached: a fraction of one GPU ("0.25")
        or a count of whole GPUs ("1"), default "0.25". Example: c.GPUMagics.cell_lease = "0.5".""",
    ).tag(config=True)

    park_ahead = Duration(
        30.0,
        help="""Seconds before the service would reclaim an idle lease that the client parks it
        (pulls its variables here and gives the GPU back; the next cell resumes on a new slice),
        default 30s; `%gpu acquire --on-idle release` opts out. Example: c.GPUMagics.park_ahead = "1m".""",
    ).tag(config=True)

    preempt_notice = Duration(
        10.0,
        help="""Fewest seconds between telling the notebook that a preemptible lease's running cell
        will be interrupted (others wait for a GPU) and interrupting it, default 10s.
        Example: c.GPUMagics.preempt_notice = "30s".""",
    ).tag(config=True)

    def __init__(self, shell, kernel=None, **kwargs) -> None:
        super().__init__(shell, **kwargs)
        # The gpupool kernel forwarding this notebook's cells, None in any other IPython.
        self.kernel = kernel
        self.attachment: Attachment | None = None
        self._client: ServiceClient | None = None
        # name -> (id of the local value, device it was on): values pulled off a GPU
        # go back to that device when they are next sent (issue 6, "release keeps state").
        self.devices: dict[str, tuple[int, str]] = {}

    # -- plumbing ---------------------------------------------------------------

    @property
    def client(self) -> ServiceClient:
        if self._client is None:
            self._client = ServiceClient.from_env()
        return self._client

    def _attached(self) -> Attachment:
        if self.attachment is None:
            raise UsageError("not attached to a GPU; run %gpu acquire 0.5 first")
        if self.attachment.parked is not None:
            try:
                return self._resume()
            except GPUPoolError as exc:
                raise UsageError(f"could not resume the parked lease: {exc.message}") from None
        ended = self.attachment.ended
        if ended is not None:
            self.drop()
            raise UsageError(f"{ended_message(ended)}. The worker and its variables are gone; "
                             "this cell did not run. Run %gpu acquire to attach again.")
        return self.attachment

    def drop(self) -> None:
        """Forget the attachment without releasing (the lease has ended)."""
        if self.attachment is not None:
            self.attachment.heartbeat.stop()
            self.attachment.remote.close()
            self.attachment = None
            self._tell()

    # -- %gpu ---------------------------------------------------------------------

    @line_magic
    def gpu(self, line: str) -> Any:
        """Attach to a pooled GPU and manage the attachment.

        %gpu acquire 0.5 [--memory 20GiB] [--model A100] [--idle-timeout 30m] [--env torch] [--batch] [--preemptible]
        %gpu acquire 0.5 --cpus 4 --host-memory 32GiB   host cores and RAM (default: the GPU share's part of the node)
        %gpu acquire 2               two whole GPUs on one node
        %gpu release [--discard]     variables come back unless --discard
        %gpu restart                 a fresh worker of the same size (the old one's variables are lost)
        %gpu status                  lease, environment, GPU, memory, idle countdown
        %gpu pool                    nodes, GPUs and worker environments of the pool
        %gpu quota                   your limits and GPU-hours used
        %gpu push NAME...            copy local variables to the worker
        %gpu pull NAME...            copy worker variables here
        """
        command, _, rest = line.strip().partition(" ")
        if command in ("", "help", "-h", "--help"):
            print(_dedent(self.gpu.__doc__))
            return None
        handlers = {"acquire": self._acquire, "release": self._release, "status": self._status,
                    "pool": self._pool, "push": self._push, "pull": self._pull,
                    "restart": self._restart, "quota": self._quota}
        if command not in handlers:
            raise UsageError(f"unknown %gpu command {command!r}; use one of: {', '.join(handlers)} "
                             "(%gpu help shows what each does)")
        if {"-h", "--help"} & set(rest.split()):
            parser = getattr(handlers[command], "parser", None)
            print(parser.format_help() if parser else _dedent(self.gpu.__doc__))
            return None
        try:
            return handlers[command](rest)
        except GPUPoolError as exc:
            if command == "acquire":  # quota, pool full, bad size: the front end says so too
                self._tell("refused", exc.message, code=exc.code)
            raise UsageError(exc.message) from None

    @magic_arguments()
    @argument("amount", help="a fraction of one GPU (0.5) or a count of whole GPUs (2)")
    @argument("--memory", help="GPU memory for the slice, e.g. 20GiB (default: the fraction's share)")
    @argument("--model", help="only GPUs whose name contains this, e.g. A100")
    @argument("--cpus", type=float, help="host CPU cores for the worker, e.g. 4 (default: the GPU share's part)")
    @argument("--host-memory", help="host RAM for the worker, e.g. 32GiB (default: the GPU share's part)")
    @argument("--idle-timeout", help="release after this long without a running cell, e.g. 10m")
    @argument("--wait", help="when no GPU is free, wait in the queue this long, e.g. 10m (default: refuse)")
    @argument("--env", help="the worker environment on the GPU node, e.g. torch; %%gpu pool lists them (default: the "
                            "one named like this kernel, torch for a kernel torch or gpupool-torch, where a node "
                            "offers it, else the node's)")
    @argument("--on-idle", choices=("park", "release"), default="park",
              help="when idle: park (variables come back, the next cell resumes; default) or just release")
    @argument("--batch", action="store_true", help="a batch run: queued behind interactive requests "
              "(default: interactive, or $GPUPOOL_LEASE_CLASS)")
    @argument("--preemptible", action="store_true",
              help="while others wait, the running cell may be interrupted and the lease parked")
    def _acquire(self, rest: str) -> None:
        args = _parse(self._acquire, rest)
        if self.attachment is not None and self.attachment.ended is None:
            raise UsageError(f"already attached to {self.attachment.lease.id}; run %gpu release first")
        self.drop()
        try:
            fraction, count = parse_gpu_amount(args.amount)
            if args.cpus is not None and not args.cpus > 0:
                raise ValueError(f"--cpus must be more than 0 cores, got {args.cpus:g}")
            request = LeaseRequest(
                fraction=fraction, gpu_count=count,
                memory=parse_bytes(args.memory) if args.memory else None, model=args.model,
                idle_timeout=parse_duration(args.idle_timeout) if args.idle_timeout else None,
                kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"), wait=parse_duration(args.wait) if args.wait else None,
                env=args.env, prefer_env=None if args.env else _kernel_env(),
                lease_class=requested_class(args.batch, os.environ), preemptible=args.preemptible or None,
                cpus=args.cpus, host_memory=parse_bytes(args.host_memory) if args.host_memory else None)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if args.on_idle == "park" and request.idle_timeout is not None and request.idle_timeout < MIN_IDLE_TIMEOUT:
            raise UsageError(f"--idle-timeout {args.idle_timeout} is too short to park the variables safely before "
                             f"the pool reclaims the slice; use at least {MIN_IDLE_TIMEOUT:.0f}s (or --on-idle release)")
        started = time.monotonic()
        self.attachment = self._attach(request)
        if args.on_idle == "park":
            self._arm_parking(self.attachment)
        lease = self.attachment.lease
        gpu = lease.gpus[0] if lease.gpus else {}
        share = f"{lease.fraction:.2f} of" if lease.gpu_count == 1 else f"{lease.gpu_count} x"
        indices = ", ".join(str(g.get("index", "?")) for g in lease.gpus) or "?"
        where = ("Cells now run on the worker; %gpu release detaches." if self.kernel is not None else
                 "This kernel is not the gpupool kernel, so cells stay here: start one with %%gpu to run it "
                 "on the worker (the Python 3 (gpupool) kernel runs every cell there).")
        _say(f"attached {lease.id}: {share} {gpu.get('name', 'GPU')} (GPU {indices}) on {lease.node}"
             f"{f' in environment {lease.env}' if lease.env else ''}, "
             f"{format_bytes(lease.memory)}{_host_words(lease)}; idle timeout {format_duration(lease.idle_timeout)}"
             f"{class_note(lease)} "
             f"[{time.monotonic() - started:.1f}s]. {where}")
        if self.attachment.workdir:
            _say(self.attachment.workdir)
        self._tell("attached", f"attached {lease.id}: {share} {gpu.get('name', 'GPU')} on {lease.node}")

    def _attach(self, request: LeaseRequest, forward: bool = True) -> Attachment:
        """Create a lease for ``request``, wait for its worker (with progress),
        connect and warn about version mismatches. Cancels the lease on any
        failure or interrupt. The lease names the JupyterHub server this kernel
        runs in, so stopping that server releases it. In the gpupool kernel,
        ``forward`` (not for a ``%%gpu`` cell's own lease) starts forwarding."""
        started = time.monotonic()
        lease = self.client.create_lease(replace(request, server_name=os.environ.get("JUPYTERHUB_SERVER_NAME")))
        attachment = None
        try:
            lease = self._wait_started(lease, started)
            attachment = Attachment.connect(self.client, lease)
            if self.kernel is not None and forward:
                self._start_forwarding(attachment)
        except BaseException:  # interrupted or failed: never leave the slice held
            if attachment is not None:
                attachment.heartbeat.stop()
                attachment.remote.close()
            self._cancel(lease.id)
            self._tell()
            raise
        self._warn_versions(attachment)
        if not forward:  # a %%gpu cell's own lease: the notebook stays detached
            self._tell()
        return attachment

    def _start_forwarding(self, attachment: Attachment) -> None:
        """Hand the worker's IOPub to the kernel's relay, tell the worker this
        notebook's execution count and folder, and send notices as events."""
        attachment.remote.relay_iopub(self.kernel.publish_relayed)
        attachment.heartbeat.notify = self.kernel.notify
        attachment.heartbeat.on_lease = lambda lease: self._tell()
        user = attachment.lease.owner
        answer, _ = attachment.request({"op": "attach", "execution_count": self.shell.execution_count,
                                        "cwd": os.getcwd(), "user": user})
        cwd = answer.get("cwd")
        attachment.workdir = (f"the worker runs in this notebook's folder, {cwd}" if answer.get("notebook_dir") else
                              f"the GPU node cannot enter this notebook's folder {os.getcwd()}, so the worker runs "
                              f"in a scratch folder of yours there, {cwd}: copy the files it needs with %gpu push "
                              "or a shared folder")

    def prepare_forward(self, code: str) -> Attachment:
        """Before the gpupool kernel forwards cell ``code``: resume a parked
        lease, send along the local values the cell reads that the worker
        lacks. Raises UsageError with words when the cell cannot run there."""
        attachment = self._attached()
        try:
            self._follow(attachment, code)
        except GPUPoolError as exc:
            if exc.code == "lease_lost":
                self.drop()
            raise UsageError(exc.message) from None
        return attachment

    def run_for_worker(self, line: str) -> dict[str, Any]:
        """A ``%gpu LINE`` from a cell running on the worker: run it here (its
        output goes to that cell) unless it would detach or talk to the busy
        worker; ``{"ok": bool, "message": words}`` goes back to the worker."""
        command = line.strip().partition(" ")[0]
        if command in NOT_MID_CELL:
            return {"ok": False, "message": f"{NOT_MID_CELL[command]} cannot run inside a cell that runs on the "
                                            "worker; put it in a cell of its own"}
        try:
            self.gpu(line)
        except UsageError as exc:
            return {"ok": False, "message": str(exc)}
        except Exception as exc:  # the cell on the worker shows it; this kernel goes on
            return {"ok": False, "message": f"{type(exc).__name__}: {exc}"}
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        return {"ok": True, "message": ""}

    def _arm_parking(self, attachment: Attachment) -> None:
        attachment.park_when_idle(self.park_ahead, self.release_state_cap, self._take)
        attachment.heartbeat.preempt_notice = self.preempt_notice

    def _resume(self) -> Attachment:
        """The lease was parked: acquire a slice of the same size again (with
        progress) and push the parked variables back before the cell runs."""
        parked = self.attachment.parked
        self.drop()
        old = parked.lease
        share = f"{old.fraction:.2f} of a GPU" if old.gpu_count == 1 else f"{old.gpu_count} GPUs"
        _say(f"{old.id} was {parked.why}{summarize('brought back', parked.items, parked.errors)}; "
             f"acquiring {share} again")
        attachment = self._attach(_same_size(old))
        self._arm_parking(attachment)
        self.attachment = attachment
        names = [n for n in parked.names if n in self.shell.user_ns]
        items, errors = self._send(attachment, names) if names else ([], {})
        _say(f"resumed on {attachment.lease.id}{summarize('restored', items, errors)}")
        self._tell("resumed", f"{old.id} resumed on {attachment.lease.id}{summarize('restored', items, errors)}")
        return attachment

    def _warn_versions(self, attachment: Attachment) -> None:
        try:
            mismatches = version_mismatches(package_versions(), attachment.versions())
        except GPUPoolError as exc:
            print(f"gpupool: could not compare package versions with the worker: {exc.message}", file=sys.stderr)
            return
        if mismatches:
            print("gpupool: warning: versions differ, values of these may fail to move between this kernel and "
                  "the worker: " + "; ".join(mismatches), file=sys.stderr, flush=True)

    def _wait_started(self, lease, started: float):
        """Long-poll until the lease leaves ``starting``, showing progress."""
        since = started
        queued = False
        shown = 0  # length of the progress line, blanked when it is done
        while lease.state in (LeaseState.queued, LeaseState.starting):
            if lease.state is LeaseState.queued:
                since = time.monotonic()  # the start timeout counts from leaving the queue (the service ends waits)
            self._tell_progress(lease, queued, started)
            queued = lease.state is LeaseState.queued
            if time.monotonic() - since > self.start_timeout:
                raise GPUPoolError("start_timeout", f"no worker started within {self.start_timeout:.0f}s "
                                   "(c.GPUMagics.start_timeout); the request was cancelled", 504)
            line = f"gpupool: {lease.id} {progress_words(lease)}... {time.monotonic() - started:.0f}s"
            print(f"\r{line:<{shown}}", end="", flush=True)
            shown = max(shown, len(line))
            lease = self.client.get_lease(lease.id, wait=2, state=lease.state.value)
        if shown:  # front ends that overwrite after "\r" character by character keep no tail of it
            print("\r" + " " * shown + "\r", end="", flush=True)
        if queued:
            self._tell_progress(lease, queued, started)
        if lease.state is not LeaseState.active:
            raise GPUPoolError("lease_failed", f"the lease could not start: {ended_message(lease)}", 502)
        return lease

    # -- the front end's view (gpupool kernel only; gpupool.magics.events) ---------

    def _tell(self, kind: str | None = None, message: str = "", **extra: Any) -> None:
        """Send event ``kind`` (what this cell says anyway) and the new state to
        the front ends listening on ``gpupool.status``; nothing outside the gpupool kernel."""
        events = getattr(self.kernel, "events", None)
        if events is None:
            return
        if kind:
            events.emit(kind, message, **extra)
        events.changed()

    def _tell_progress(self, lease, was_queued: bool, started: float) -> None:
        """A waited-for ``lease``: its queued/starting state, and "admitted"
        once it leaves the queue."""
        events = getattr(self.kernel, "events", None)
        if events is None:
            return
        from .events import lease_state, progress_phase

        if was_queued and lease.state is not LeaseState.queued:
            events.emit("admitted", f"{lease.id} left the queue after {time.monotonic() - started:.0f}s; "
                                    f"starting on {lease.node or 'the pool'}")
        events.changed(lease_state(progress_phase(lease), lease))

    def _cancel(self, lease_id: str) -> None:
        try:
            self.client.release(lease_id, reason="acquire cancelled")
        except GPUPoolError as exc:
            print(f"gpupool: could not cancel {lease_id}: {exc.message}", file=sys.stderr)

    @magic_arguments()
    @argument("--discard", action="store_true", help="do not bring the worker's variables back")
    def _release(self, rest: str) -> None:
        args = _parse(self._release, rest)
        if self.attachment is not None and self.attachment.parked is not None:
            lease = self.attachment.parked.lease
            self.drop()
            _say(f"released {lease.id}: it was parked after idle and its variables are already here")
            self._tell("released", f"released {lease.id} (it was parked)")
            return
        attachment = self._attached()
        note = ""
        if not args.discard:
            try:
                values, items, errors = attachment.pull(None, max_bytes=self.release_state_cap)
                self._take(values, items)
                note = summarize("brought back", items, errors)
            except GPUPoolError as exc:  # the worker died or is unreachable: the slice is still freed
                note = f"; the worker's variables could not come back: {exc.message}"
        self.attachment = None  # from here on this kernel is detached, whatever happens
        try:
            lease = attachment.release(reason="%gpu release")
        except KeyboardInterrupt:  # finish what was asked (release is idempotent), then stop
            lease = attachment.client.release(attachment.lease.id, reason="%gpu release")
        _say(f"released {lease.id} after {format_duration(_held_seconds(lease))} "
             f"({_usage_words(lease.usage_gpu_seconds)}){note}")
        self._tell("released", f"released {lease.id} after {format_duration(_held_seconds(lease))}")

    def _restart(self, rest: str) -> None:
        """Release the lease without its variables (the worker may be stuck)
        and attach to a fresh one of the same size."""
        if rest.strip():
            raise UsageError("%gpu restart takes no arguments")
        if self.attachment is None:
            raise UsageError("not attached to a GPU; run %gpu acquire 0.5 first")
        old = self.attachment.parked.lease if self.attachment.parked else self.attachment.lease
        parks = self.attachment.heartbeat.on_beat is not None
        self.drop()
        try:
            self.client.release(old.id, reason="%gpu restart")
        except GPUPoolError as exc:  # already ended (parked, reclaimed): a new slice is what was asked for
            print(f"gpupool: {old.id}: {exc.message}", file=sys.stderr)
        self.attachment = self._attach(_same_size(old))
        if parks:
            self._arm_parking(self.attachment)
        _say(f"restarted: released {old.id} (its variables are lost), attached {self.attachment.lease.id}")
        self._tell("attached", f"restarted: attached {self.attachment.lease.id}")

    def _status(self, rest: str) -> None:
        if rest.strip():
            raise UsageError("%gpu status takes no arguments")
        if self.attachment is not None and self.attachment.parked is not None:
            _say(f"parked: {self.attachment.parked.lease.id} was given back after idle and its variables are "
                 "here; the next cell resumes on a slice of the same size (%gpu release detaches)")
            return
        if self.attachment is None:
            leases = self.client.list_leases(kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"))
            if not leases:
                _say("not attached; %gpu acquire 0.5 attaches half a GPU")
                return
        else:
            leases = [self.attachment.refresh()]
        text, html = lease_table(leases, gpu_utilization(self.client.pool()))
        display({"text/plain": text, "text/html": html}, raw=True)

    def _quota(self, rest: str) -> None:
        """``%gpu quota``: your limits beside today's and this week's usage."""
        print(quota_report(self.client))

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
        items, errors = self._send(self._attached(), names)
        _say(_transfer_note("pushed", items, errors).lstrip("; "))

    def _pull(self, rest: str) -> None:
        names = rest.split()
        if not names:
            raise UsageError("%gpu pull needs variable names: %gpu pull model history")
        values, items, errors = self._attached().pull(names)
        self._take(values, items)
        _say(_transfer_note("pulled", items, errors).lstrip("; "))

    # -- %%gpu and %%local --------------------------------------------------------

    def _take(self, values: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Put pulled ``values`` into the user's namespace, remembering the
        device of each that came off an accelerator."""
        self.shell.user_ns.update(values)
        for item in items:
            name = item["name"]
            if item.get("device") and name in values:
                self.devices[name] = (id(values[name]), item["device"])
            else:
                self.devices.pop(name, None)

    def _send(self, attachment: Attachment, names: list[str]):
        """Push local ``names`` with the devices remembered for them (only while
        the local value is still the one that was pulled)."""
        values = {n: self.shell.user_ns[n] for n in names}
        devices = {n: self.devices[n][1] for n in names if n in self.devices and self.devices[n][0] == id(values[n])}
        return attachment.push(values, devices)

    def _follow(self, attachment: Attachment, cell: str) -> None:
        """Send along the local names ``cell`` reads that the worker lacks, with
        a one-line note; one line per value that cannot be sent."""
        candidates = local_candidates(cell, self.shell.user_ns, self.shell.user_ns_hidden)
        if not candidates:
            return
        have = attachment.have(candidates)
        missing = [n for n in candidates if n not in have]
        if not missing:
            return
        items, errors = self._send(attachment, missing)
        if items:
            _say(f"sent along {describe(items)}")
        for name, why in errors.items():
            print(f"gpupool: could not send {name}: {why}", file=sys.stderr, flush=True)

    @cell_magic("gpu")
    def gpu_cell(self, line: str, cell: str) -> None:
        """Run this cell on the worker: the attached one (what every cell does
        while attached), or, when not attached, on a lease of its own of
        ``AMOUNT`` (default c.GPUMagics.cell_lease) that is released after the
        cell, its variables coming back here.

        %%gpu 0.5
        import torch; x = torch.ones(3); torch.cuda.is_available()
        """
        if self.attachment is None:
            self._run_on_temporary_lease(line.strip() or self.cell_lease, cell)
            return
        if line.strip():
            raise UsageError("%%gpu takes an amount only when not attached; this kernel is attached")
        attachment = self._attached()
        try:
            self._follow(attachment, cell)
            attachment.run_cell(cell, self.max_output_bytes)
        except GPUPoolError as exc:
            if exc.code == "lease_lost":
                self.drop()
            raise UsageError(exc.message) from None

    def _run_on_temporary_lease(self, amount: str, cell: str) -> None:
        try:
            fraction, count = parse_gpu_amount(amount)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        request = LeaseRequest(fraction=fraction, gpu_count=count, kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"),
                               prefer_env=_kernel_env())
        try:
            attachment = self._attach(request, forward=False)
        except GPUPoolError as exc:
            raise UsageError(exc.message) from None
        try:
            self._follow(attachment, cell)
            attachment.run_cell(cell, self.max_output_bytes)
        except GPUPoolError as exc:
            raise UsageError(exc.message) from None
        finally:
            self._bring_back_and_release(attachment, "%%gpu cell finished")

    def _bring_back_and_release(self, attachment: Attachment, reason: str) -> None:
        note = ""
        try:
            if attachment.ended is None:
                values, items, errors = attachment.pull(None, max_bytes=self.release_state_cap)
                self._take(values, items)
                note = summarize("brought back", items, errors)
        finally:
            lease = attachment.release(reason=reason)
        _say(f"released {lease.id}{note}")

    @cell_magic
    def local(self, line: str, cell: str) -> None:
        """Run this cell in the local CPU kernel while attached.

        %%local
        df.describe()
        """
        result = self.shell.run_cell(cell, store_history=False)
        if not result.success:  # already shown by run_cell: fail the cell without a second traceback
            raise _shown_error(result.error_in_exec or result.error_before_exec)


def _same_size(old) -> LeaseRequest:
    """A request for a slice like lease ``old`` (resume after parking, restart), in
    its environment where a node still offers it (the parked values came from there)."""
    return LeaseRequest(fraction=old.fraction, gpu_count=old.gpu_count, memory=old.memory,
                        idle_timeout=old.idle_timeout, kernel_id=os.environ.get("GPUPOOL_KERNEL_ID"),
                        prefer_env=old.env or _kernel_env(), lease_class=old.lease_class,
                        preemptible=old.preemptible or None,
                        # the same ask, not its result: a default share gets the default again
                        cpus=old.requested_cpus, host_memory=old.requested_host_memory)


def _kernel_env() -> str | None:
    """The worker environment this kernel prefers: its kernelspec's name
    (GPUPOOL_KERNEL_NAME, set by the kernel provisioner; :func:`gpupool.schema.kernel_environment`)."""
    return kernel_environment(os.environ.get(ENV_KERNEL_NAME))


def _host_words(lease) -> str:
    """``', 4 CPUs and 32.0 GiB of host memory'``; empty when the node reports no host."""
    if lease.cpus is None or lease.host_memory is None:
        return ""
    return f", {lease.cpus:g} CPUs and {format_bytes(lease.host_memory)} of host memory"


def _dedent(text: str | None) -> str:
    import textwrap

    head, _, body = (text or "").partition("\n")
    return head + "\n" + textwrap.dedent(body)


def _usage_words(gpu_seconds: float) -> str:
    """``'42.0 GPU-seconds'`` below six minutes, else ``'1.25 GPU-hours'``."""
    return f"{gpu_seconds:.1f} GPU-seconds" if gpu_seconds < 360 else f"{gpu_seconds / 3600:.2f} GPU-hours"


def _shown_error(error: BaseException | None) -> Exception:
    """An exception of the same name as ``error`` that IPython prints as
    nothing: the cell fails (Run All stops) and the traceback is not shown twice."""
    name = type(error).__name__ if error is not None else "Error"
    kind = type(name, (Exception,), {"_render_traceback_": lambda self: []})
    return kind(str(error) if error is not None else "")


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
