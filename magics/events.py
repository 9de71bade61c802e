"""Lease events of the gpupool kernel: said at the top of the next cell, and
sent to front ends that listen.

Notices that come while no cell runs (the idle warning, "parked", "node
lost", "node back", a lease ended behind the user's back) must not be
written into an old cell's saved output. The kernel keeps them and says each
once at the top of the next cell's output (one that comes while a forwarded
cell runs is said in that cell at once); a front end (the JupyterLab
extension, ``labextension/``) that opens a comm to target ``gpupool.status``
gets, on that comm (:mod:`gpupool.wire.status`; docs/api.md, "The status comm"):

- ``{"event": KIND, "message": WORDS}`` for each notice at once, and for
  what a cell says anyway (``attached``, ``released``, ``resumed``,
  ``admitted`` from the queue, ``refused`` acquires) without keeping those;
- ``{"state": {...}}`` (:func:`lease_state`) when the comm opens and on every
  change: attach, release, park, resume, each heartbeat that changes a fact
  (memory used, idle deadline, node state), each step of a queued request;
- ``{"reply": KIND, "id": ..., "ok": bool, "message": WORDS, ...}`` for each
  ``{"request": KIND, "id": ...}`` it sends (:class:`Requests`): ``acquire``
  (``"text"``: what follows ``%gpu acquire``, parsed by the magic itself),
  ``release``, ``status``, ``defaults``.

The comm never reaches the worker: :mod:`gpupool.magics.kernel` keeps every
``gpupool.*`` target in the notebook kernel.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from gpupool.heartbeat import preempted_for
from gpupool.leasewait import RESUME_STATES, WAITING_FOR_ROOM
from gpupool.schema import LeaseState
from gpupool.units import format_duration, format_share
from gpupool.wire.leases import Lease
from gpupool.wire.status import (PHASES, REQUESTS, STATE_KEYS, TARGET, event_message, refusal, reply_message,
                                 state_message)

if TYPE_CHECKING:  # they import this module
    from .attachment import Attachment
    from .lifecycle import Lifecycle
    from .service import Service
    from .status import Status

#: The share the Acquire dialog offers first.
DIALOG_AMOUNT = "0.5"
#: The Acquire dialog's fields (labextension/src/index.ts, ``AcquireForm``): the first holds the
#: start of the line (the share, and any word it does not read), each other fills in one option.
AMOUNT_FIELD = "Share or count"
DIALOG_FIELDS = {"--memory": "Memory", "--model": "Model", "--idle-timeout": "Idle timeout"}
#: The service's ``limit`` of a refusal (a quota's, or what no node has) -> the dialog's field it is about.
LIMIT_FIELDS = {"model": "Model", "memory": "Memory", "gpu_count": AMOUNT_FIELD, "max_gpus": AMOUNT_FIELD,
                "max_lease_gpus": AMOUNT_FIELD}
log = logging.getLogger("gpupool.magics")


def lease_state(phase: str, lease: Lease | None = None) -> dict[str, Any]:
    """The snapshot a front end shows, for ``lease`` in ``phase`` (one of PHASES).

    Keys (always all present; None where not known or not applicable):
    ``phase``; ``lease`` (id); ``share`` (words: ``"0.50 of a GPU"``,
    ``"2 GPUs"``), ``fraction`` and ``gpu_count``; ``gpu_model``, ``gpu_indices``
    (list of int), ``node``, ``node_state`` (``up|degraded|lost``);
    ``memory_used`` and ``memory_limit`` (bytes, on all the lease's GPUs; used as the agent last saw the
    worker); ``idle_timeout`` (s), ``idle_deadline`` (ISO UTC: when the pool
    parks, or with ``on_idle`` ``"release"`` releases, the lease if it stays
    idle; None while a cell runs), ``idle_warning`` (s before that the
    notebook is warned), ``on_idle`` (``park|release``), ``preempt_at`` (ISO UTC:
    when the pool parks a preemptible lease, its running cell frozen, because
    someone waits for its GPU; attached and active only: a park done or
    withdrawn clears it); ``queue_position`` (1-based) and ``eta`` (s, rough)
    while queued, or parked with its resume waiting for room; ``reason``
    (words) for a parked lease, or why the preemption comes (with ``preempt_at``);
    ``moving_from``: the node a parked lease's state is on while its resume moves it to
    ``node`` (a move).
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)}, not {phase!r}")
    state: dict[str, Any] = dict.fromkeys(STATE_KEYS)
    state["phase"] = phase
    if lease is None:
        return state
    gpus = lease.gpus or []
    state.update(
        lease=lease.id, fraction=lease.fraction, gpu_count=lease.gpu_count,
        share=format_share(lease.fraction, lease.gpu_count, noun=True),
        gpu_model=gpus[0].get("name") if gpus else None,
        gpu_indices=[g.get("index") for g in gpus] if gpus else None,
        node=lease.node, node_state=lease.node_state, memory_limit=lease.memory * lease.gpu_count, idle_timeout=lease.idle_timeout,
        on_idle=lease.on_idle)
    if phase == "attached":
        used = (lease.worker or {}).get("memory_used")
        state.update(memory_used=used if isinstance(used, int) else None, idle_deadline=lease.idle_deadline,
                     idle_warning=lease.idle_warning,
                     preempt_at=lease.preempt_at if lease.state is LeaseState.active else None)
        if state["preempt_at"]:  # the notice's words for why: "1 person is waiting for a GPU"
            state.update(reason=preempted_for(lease))
    elif phase == "queued":
        state.update(queue_position=lease.queue_position, eta=lease.queue_estimate_s)
    elif phase == "parked":
        # queue_position: the service's place for a resume asked for and waiting for room.
        state.update(reason=(lease.parked or {}).get("reason") or lease.reason,
                     queue_position=lease.queue_position,
                     eta=lease.queue_estimate_s if lease.queue_position else None,
                     moving_from=(lease.parked or {}).get("moving_from"))
    return state


