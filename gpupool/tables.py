"""Tables for ``%gpu status``, ``%gpu pool`` and ``gpupool status``, as text and HTML.

Pure functions: lease or pool JSON in, ``(text, html)`` out, so the same
table serves a notebook (HTML) and a terminal or the ``gpupool status``
command (text).
"""

from __future__ import annotations

import html
from datetime import datetime, timezone
from typing import Any, Sequence

from .leasewait import progress_words
from .schema import LeaseState, WorkerState, parse_time
from .wire.leases import Lease
from .units import format_bytes, format_cpus, format_duration, format_share


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> tuple[str, str]:
    """``(aligned text, HTML <table>)`` of ``rows`` under ``headers``. A cell
    without a space (an id, a node's name) is not wrapped in the HTML: a
    narrow notebook broke ``L-58b0d1600c8c`` after its hyphen."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()  # noqa: E731
    text = "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_td(c) for c in r) + "</tr>" for r in cells)
    return text, f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _td(cell: str) -> str:
    nowrap = "" if " " in cell else ' style="white-space: nowrap"'
    return f"<td{nowrap}>{html.escape(cell)}</td>"


def idle_countdown(lease: Lease, now: datetime | None = None, freezes: bool | None = None) -> str:
    """Time left before idle reclaim: ``'busy'`` while a cell runs (with the
    preemption due, if any: :func:`preempt_words`), else e.g. ``'29m 12s'``, or under pressure
    ``'1m 40s (parked early: 2 people are waiting for a GPU)'``. ``freezes``: whether the
    lease's node freezes a running cell (:func:`cell_freezing`; None: not known)."""
    worker = lease.worker or {}
    now = now or datetime.now(timezone.utc)
    if worker.get("execution_state") == WorkerState.busy:
        at = parse_time(lease.preempt_at)
        if at is not None and lease.state is LeaseState.active:  # parking, parked: no longer to come
            return f"busy; {lease.pressure}: {preempt_words((at - now).total_seconds(), freezes)}"
        return "busy (never reclaimed while a cell runs)"
    since, deadline = parse_time(lease.idle_since), parse_time(lease.idle_deadline)
    if deadline is not None:  # the service's, early under pressure
        left = format_duration(max(0.0, (deadline - now).total_seconds()))
        return f"{left} ({lease.pressure})" if lease.pressure else left
    if since is None or lease.idle_timeout is None:
        return "unknown"
    return format_duration(max(0.0, lease.idle_timeout - (now - since).total_seconds()))


def preempt_words(left: float, freezes: bool | None) -> str:
    """What a preemption due in ``left`` seconds does to the running cell, as the service does it
    (docs/api.md, "Classes and pressure"): ``'parked (frozen where it is) in 8s'`` where the node
    freezes a running cell (the resume goes on from there), ``'interrupted in 8s'`` where it
    cannot, both ways while ``freezes`` is None (not known); ``'now'`` once due (the sweep acts
    within its interval)."""
    when = "now" if left <= 0 else f"in {format_duration(left)}"
    if freezes is None:
        return f"parked {when} (frozen where it is, or interrupted where its node cannot freeze a running cell)"
    return f"parked (frozen where it is) {when}" if freezes else f"interrupted {when}"


def cell_freezing(pool: dict[str, Any]) -> dict[str, bool]:
    """Node name -> whether it freezes a running cell (``freezes_running_cell`` of ``GET /pool``;
    a node of an older service that does not say is left out: not known)."""
    return {node["name"]: node["freezes_running_cell"] for node in pool.get("nodes", [])
            if isinstance(node.get("freezes_running_cell"), bool)}


def parked_words(lease: Lease, now: datetime | None = None) -> str:
    """Where a parked (or parking) lease's state is and what resuming costs, in words:
    ``'parked in memory on node-1 for 5m (12.0 GiB of host RAM): a resume takes about 1.5s'``,
    ``'spilled to disk on node-1 (2.1 GiB to load, about 5s); not kept: generator g'``,
    ``'parking: moving its GPU state off the GPU'``, with its place in line when a resume
    waits for room. Empty for a lease that is not parked."""
    park = lease.parked
    if not park or lease.state.value not in ("parking", "parked"):
        return ""
    if lease.state.value == "parking":
        return f"parking on {lease.node}: moving its GPU state off the GPU ({park.get('reason') or 'parked'})"
    now = now or datetime.now(timezone.utc)
    since = parse_time(park.get("since"))
    held = f" for {format_duration(max(0.0, (now - since).total_seconds()))}" if since else ""
    estimate = park.get("resume_estimate_s")
    cost = f"about {format_duration(estimate) if estimate >= 1 else f'{estimate:.1f}s'}" if estimate is not None \
        else "unknown"
    if park.get("tier") == "disk":
        words = f"spilled to disk on {lease.node}{held} ({format_bytes(park.get('disk_bytes'))} to load, {cost})"
    else:
        words = (f"parked in memory on {lease.node}{held} ({format_bytes(park.get('host_bytes'))} of host RAM): "
                 f"a resume takes {cost}")
    if park.get("resume_requested"):
        place = f" (place {lease.queue_position} in line)" if lease.queue_position else ""
        elsewhere = (" or another node (there: a new worker loads its state from disk, longer than a resume in "
                     "place, and what cannot be saved to disk is lost, named)") if park.get("may_move") else ""
        words += f"; its resume waits for room on {lease.node}{elsewhere}{place}"
    if park.get("lost"):
        words += f"; not kept: {'; '.join(park['lost'])}"
    return words


def parked_for(lease: Lease | None, now: datetime | None = None) -> float | None:
    """Seconds since ``lease`` (as seen while parked) was parked; None when unknown."""
    since = parse_time(((lease.parked or {}) if lease else {}).get("since"))
    return ((now or datetime.now(timezone.utc)) - since).total_seconds() if since else None


def resumed_words(lease: Lease, seconds: float | None, parked_for: float | None,
                  parked_on: str | None = None) -> str:
    """``resumed L-1 on node-1 GPU 0 in 1.2s (parked 12m)``, what the notebook and
    ``gpupool run`` say of a resumed lease (``seconds`` None: a resume the caller did not
    wait for, ``... GPU 0 (parked 12m)``; what the park could not keep, its notice said).
    ``parked_on``: the node it was parked on; where that is another, the lease moved (a cold
    move, docs/parking.md), which the words say with what the move could not keep:
    ``...: moved from node-1, which had no room; not kept: lock: ...``."""
    gpus = ", ".join(f"GPU {gpu.get('index')}" for gpu in lease.gpus or [])
    took = f" in {seconds:.1f}s" if seconds is not None else ""
    since = f" (parked {format_duration(parked_for)})" if parked_for is not None else ""
    words = f"resumed {lease.id} on {lease.node or 'its node'}{' ' + gpus if gpus else ''}{took}{since}"
    if parked_on and lease.node and parked_on != lease.node:
        lost = _not_kept_by_resume(lease)
        words += f": moved from {parked_on}, which had no room{f'; not kept: {lost}' if lost else ''}"
    return words


def _not_kept_by_resume(lease: Lease) -> str:
    """What the lease's last resume could not keep, as its event says (``...; not kept: WORDS``)."""
    for event in reversed(lease.events or []):
        reason = str(event.get("reason") or "")
        if reason.startswith("resumed on "):
            return reason.partition("; not kept: ")[2]
    return ""