def progress_phase(lease: Lease) -> str:
    """``"queued"`` or ``"starting"`` for a new lease that is being waited for;
    ``"parked"`` for a parked lease whose resume is waited for (in line for room, parking
    still, or its worker thawing or moving), as :func:`kernel_state` says it between the
    steps: the lease is still the notebook's parked one, which a release gives up."""
    if lease.parked is not None and lease.state in RESUME_STATES:
        return "parked"
    return "queued" if lease.state in WAITING_FOR_ROOM else "starting"


class Events:
    """The open ``gpupool.status`` comms and what they were last told.
    ``notify``, ``emit`` and ``changed`` may be called from any thread (the
    heartbeat's).

    ``snapshot`` (set by the kernel): a callable returning the current
    :func:`lease_state`; ``answer`` (set by the kernel): a callable that
    answers one request's data with the reply's content (on the kernel's
    main thread, between cells: comm messages are shell messages).
    """

    def __init__(self, comm_manager: Any) -> None:
        self._lock = threading.Lock()
        self._comms: dict[str, Any] = {}
        self._state: dict[str, Any] | None = None
        self.snapshot: Callable[[], dict[str, Any]] = lambda: lease_state("detached")
        self.answer: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        comm_manager.register_target(TARGET, self._opened)

    def _opened(self, comm: Any, msg: dict[str, Any]) -> None:
        with self._lock:
            self._comms[comm.comm_id] = comm
        comm.on_close(lambda msg: self._closed(comm.comm_id))
        comm.on_msg(lambda msg: self._request(comm, msg))
        state = self._current()
        with self._lock:
            self._state = state
        self._send([comm], state_message(state))

    def _closed(self, comm_id: str) -> None:
        with self._lock:
            self._comms.pop(comm_id, None)

    def _request(self, comm: Any, msg: dict[str, Any]) -> None:
        data = msg.get("content", {}).get("data")
        if not isinstance(data, dict) or "request" not in data:
            self._send([comm], refusal(f"a {TARGET} message must be {{\"request\": KIND}} with KIND one of "
                                       f"{', '.join(REQUESTS)}, not {data!r}"))
            return
        if self.answer is None:
            reply = {"ok": False, "message": "this kernel answers no requests"}
        else:
            reply = self.answer(data)
        self._send([comm], reply_message(data, reply))
        self.changed()

    def _send(self, comms: list[Any], data: dict[str, Any]) -> None:
        for comm in comms:
            try:
                comm.send(data)
            except Exception:  # a closed front end must not lose the message for the others
                log.warning("could not send to %s comm %s", TARGET, comm.comm_id, exc_info=True)

    def _current(self) -> dict[str, Any]:
        try:
            return self.snapshot()
        except Exception:  # a state that cannot be read must not break the heartbeat or a cell
            log.warning("could not read the gpupool state", exc_info=True)
            return lease_state("detached")

    def notify(self, kind: str, message: str) -> None:
        """Send ``message`` to the listening front ends as an event, then the
        state, which such a notice usually changes. What the cells say is
        :class:`~gpupool.magics.notices.Notices`' business."""
        self.emit(kind, message)
        self.changed()

    def emit(self, kind: str, message: str, **extra: Any) -> None:
        """Send event ``kind`` to the listening front ends only (for what the
        running cell says itself); ``extra`` keys go along (``code``)."""
        with self._lock:
            comms = list(self._comms.values())
        self._send(comms, event_message(kind, message, **extra))

    def changed(self, state: dict[str, Any] | None = None) -> None:
        """Push ``state`` (default: ``snapshot()``) to the front ends if it
        differs from what they were last told."""
        state = state if state is not None else self._current()
        with self._lock:
            if state == self._state:
                return
            self._state = state
            comms = list(self._comms.values())
        self._send(comms, state_message(state))