def host_parts(lease: Lease, memory_noun: str = "") -> tuple[str, str, bool] | None:
    """``('4 CPUs', '32.0 GiB' + memory_noun, False)``: the host the lease
    holds on its node; where the worker's cgroup limit differs from what is
    reserved (a default share raised to the agent's floor) a part reads
    ``'0.5 CPU reserved, limited to 1 CPU'`` and the flag is True. None
    while the lease holds no host (queued, or a node that reports none)."""
    if lease.cpus is None or lease.host_memory is None:
        return None
    cpus, memory, limited = format_cpus(lease.cpus), format_bytes(lease.host_memory) + memory_noun, False
    if lease.cpu_limit is not None and abs(lease.cpu_limit - lease.cpus) > 1e-9:
        cpus, limited = f"{cpus} reserved, limited to {format_cpus(lease.cpu_limit)}", True
    if lease.host_memory_limit is not None and lease.host_memory_limit != lease.host_memory:
        memory, limited = f"{memory} reserved, limited to {format_bytes(lease.host_memory_limit)}", True
    return cpus, memory, limited


def memory_words(lease: Lease) -> str:
    """The GPU memory ``lease`` may use: ``'20.0 GiB'``; ``'2 x 80.0 GiB'`` on two GPUs (the
    limit is per GPU: said so, like :func:`share_words`' ``'2 x A100'``, wherever a person sees
    it: the attach and ``gpupool run`` lines, the status tables)."""
    return (f"{lease.gpu_count} x " if lease.gpu_count > 1 else "") + format_bytes(lease.memory)


def host_words(lease: Lease) -> str:
    """``', 4 CPUs and 32.0 GiB of host memory'`` (``1 CPU``); where the worker's
    cgroup is limited to more than is reserved (a default share raised to the
    agent's floor) ``', 0.5 CPU reserved, limited to 1 CPU, 512.0 MiB of host
    memory reserved, limited to 1.0 GiB'``; empty when the node reports no host."""
    parts = host_parts(lease, " of host memory")
    if parts is None:
        return ""
    cpus, memory, limited = parts
    return f", {cpus}{', ' if limited else ' and '}{memory}"


def slice_words(lease: Lease) -> str:
    """What ``lease`` holds, in words: ``'0.50 of NVIDIA A100-SXM4-80GB (GPU 0) on node-1'``,
    ``'2 x NVIDIA A100-SXM4-80GB (GPU 0, 1) on node-1 in environment torch'``."""
    indices = ", ".join(str(g.get("index", "?")) for g in lease.gpus) or "?"
    env = f" in environment {lease.env}" if lease.env else ""
    return f"{share_words(lease)} (GPU {indices}) on {lease.node}{env}"


def share_words(lease: Lease) -> str:
    """The share ``lease`` holds of its GPU model: ``'0.50 of NVIDIA A100-SXM4-80GB'``,
    ``'2 x NVIDIA A100-SXM4-80GB'``."""
    name = (lease.gpus[0] if lease.gpus else {}).get("name", "GPU")
    return f"{format_share(lease.fraction)} of {name}" if lease.gpu_count == 1 else f"{lease.gpu_count} x {name}"


def usage_words(gpu_seconds: float) -> str:
    """``'42.0 GPU-seconds'`` below six minutes, else ``'1.25 GPU-hours'``."""
    return f"{gpu_seconds:.1f} GPU-seconds" if gpu_seconds < 360 else f"{gpu_seconds / 3600:.2f} GPU-hours"


def held_seconds(lease: Lease) -> float | None:
    """Seconds from the lease's start to its end, None while either is unknown."""
    start, end = parse_time(lease.started_at), parse_time(lease.ended_at)
    return (end - start).total_seconds() if start and end else None


def released_words(lease: Lease) -> str:
    """``'released L-7 after 2m 10s (65.0 GPU-seconds)'`` for a lease that ended."""
    return (f"released {lease.id} after {format_duration(held_seconds(lease))} "
            f"({usage_words(lease.usage_gpu_seconds)})")


def lease_host_cell(lease: Lease) -> str:
    """The host column: ``'4 CPUs, 32.0 GiB'``, ``'0.5 CPU reserved, limited to
    1 CPU; 512.0 MiB reserved, limited to 1.0 GiB'``, or ``-``."""
    parts = host_parts(lease)
    if parts is None:
        return "-"
    cpus, memory, limited = parts
    return f"{cpus}{'; ' if limited else ', '}{memory}"


#: The columns of :func:`lease_table`, in order.
LEASE_COLUMNS = ("lease", "state", "node", "environment", "GPU", "share", "class", "memory used / limit", "host",
                 "GPU util", "worker", "idle deadline in / reason")


def lease_table(leases: Sequence[Lease], utilization: dict[str, float | None] | None = None,
                freezing: dict[str, bool] | None = None, *, owners: bool = False) -> tuple[str, str]:
    """One row per lease (:data:`LEASE_COLUMNS`, :func:`lease_cells`); ``owners``: an ``owner``
    column first (an admin's listing of every user's leases)."""
    rows = [lease_cells(lease, utilization, freezing) for lease in leases]
    if owners:
        return table(["owner", *LEASE_COLUMNS], [[lease.owner, *row] for lease, row in zip(leases, rows)])
    return table(list(LEASE_COLUMNS), rows)


def lease_cells(lease: Lease, utilization: dict[str, float | None] | None = None,
                freezing: dict[str, bool] | None = None) -> list[str]:
    """One lease's cells of :data:`LEASE_COLUMNS`: id, state, node, worker
    environment (``-`` while unknown: queued without one asked for, or a node
    that reports none), GPU, share, class, memory used / limit (``-`` while
    queued), host CPUs and memory (:func:`lease_host_cell`; ``-`` once it ended), GPU utilization
    (``utilization`` maps GPU UUID -> percent, from ``GET /pool``; the whole
    GPU's, shared by its leases), worker state, idle countdown (``freezing``: node ->
    whether it freezes a running cell, :func:`cell_freezing`, for a preemption's words), where a
    parked lease's state is (:func:`parked_words`), and the reason once it
    ended (a queued one's place in line). Unknown readings say ``unknown``, never 0."""
    gpus = ", ".join(f"{g.get('index')}: {g.get('name')}" for g in lease.gpus) or "-"
    share = format_share(lease.fraction, lease.gpu_count)
    kind = lease.lease_class + (", preemptible" if lease.preemptible else "")
    live = lease.state.value == "active"
    worker = lease.worker or {}
    # Used is the worker's on all its GPUs, against the limit on each: '1.0 GiB / 2 x 80.0 GiB'.
    used = format_bytes(worker.get("memory_used")) if live else "-"
    memory = f"{used} / {memory_words(lease)}" if lease.memory else "-"  # queued: 0
    utils = [(utilization or {}).get(g.get("uuid")) for g in lease.gpus]
    util = ", ".join("unknown" if u is None else f"{u:.0f}%" for u in utils) if live and utils else "-"
    host = lease_host_cell(lease) if not lease.state.ended else "-"
    state = worker.get("execution_state", "-") if live else "-"
    return [lease.id, lease.state.value, lease.node or "-", lease.env or "-", gpus, share, kind, memory, host, util,
            state, idle_countdown(lease, freezes=(freezing or {}).get(lease.node or "")) if live
            else _not_live_words(lease)]


def _not_live_words(lease: Lease) -> str:
    """The last column of a lease that is not active: its place in line while queued
    (``'queued: 2nd in line, about 5m'``), where a parked one's state is, or why it ended."""
    if lease.state is LeaseState.queued:
        return progress_words(lease)
    return parked_words(lease) or lease.reason or "-"


def gpu_utilization(pool: dict[str, Any]) -> dict[str, float | None]:
    """GPU UUID -> utilization percent (None when unknown) from ``GET /pool``."""
    return {gpu["uuid"]: gpu.get("utilization") for node in pool.get("nodes", []) for gpu in node.get("gpus", [])}