class Requests:
    """Answers the front end's requests with the ``%gpu`` magics themselves
    (one parser, one set of words): ``gpu`` runs a ``%gpu`` line (the kernel's
    :meth:`~gpupool.magics.magics.GPUMagics.gpu`); ``lifecycle``
    (:class:`~gpupool.magics.lifecycle.Lifecycle`) holds the attachment,
    read here; ``status`` (:class:`~gpupool.magics.status.Status`) words the
    status, and ``service`` (:class:`~gpupool.magics.service.Service`) is asked for the dialog's defaults.

    What the magic prints or displays meanwhile is captured and sent in the
    reply (``output``), never into a cell's output. An acquire blocks the
    kernel's main thread until attached or refused, as the cell would (a
    queued ``--wait`` too): cells run after it.
    """

    def __init__(self, gpu: Callable[[str], Any], lifecycle: Lifecycle, status: Status, service: Service) -> None:
        self.gpu, self.lifecycle, self.status_words, self.service = gpu, lifecycle, status, service

    def __call__(self, data: dict[str, Any]) -> dict[str, Any]:
        kind = data.get("request")
        if kind == "defaults":
            return {"ok": True, "message": "", "defaults": self.defaults()}
        if kind == "acquire":
            text = data.get("text")
            if not isinstance(text, str) or not text.strip() or text.strip().startswith("--"):
                return {"ok": False, "message": f"{AMOUNT_FIELD}: say what to acquire: a fraction of one GPU (0.5) "
                                                "or a count of whole GPUs (2)"}
            refused = _form_refusal(text)
            if refused:
                return {"ok": False, "message": refused}
            attachment = self.lifecycle.attachment
            if attachment is not None and attachment.ended is None:  # a move is a cell's to do, with its output
                return {"ok": False, "message": f"already attached to {attachment.lease.id}; run %gpu release "
                                                f"first, or %gpu acquire {text.strip()} in a cell to move there"}
            line = f"acquire {text.strip()}"
        elif kind == "release":
            if not data.get("discard"):
                waiting = self.resume_waiting()
                if waiting:
                    return {"ok": False, "message": waiting}
            line = "release --discard" if data.get("discard") else "release"
        elif kind == "status":
            return self.status()
        elif kind == "resume":
            return self.resume()
        else:
            return {"ok": False, "message": f"unknown request {kind!r}; use one of: {', '.join(REQUESTS)}"}
        reply = self._run(line)
        if kind == "acquire" and not reply["ok"]:  # the service's refusal of one option names its field
            reply["message"] = field_words(reply["message"], limit=reply.pop("limit", None))
        return reply

    def _run(self, line: str) -> dict[str, Any]:
        from IPython.core.error import UsageError
        from IPython.utils.capture import capture_output

        ok, message, limit = True, "", None
        with capture_output() as captured:
            try:
                self.gpu(line)
            except UsageError as exc:
                ok, message, limit = False, str(exc), getattr(exc, "limit", None)
            except Exception as exc:  # the dialog shows it; the kernel goes on
                ok, message = False, f"{type(exc).__name__}: {exc}"
        output = _text(captured)
        reply = {"ok": ok, "message": message if not ok else output, "output": output}
        return {**reply, "limit": limit} if not ok and limit else reply

    def resume_waiting(self) -> str:
        """Why a release that brings the variables home cannot be answered now, in words: the
        parked lease's resume waits in line for room, and its variables come home only from its
        resumed worker (``%gpu release`` in a cell waits for that); "" when it can. A request must
        not hold the kernel until room comes, so it is told to discard them instead."""
        attachment = self.lifecycle.attachment
        if attachment is None or not attachment.is_parked or attachment.new_worker is not None:
            return ""
        parked = attachment.parked
        lease = attachment.catch_up() or (parked.lease if parked else None)  # not a beat old: the line moves
        if lease is None or lease.state not in WAITING_FOR_ROOM or not lease.queue_position:
            return ""
        eta = f", about {format_duration(lease.queue_estimate_s)}" if lease.queue_estimate_s is not None else ""
        return (f"{lease.id} is parked and its resume waits for room (place {lease.queue_position} in line{eta}): "
                f"its variables are frozen with its worker on {lease.node or 'its node'} and come home only after "
                "the resume. Release with discard to give the lease up now without them (%gpu release --discard), "
                "or run %gpu release in a cell to wait for the resume and bring them back")

    def resume(self) -> dict[str, Any]:
        """The user is back at the notebook: ask for a parked lease's resume
        now, without waiting (the next cell waits for what is left)."""
        attachment = self.lifecycle.attachment
        if attachment is None or not attachment.is_parked or attachment.new_worker is not None:
            return {"ok": True, "message": "not parked"}
        attachment.ask_resume()
        return {"ok": True, "message": f"resuming {attachment.lease.id}"}

    def status(self) -> dict[str, Any]:
        """``%gpu status`` for the popup: its words (``message``, ``output``)
        and, for the one lease it lists, ``details``: its cells by
        :data:`~gpupool.tables.LEASE_COLUMNS` name, which the popup shows
        beside the state's own facts, each fact once; and ``holders``: the
        names holding GPU memory on the worker (``{"columns", "rows",
        "notes"}``, or ``{"notes": [words]}`` when the worker did not say;
        None while no worker runs)."""
        from gpupool.errors import GPUPoolError
        from gpupool.tables import HOLDERS_COLUMNS, LEASE_COLUMNS, holders_rows, holders_table, lease_cells, lease_table

        try:
            words, leases, utilization, freezing, notes = self.status_words.view()
        except GPUPoolError as exc:
            return {"ok": False, "message": exc.message, "output": ""}
        text = words or "\n\n".join([lease_table(leases, utilization, freezing)[0], *notes])
        answer = None if words else self.status_words.holders_answer()
        holders = None
        if isinstance(answer, str):
            text, holders = f"{text}\n\n{answer}", {"columns": list(HOLDERS_COLUMNS), "rows": [], "notes": [answer]}
        elif answer is not None:
            rows, notes = holders_rows(answer)
            text, holders = f"{text}\n\n{holders_table(answer)[0]}", {"columns": list(HOLDERS_COLUMNS),
                                                                       "rows": rows, "notes": notes}
        details = dict(zip(LEASE_COLUMNS, lease_cells(leases[0], utilization, freezing))) if len(leases) == 1 else None
        return {"ok": True, "message": text, "output": text, "details": details, "holders": holders}

    def defaults(self) -> dict[str, Any]:
        """What the Acquire dialog starts from: ``amount`` (DIALOG_AMOUNT), the pool's
        limits for this user (``max_idle_timeout`` s, ``max_lease_gpus``; None:
        unlimited or the service did not say) and the GPU models of the pool."""
        from gpupool.errors import GPUPoolError

        found: dict[str, Any] = {"amount": DIALOG_AMOUNT, "max_idle_timeout": None,
                                 "max_lease_gpus": None, "models": []}
        try:
            limits = self.service.client.quota().get("limits", {})
            found.update(max_idle_timeout=limits.get("max_idle_timeout"), max_lease_gpus=limits.get("max_lease_gpus"))
            pool = self.service.client.pool()
            found["models"] = sorted({gpu.get("name") for node in pool.get("nodes", [])
                                      for gpu in node.get("gpus", []) if gpu.get("name")})
        except GPUPoolError as exc:
            found["error"] = exc.message
        return found