def pool_table(pool: dict[str, Any]) -> tuple[str, str]:
    """One row per GPU of ``GET /pool`` (a node that lists none gets one row
    with GPU ``-``): node, state, enforcement, host (its CPU cores and
    memory, as its agent reports them), GPU, memory, allocated share and
    leases (each with what parked leases claim there apart,
    :func:`allocated_cell`); then, for each node that is not ``up``, a line
    saying why (its ``state_reason``) and what that means for leases, and for
    each node holding parked leases what they hold there (:func:`parked_note`);
    then, when some node offers a choice of worker environments,
    :func:`environment_table`."""
    rows, notes = [], []
    for node in pool.get("nodes", []):
        state = node.get("state", "?")
        if state != "up":
            notes.append(node_note(node["name"], state, node.get("state_reason")))
        if node.get("parked_leases"):
            notes.append(parked_note(node))
        for gpu in node.get("gpus") or [None]:
            cells = ["-", "-", "0.00", 0] if gpu is None else [
                f"{gpu['index']}: {gpu['name']}", format_bytes(gpu.get("memory_total")), allocated_cell(gpu),
                leases_cell(gpu)]
            rows.append([node["name"], state, node.get("enforcement") or "-", host_cell(node), *cells])
    text, markup = table(["node", "state", "enforcement", "host", "GPU", "memory", "allocated", "leases"], rows)
    if notes:
        text += "\n\n" + "\n".join(notes)
        markup += "".join(f"<p>{html.escape(note)}</p>" for note in notes)
    if _offers_a_choice(pool):  # then %gpu pool and gpupool pool list the environments a lease may name
        env_text, env_markup = environment_table(pool)
        text, markup = f"{text}\n\n{env_text}", markup + env_markup
    return text, markup


def allocated_cell(gpu: dict[str, Any]) -> str:
    """A GPU's allocated share of ``GET /pool``, with the share its parked leases claim apart:
    ``'0.50'``, ``'0.00 + 0.25 parked'`` (a parked lease holds no share; its claim keeps the room
    for its resume while other room fits). A claim other leases took (``parked_unbacked``: they were
    placed when no other room fit) is no room on the GPU, so it is not added to what is allocated:
    ``'1.00 (0.50 parked, not free now)'``, ``'0.75 + 0.25 parked (0.25 more parked, not free now)'``."""
    claim, unbacked = gpu.get("parked_fraction") or 0.0, gpu.get("parked_unbacked") or 0.0
    words = f"{gpu.get('allocated_fraction', 0):.2f}"
    if claim - unbacked > 0.005:  # what shows as 0.00 is no free claim
        words += f" + {claim - unbacked:.2f} parked"
    if unbacked > 0.005:
        more = " more" if claim - unbacked > 0.005 else ""
        words += f" ({unbacked:.2f}{more} parked, not free now)"
    return words


def leases_cell(gpu: dict[str, Any]) -> str | int:
    """A GPU's leases of ``GET /pool``: those holding a share, then its parked ones (``'0 + 1 parked'``)."""
    if gpu.get("parked_leases"):
        return f"{gpu.get('leases', 0)} + {gpu['parked_leases']} parked"
    return gpu.get("leases", 0)


def host_cell(node: dict[str, Any]) -> str:
    """``'16 CPUs, 64.0 GiB'`` for a node of ``GET /pool``; ``-`` when its agent reports neither (an older one)."""
    cpus, memory = node.get("host_cpus"), node.get("host_memory")
    if not cpus and not memory:
        return "-"
    return f"{format_cpus(cpus) if cpus else '? CPUs'}, {format_bytes(memory) if memory else '? memory'}"


def _offers_a_choice(pool: dict[str, Any]) -> bool:
    """Whether a node reports more than its one default environment, or one it cannot use."""
    return any(len(envs) > 1 or not all(e.get("usable") for e in envs)
               for envs in (node.get("environments") or [] for node in pool.get("nodes", [])) if envs)


def parked_note(node: dict[str, Any]) -> str:
    """``'node-1 holds 2 parked leases: 12.0 GiB of host RAM (budget 64.0 GiB; checkpointer simulated)'``."""
    count = node.get("parked_leases", 0)
    budget = node.get("parked_memory")
    extra = [f"budget {format_bytes(budget)}"] if budget is not None else []
    extra += [f"checkpointer {node['checkpointer']}"] if node.get("checkpointer") else []
    held = format_bytes(node.get("parked_host_bytes", 0))
    return (f"{node['name']} holds {count} parked lease{'s' if count != 1 else ''}: {held} of host RAM"
            + (f" ({'; '.join(extra)})" if extra else ""))


def node_note(name: str, state: str, reason: str | None) -> str:
    """Words for a node that is not ``up``, e.g. ``'node-1 is degraded: NVML could
    not start (...); its leases go on, nothing new is placed there'``."""
    if state == "degraded":
        return (f"{name} is degraded: {reason or 'its agent cannot read its GPUs'}; "
                "its leases go on, nothing new is placed there")
    if state == "lost":
        return (f"{name} is lost: {reason or 'no heartbeat from its agent'}; nothing new is placed there, "
                "and cells of its leases may not answer until it is back")
    return f"{name} is {state}: {reason or 'no reason given'}"


def environment_table(pool: dict[str, Any]) -> tuple[str, str]:
    """One row per worker environment of each node of ``GET /pool`` (a node's
    ``environments``: ``[{"name", "python", "default", "usable", "problem"}]``, as
    its agent reported them at registration): node, name, whether it is the
    node's default (``yes``), the Python, and whether leases may name it (else why not). ``("", "")`` when no
    node reports any (agents before environments, or a service that does not pass
    them on)."""
    rows = []
    for node in pool.get("nodes", []):
        for env in node.get("environments") or []:
            usable = "yes" if env.get("usable") else f"no: {env.get('problem') or 'unknown'}"
            rows.append([node["name"], env.get("name", "?"), "yes" if env.get("default") else "",
                         env.get("python", "?"), usable])
    if not rows:
        return "", ""
    return table(["node", "environment", "default", "python", "usable"], rows)


#: The columns of :func:`holders_rows`.
HOLDERS_COLUMNS = ("holds GPU memory", "size", "on", "type")


def holders_rows(answer: dict[str, Any]) -> tuple[list[list[str]], list[str]]:
    """A ``gpu_memory`` answer's rows (:data:`HOLDERS_COLUMNS`, cells as
    words) and notes (``and 3 more, 1.0 GiB``; the walk looked in part)."""
    holders, more = answer.get("holders") or [], answer.get("more") or {}
    notes = []
    if more.get("count"):
        notes.append(f"and {more['count']} more, {format_bytes(more.get('bytes', 0))}")
    if answer.get("complete") is False:
        notes.append("(looked at in part: the worker stops at large containers and after about a second)")
    rows = [[h["name"], _held_cell(h), ", ".join(h.get("devices") or []) or "-", h.get("type", "")] for h in holders]
    return rows, notes


def holders_table(answer: dict[str, Any]) -> tuple[str, str]:
    """What a worker's ``gpu_memory`` op answered (the names holding GPU
    memory, largest first), as a table: name, GPU memory (bytes it alone
    holds; ``in x`` for one whose every allocation ``x`` counts), device,
    type; then ``and 3 more, 1.0 GiB``, and a note when the worker's bounded
    walk looked at some values in part. One line when no name holds any."""
    rows, notes = holders_rows(answer)
    if not rows:
        text = "no names hold GPU memory on the worker" + (f" {notes[-1]}" if answer.get("complete") is False else "")
        return text, f"<p>{html.escape(text)}</p>"
    text, markup = table(list(HOLDERS_COLUMNS), rows)
    if notes:
        text += "\n" + "\n".join(notes)
        markup += "".join(f"<p>{html.escape(note)}</p>" for note in notes)
    return text, markup


def _held_cell(holder: dict[str, Any]) -> str:
    """``'64.0 MiB'``, ``'16.0 MiB, and x's'`` (it holds x's too), ``'in x'`` (only what x counts)."""
    shares = holder.get("shares") or []
    if not holder.get("bytes"):
        return f"in {', '.join(shares)}" if shares else "0 B"
    return format_bytes(holder["bytes"]) + (", and " + ", ".join(f"{name}'s" for name in shares) if shares else "")