def field_words(message: str, amount: bool = False, limit: str | None = None) -> str:
    """``message`` (an acquire's error) led by the Acquire dialog's field it is
    about, as the dialog shows it: ``Idle timeout: --idle-timeout 99h is above
    ...`` for an option's words (they start with the option), ``Model: ...``
    for the pool's refusal of what a field asked (``limit``, the service's
    name of it: :data:`LIMIT_FIELDS`), ``Share or count: ...`` for the rest of
    a mistake in the line (``amount``: the amount, a word no option takes),
    else unchanged (GPU-hours used up, a full pool)."""
    for option, label in DIALOG_FIELDS.items():
        if message.startswith(option):
            return f"{label}: {message}"
    label = LIMIT_FIELDS.get(limit or "") or (AMOUNT_FIELD if amount else None)
    return f"{label}: {message}" if label else message


def _form_refusal(text: str) -> str:
    """Why ``%gpu acquire TEXT`` cannot be asked for, read as the magic reads
    it, in the dialog's words (:func:`field_words`); "" when it can. Read
    here first because only here is it known which field a mistake is in:
    ``unrecognized arguments: --bogus`` can only come from the share's field,
    since the dialog quotes any other field's value that has a space."""
    from IPython.core.error import UsageError

    from .commands import acquire_request, split_line

    try:
        acquire_request(split_line(text))
    except UsageError as exc:
        return field_words(str(exc), amount=True)
    return ""


def _text(captured: Any) -> str:
    """The words of captured output: stdout and stderr (a progress line's
    carriage returns keep only its last state), then each display's text."""
    parts = []
    for stream in (captured.stdout, captured.stderr):
        lines = [line.rsplit("\r", 1)[-1] for line in stream.split("\n")]
        parts.extend(line for line in lines if line.strip())
    for output in captured.outputs:
        text = output.data.get("text/plain") if isinstance(output.data, dict) else None
        if text:
            parts.append(text)
    return "\n".join(parts)


def kernel_state(attachment: Attachment | None) -> dict[str, Any]:
    """The :func:`lease_state` of the notebook's ``attachment`` (None:
    detached) now: its lease as the heartbeat last saw it (attached), the
    parked lease (parked), or detached (also once the lease ended behind the
    user's back)."""
    if attachment is None or (attachment.parked is None and attachment.ended is not None):
        return lease_state("detached")
    if attachment.new_worker is not None:  # resumed on a new worker: the next cell connects to it
        return lease_state("attached", attachment.new_worker)
    if attachment.parked is not None:
        return lease_state("parked", attachment.parked.lease)
    return lease_state("attached", attachment.heartbeat.last or attachment.lease)
