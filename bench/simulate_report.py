"""Run the trace-driven comparisons and write the "Trace-driven simulation" section of bench/REPORT.md.

    .venv/bin/python bench/simulate_report.py [--data ../shared/data] [--seed 0]
        [--only notebooks|backlog|openb-multidim|eta] [--hours H] [--pool-size N]

Writes bench/REPORT.md (only its "## Trace-driven simulation" section is
replaced; other sections are kept) and bench/sim_*.png. Without the public
traces in ``--data`` it runs on generated ones (:mod:`gpupool.hub_plugin.simulate.synthetic`).
Takes tens of minutes on two cores, the backlog's month about 14 of them (``--only`` redoes one part). Needs matplotlib (the ``examples``
extra). Every number comes from :mod:`gpupool.hub_plugin.simulator` and its
modules, i.e. from the real ``place()`` and ``reclaim.decide()`` and the
service's class and pressure rules (:mod:`gpupool.hub_plugin.priority`), and the
simulator's own pure rules (:mod:`gpupool.hub_plugin.simulate.estimates`,
:mod:`gpupool.hub_plugin.simulate.multidim`).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from gpupool.hub_plugin.simulate import multidim  # noqa: E402
from gpupool.hub_plugin.simulate.backlog import BatchSource  # noqa: E402
from gpupool.hub_plugin.simulate.notebooks import simulate_notebooks  # noqa: E402
from gpupool.hub_plugin.simulate.openb import OPENB_POLICIES, fill, openb_specs, sample_tasks  # noqa: E402
from gpupool.hub_plugin.simulate import costs  # noqa: E402
from gpupool.hub_plugin.simulate.policies import (IDLE_TIMEOUT_S, PREEMPTION_NOTICE_S, PRESSURE_GRACE_S,  # noqa: E402
                                                  dedicated_gpus, policies)
from gpupool.hub_plugin.simulate.pool import SimulatedPool  # noqa: E402
from gpupool.hub_plugin.simulate.results import HEADERS, NotebookResult, resumes, rows  # noqa: E402
from gpupool.hub_plugin.simulate.synthetic import openb_tables, sensei_rows, slice_millis  # noqa: E402
from gpupool.hub_plugin.simulate.traces import read_openb, read_openb_tasks, sensei_workload  # noqa: E402
from gpupool.hub_plugin.simulate.workload import NotebookWorkload, build_sessions  # noqa: E402
from report import write_section  # noqa: E402  (bench/ is on the path when a bench runs)

HERE = Path(__file__).resolve().parent
SECTION = "## Trace-driven simulation"
TARGET_WAIT_S = 10.0
OPENB_SEEDS = (0, 1, 2)
ETA_POOL = 320  # GPUs: gpupool waits here, so ETAs can be checked
BACKLOG_POOL = 336  # GPUs of the backlog part: gpupool's size for the notebook month without park costs


def md_table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def needed(workload, policy, guess: int, log, *, step: int = 8, lo: int = 64, hi: int = 2048):
    """The smallest pool (a multiple of ``step``) where ``policy`` keeps p95 interactive wait <= 10 s, and
    the result there (None: not within ``hi`` GPUs): bracket from ``guess`` (down by 32 GPUs, up by
    doubling), then halve (p95 falls as the pool grows)."""
    cache = {}

    def ok(size):
        if size not in cache:
            cache[size] = simulate_notebooks(workload, policy, size)
            log(f"  {policy.name} {size}: p95 {cache[size].wait_percentile(95):g} s")
        return cache[size].wait_percentile(95) <= TARGET_WAIT_S

    size = guess
    if ok(size):
        while size - 32 >= lo and ok(size - 32):
            size -= 32
        bad, good = size - 32, size
    else:
        bad = size
        while size < hi and not ok(size):
            bad, size = size, min(hi, size * 2)
        if not ok(size):
            return None, cache
        good = size
    while good - bad > step:
        mid = (bad + good) // 2 // step * step
        bad, good = (bad, mid) if ok(mid) else (mid, good)
    return cache[good], cache


def dedicated_result(workload, users: int):
    owned = dedicated_gpus(workload)
    period = max(86400.0, np.ceil(max(c.submit for c in workload.cells) / 86400) * 86400)
    size = sum(owned.values())
    busy = workload.busy_gpu_hours()
    return NotebookResult("dedicated", size, size * period / 3600, busy, np.zeros(len(workload.cells)), 0, size,
                          {}, 0.0, period, users, busy_in_period_gpu_hours=busy)


def sensei_part(workload, data_words: str, log) -> tuple[str, dict, dict]:
    chosen = policies()
    best, sweeps = {}, {}
    for name, guess in (("gpupool", 352), ("reservation", 416), ("batch", 352)):
        log(f"sensei: GPUs needed, {name}")
        best[name], sweeps[name] = needed(workload, chosen[name], guess, log)
    dedicated = dedicated_result(workload, 100)
    table_rows = [r for r in (dedicated, best["reservation"], best["gpupool"], best["batch"]) if r is not None]
    gp = best["gpupool"]
    plot = plot_sweeps(sweeps, dedicated)
    parking_text = parking_part(workload, dedicated, gp, log)
    text = [
        "### Notebooks alone: the sensei month",
        "",
        f"Workload: {data_words} {len(workload.cells):,} cells, {len(workload.sessions):,} sessions. Session rule "
        f"(the trace has no session or user ids; ours, seeded): {workload.rule}. CPU-only cells appear as 1-GPU "
        "cells in the trace and are simulated as needing their slice. Users and groups are synthetic.",
        "",
        "Policies: **dedicated** (what pooling replaces): each user owns, for the whole month, the most GPUs their "
        "cells ever run at once (a slice is a card of its own), nobody waits; **reservation** (today's service "
        "with its idle cull): `num_gpu` whole GPUs from a notebook's first cell until 30 min idle; **gpupool**, "
        f"the service's default rules (`c.PoolLeases.idle_timeout` {IDLE_TIMEOUT_S / 60:g} min, "
        f"`c.PoolPressure.pressure_grace` {PRESSURE_GRACE_S:g} s, `preemption_notice` {PREEMPTION_NOTICE_S:g} s): the slice (1-GPU) or whole GPUs "
        "(4/8) until its idle timeout, parked early while anyone waits by the service's rule (`priority.plan`: "
        "the grace after the request pressing on it was asked, or after it went idle, whichever is later; no "
        "guaranteed shares); a park **parks in place** and the next cell resumes it on its own node "
        "(`rules/resume.py: place`) or, when that node has no room, on another with room (a move: "
        "`c.PoolLeases.resume_moves`, on by default), with its costs (below), its share claimed on its node "
        "meanwhile (new leases go elsewhere while room fits: `scheduler.claimed`); **batch**: each cell a job holding "
        "whole GPUs only while it runs, strict FIFO. Every placement is `scheduler.place()`, every idle reclaim "
        "`reclaim.decide()` at the 5 s sweep ticks. Nodes of 8 GPUs. Wait = cell start (after its resume) − "
        "trace submit (trace resolution 1 min; a new lease's worker start not modelled). GPU-h held = Σ fraction × "
        "GPUs × hours leased (a park's share until its state is off the GPU); busy = what running cells need × "
        "hours run; **cluster util** = busy GPU-h in the month / (pool GPUs × 720 h); held util = busy / held. "
        "Parks: idle leases parked while the notebook stays open (each costs the user a resume), per "
        "user-day (100 users × 30 days); **resume**: what a resume cost the interactive cell that asked for it, "
        "p50/p95/p99 seconds (part of its wait).",
        "",
        COSTS_WORDS,
        "",
        "**Each policy at the smallest pool (multiple of 8) with interactive p95 wait ≤ 10 s"
        + ("" if gp else "; gpupool reaches it at no pool size up to 2,048 GPUs") + ":**",
        "",
        md_table(HEADERS, rows(table_rows)),
        "",
        notebook_target_words(gp, best["reservation"], dedicated, sweeps["gpupool"]),
        "",
        f"![p95 wait by pool size]({plot})",
        "",
        parking_text,
    ]
    return "\n".join(text), {"best": {k: v.row() if v else None for k, v in best.items()}, "dedicated": dedicated.row()}, best


COSTS_WORDS = (
    "Park-in-place costs (`hub_plugin/simulate/costs.py`, where each figure comes from): a warm park or resume "
    f"(frozen in its node's RAM) is {costs.WARM_PARK_S * 1000:g} / {costs.WARM_RESUME_S * 1000:g} ms (freeze or "
    "thaw, bench/park_results.json at 1 MiB) plus the GPU state over each GPU's pinned host link at "
    f"{costs.HOST_TO_GPU_BYTES_S / 1e9:g} GB/s (the service's `rules/resume.py` estimate; PCIe 4 runs 20+); a "
    f"spilled resume starts a new worker ({costs.COLD_START_S:g} s) and loads the namespace from the node's disk at "
    f"{costs.DISK_BYTES_S / 1e9:g} GB/s; a move to another node (when its own has no room: "
    "`c.PoolLeases.resume_moves`) is a new worker plus the state: from RAM worker to worker over a "
    f"{costs.NETWORK_BYTES_S * 8 / 1e9:g} Gbit/s network, from a spill at the slower of disk and network. Each node parks up to `c.AgentParking.parked_memory`'s default, a quarter of its RAM "
    f"({costs.parked_budget() / 2**30:,.0f} GiB of {costs.NODE_HOST_BYTES / 2**40:g} TiB, an 8 × A100 80 GB "
    "server's); past it the longest-parked spill to disk. A session's parked state is an **assumption** (no trace "
    f"records GPU memory per notebook): its slice's memory × a fill drawn per session, uniform in "
    f"[{costs.FILL_LOW:g}, 1], so a full 80 GB GPU resumes warm in 8 s and an 8-GPU notebook's 640 GB spills "
    "at once (over the budget alone). Not modelled: the JupyterLab extension's early resume when the user comes "
    "back (a resume starts at the cell), parked host memory in the placement of new leases.")


def notebook_target_words(gp, reservation, dedicated, sweep) -> str:
    """The notebook month's target (GPUs ≤ 0.15 × dedicated at p95 ≤ 10 s), in words."""
    limit = 0.15 * dedicated.pool_size
    res = (f"reservation {reservation.pool_size} ({reservation.pool_size / dedicated.pool_size:.2f} ×)"
           if reservation else "reservation: not reached either")
    if gp is None:
        sizes = sorted(sweep)
        tried = ", ".join(f"{s}: {sweep[s].wait_percentile(95):,.0f} s" for s in sizes)
        return (f"- Target, GPUs needed ≤ 0.15 × the dedicated baseline ({limit:.0f} of {dedicated.pool_size}) at "
                f"p95 ≤ 10 s, with the service's default rules: **not met**: gpupool's p95 by pool size {tried}; "
                f"{res}. Why, and what would reach it: the next table.")
    ratio = gp.pool_size / dedicated.pool_size
    return (f"- Target, GPUs needed ≤ 0.15 × the dedicated baseline at p95 ≤ 10 s, with the service's default "
            f"rules: **{'met' if ratio <= 0.15 else 'not met'}**: gpupool needs {gp.pool_size} GPUs, dedicated "
            f"{dedicated.pool_size} ({ratio:.2f} ×); {res}. Dedicated cards are "
            f"{dedicated.cluster_utilization:.1%} busy; gpupool's pool {gp.cluster_utilization:.1%}.")


#: The pool sizes the park-in-place sensitivity runs at.
PARKING_SIZES = (336,)


def parking_variants():
    """gpupool's rules with one change each, for the park-in-place sensitivity table."""
    base = policies()["gpupool"]
    five = replace(policies(300.0)["gpupool"], name="… 5 min idle timeout")
    waits = "a resume waits for its own node (`resume_moves` off)"
    return [base, replace(base, name=f"… {waits}", resume_moves=False),
            replace(base, name="… parked leases claim no room (placement ignores them)", parked_claims=False),
            replace(base, name="… costs not modelled (a park releases, the next cell goes anywhere)",
                    park_in_place=False),
            five, replace(policies(60.0)["gpupool"], name="… 1 min idle timeout"),
            replace(five, name="… 5 min, costs not modelled", park_in_place=False),
            replace(five, name=f"… 5 min, {waits}", resume_moves=False),
            replace(five, name="… 5 min, states 10 % of the slice", state_fill=0.1),
            replace(base, name="… states 10 % of the slice", state_fill=0.1)]


def parking_part(workload, dedicated, gp, log) -> str:
    """What parking in place costs the notebook month, and which of its rules the p95 rests on."""
    lines, by_name = [], {}
    for size in PARKING_SIZES:
        for policy in parking_variants():
            r = by_name[policy.name] = simulate_notebooks(workload, policy, size)
            log(f"parking {policy.name} {size}: p95 {r.wait_percentile(95):g} s ({r.seconds:.0f} s)")
            tiers = "/".join(f"{r.resumes.get(t, 0):,}" for t in ("memory", "disk", "moved"))
            lines.append([policy.name, size, f"{(policy.idle_timeout or 0) / 60:g} min",
                          "/".join(f"{r.wait_percentile(q):,.0f}" for q in (50, 95, 99)),
                          f"{np.mean(r.waits > TARGET_WAIT_S):.1%}",
                          resumes(r), tiers, f"{r.spills:,}", f"{r.held_gpu_hours:,.0f}",
                          f"{r.per_user_day(r.parks):.2f}"])
    return "\n".join([
        f"**What parking in place costs the month** (gpupool, {', '.join(map(str, PARKING_SIZES))} GPUs; "
        f"{0.15 * dedicated.pool_size:.0f} would be 0.15 × dedicated), one rule changed per row:",
        "",
        md_table(["gpupool", "GPUs", "idle timeout", "int. p50/p95/p99 s", "int. cells waiting > 10 s",
                  "resume p50/p95/p99 s", "resumes memory/disk/moved", "spills", "GPU-h held", "parks /user-day"],
                 lines),
        "",
        parking_why(list(by_name.values()), gp, 0.15 * dedicated.pool_size),
        ""])


def slow_resumes(result) -> str:
    """How many interactive cells a resume alone cost over 10 s, in words (under 5 % may wait that long)."""
    slow = int(np.sum(result.resume_waits > TARGET_WAIT_S))
    return (f"a resume alone cost {slow:,} interactive cells over 10 s, {slow / len(result.waits):.1%} of them, "
            "where under 5 % may wait that long")


def parking_why(results, gp, limit: float) -> str:
    """What the park-in-place table shows, in words, from its rows (:func:`parking_variants`' order), with
    ``gp`` gpupool's result at its smallest pool above (None: not reached) and ``limit`` 0.15 × dedicated."""
    base, waits, unclaimed, free, five, one, five_free, five_waits, five_small, small = results
    p95 = lambda r: f"{r.wait_percentile(95):,.0f} s"  # noqa: E731
    moved = lambda r: f"{r.resumes.get('moved', 0):,}"  # noqa: E731
    size = base.pool_size
    needs = (f"gpupool needs {gp.pool_size} GPUs at p95 ≤ 10 s, above" if gp else
             "gpupool reaches p95 ≤ 10 s at no pool size tried, above")
    if gp is not None and gp.pool_size <= limit:
        closing = f"- So the 0.15 × target is reached: gpupool needs {gp.pool_size} GPUs at p95 ≤ 10 s (above)."
    else:
        closing = (
            f"- So the 0.15 × target is not reached ({needs}): a resume no longer waits for a taken node while "
            "another has room, but a big state still takes minutes to come back (from disk after a spill, at "
            "the network's rate on a move), and a 30 min idle timeout "
            f"holds GPUs that a tighter pool needs: even with parks that cost nothing, {size} GPUs give {p95(free)} "
            f"at 30 min and {p95(five_free)} at 5 min. Reaching it needs both a shorter idle timeout and resumes "
            "of big states in seconds, not minutes: a faster network than "
            f"{costs.NETWORK_BYTES_S * 8 / 1e9:g} Gbit/s for moves (built: worker to worker from RAM), the JupyterLab "
            "extension's early resume when the user comes back (not modelled: it would start the resume before "
            "the cell), and figures for real notebooks' GPU memory, which no trace gives.")
    return "\n".join([
        f"- A parked lease resumes on its own node when that node has room (its worker lives there, frozen in "
        "RAM or spilled to its disk), else on another node with room (`c.PoolLeases.resume_moves`, on by "
        "default): a move, a new worker there taking the state, worker to worker from RAM (by disk when it "
        "was spilled). The defaults give "
        f"{p95(base)} p95 here, {moved(base)} of the {sum(base.resumes.values()):,} resumes moved. A resume that "
        f"waits for its own node instead (`resume_moves` off, the service's rule before): {p95(waits)}; at this "
        "size new leases must take a parked lease's claimed room, and the resume then waits for that one node "
        "(running cells of hours, idle leases until their grace) however idle the rest of the pool is. With a "
        f"5 min idle timeout, {p95(five)} with moves and {p95(five_waits)} without (more parks, so more resumes "
        "find their node taken).",
        "- Placement keeps a parked lease's share claimed on its node (`scheduler.claimed`): a new lease goes to "
        f"other room while any fits. A resume whose room was taken now moves instead of waiting, so the claims "
        f"spare moves ({moved(base)} with them, {moved(unclaimed)} without) rather than waits (p95 {p95(base)} "
        f"with them, {p95(unclaimed)} without).",
        f"- Most of what is left is the resumes' own cost: resume p50/p95 {base.resume_percentile(50):.1f} / "
        f"{base.resume_percentile(95):,.0f} s; {slow_resumes(base)}. A state moved from RAM goes worker to worker at the network's "
        f"{costs.NETWORK_BYTES_S / 1e9:.1f} GB/s, a spilled one by disk at {costs.DISK_BYTES_S / 1e9:g} GB/s "
        f"({base.resumes.get('memory', 0):,} resumes from RAM, {base.resumes.get('disk', 0):,} "
        f"from the node's disk, {moved(base)} moved): a full 80 GB GPU's state takes "
        f"{costs.move_seconds(80 * 10**9, False):.0f} s from RAM ({costs.move_seconds(80 * 10**9, True):.0f} s "
        f"spilled), an 8-GPU notebook's (up to 640 GB) up to {costs.move_seconds(640 * 10**9, False) / 60:.1f} "
        f"min ({costs.move_seconds(640 * 10**9, True) / 60:.0f} min). With costs not modelled (a park releases, the next "
        f"cell goes anywhere): {p95(free)}, with a 5 min idle timeout {p95(five_free)}; with states a tenth of "
        f"their slice {p95(small)}, at 5 min {p95(five_small)} (resume p95 {small.resume_percentile(95):.0f} s). "
        f"A shorter idle timeout frees GPUs sooner: 5 min {p95(five)}, 1 min {p95(one)}, against 30 min "
        f"{p95(base)}. At 5 min, {five.spills:,} spills for {five.parks:,} parks: notebooks stay parked for the "
        "rest of their 8 h session, and their states fill the node's quarter of RAM.",
        closing])


def users_part(data, seed, best100, log) -> str:
    if best100["gpupool"] is None:
        return ("**Sensitivity to the number of users**: not rerun: with the service's default rules gpupool "
                "meets p95 ≤ 10 s at no pool size for 100 users (above), so there is no pool size to compare.\n")
    lines = []
    for n in (30, 100, 300):
        workload = load_sensei(data, seed, n)
        if n == 100:  # the main case, searched in steps of 8 above
            gp, res = best100["gpupool"], best100["reservation"]
        else:
            gp, _ = needed(workload, policies()["gpupool"], 352, log, step=16)
            res, _ = needed(workload, policies()["reservation"], 416, log, step=16)
        ded = dedicated_result(workload, n)
        lines.append([n, f"{len(workload.sessions):,}", ded.pool_size, res.pool_size, gp.pool_size,
                      f"{gp.pool_size / ded.pool_size:.2f}", f"{gp.cluster_utilization:.1%}",
                      f"{gp.per_user_day(gp.parks):.2f}"])
        log(f"users={n} done")
    return "\n".join([
        "**Sensitivity to the number of users** (Zipf s = 1, seed 0; pools searched in steps of 16 GPUs for 30 "
        "and 300 users, 8 for 100): "
        "pooling's gain grows with the number of users, since each dedicated user must own their own peak.",
        "",
        md_table(["users", "sessions", "dedicated GPUs", "reservation GPUs", "gpupool GPUs", "gpupool / dedicated",
                  "gpupool cluster util", "parks /user-day"], lines),
        ""])


def eta_part(workload, log) -> str:
    result = simulate_notebooks(workload, policies()["gpupool"], ETA_POOL, with_eta=True)
    log("eta done")
    errors = [(p, o, a) for p, o, a in result.eta_errors]
    new = np.array([abs(p - a) for p, _, a in errors if p is not None])
    old = np.array([abs(o - a) for _, o, a in errors if o is not None])
    unknown = sum(1 for p, _, _ in errors if p is None)
    within = np.mean([abs(p - a) <= max(30.0, 0.5 * a) for p, _, a in errors if p is not None])
    within_old = np.mean([abs(o - a) <= max(30.0, 0.5 * a) for _, o, a in errors if o is not None])
    return "\n".join([
        f"**ETA** (gpupool on {ETA_POOL} GPUs, where {len(errors):,} interactive requests wait; p95 wait "
        f"{result.wait_percentile(95):.0f} s). The new estimate is the service's own rule (`rules/eta.py: "
        "eta_seconds`, the one the notebook's wait line shows): it walks forward through what will free capacity "
        f"(idle leases' deadlines, 2 min under pressure, else {IDLE_TIMEOUT_S / 60:g} min; running cells' expected "
        "ends, the median of "
        "the last 200 cells of their class, then the grace) and places the requests ahead first, a slice on the "
        "first GPU with room, whole GPUs on the first node with that many free; it gives no answer while no "
        "cell of the class has ended. The old one (`queue.estimate`) is position × median lease length / leases held. Error = "
        "|estimate − the wait the request then had|, at the moment it started waiting:",
        "",
        md_table(["estimate", "median error s", "p90 error s", "within 30 s or 50 %", "no answer"],
                 [["new (capacity walk)", f"{np.median(new):.0f}", f"{np.percentile(new, 90):.0f}", f"{within:.0%}",
                   unknown],
                  ["old (queue.estimate)", f"{np.median(old):.0f}", f"{np.percentile(old, 90):.0f}",
                   f"{within_old:.0%}", len(errors) - len(old)]]),
        "",
        "The simulator computes it once, when a request starts waiting; the service recomputes it at every "
        "sweep and the notebook's wait line shows the newest (not modelled here). Its main error is the "
        "running cells' unknown ends.",
        ""])


def backlog_variants(quick: bool = False):
    """The policies the backlog part compares, in table order; ``quick`` (a part of the month) adds the
    service's defaults with ``resume_moves`` off and the headroom variants. Pool-wide pressure without node clearing is left out: its replay does not end
    (:data:`POOL_WIDE_CHURN`)."""
    base = policies()
    gp = replace(base["gpupool"], name="gpupool (the service's defaults)")
    at_once = replace(gp, name="gpupool, batch yields, batch first, preempted at once, 5 s notice",
                      batch_yields=True, batch_first=True, preemption_grace=0.0, preemption_notice=5.0)
    parked = replace(at_once, name="… and idle leases on a cleared node parked 5 s after the ask", clear_grace=5.0)
    variants = [gp, replace(gp, name="gpupool, no preemption", preemption_notice=None), at_once, parked,
                replace(parked, name="… parked 5 s after the ask, preempted jobs restart", resume_preempted=False),
                replace(base["reservation"], name="reservation (no classes)")]
    if quick:
        variants += [replace(gp, name="gpupool, a resume waits for its own node (`resume_moves` off)",
                             resume_moves=False)]
        variants += [replace(at_once, name=f"… 5 s notice, headroom {h} nodes", headroom_nodes=h) for h in (1, 2)]
    return variants


#: Why the backlog tables have no row for pressure counted in GPUs pool-wide (``pressure_clears_nodes =
#: False``; an instrumented replay of the month's first 6 hours, 336 GPUs: 214,889 preemptions of 633 jobs).
POOL_WIDE_CHURN = (
    "Pressure counted in GPUs pool-wide (`pressure_clears_nodes = False`) has no row: its replay does not "
    "end. A person's request for a whole node presses on batch jobs here and there; each preempted job's "
    "share comes back when its state is off the GPU, makes no whole node, and the job's own resume, which "
    "fits, is placed back on it (backfill), to be preempted again at the next sweep: in an instrumented "
    "replay of the month's first 6 hours, 214,889 preemptions of 633 jobs, one job 2,622 times. The "
    "service's defaults clear one node per such request, keep it chosen while its leases are being parked, "
    "and place no batch job or resume on it, nor on a node a person's resume waits for "
    "(`priority.batch_may_start`): 109 preemptions in the same 6 hours. (Both counted before resumes moved "
    "to other nodes, `resume_moves`; not counted again since.)")

def backlog_why(fast) -> str:
    """Why the backlog's target is not met, in words, from ``fast`` (the variant with the lowest p95)."""
    moved, total = fast.resumes.get("moved", 0), sum(fast.resumes.values())
    return (
        "Why: a backlog keeps the pool full, so pressure parks people's idle notebooks (after the grace) and "
        "batch backfills their room; the next cell finds its node full and, with `resume_moves` (the default), "
        "moves to a node with room at a move's cost, its state worker to worker (through disk when spilled; "
        "or, with room nowhere, it waits on its own node, pressing there). The resumes' own cost, big states "
        "over the network or through disk, keeps p95 over 10 s "
        f"by itself: in {fast.policy}, resume p50/p95 {fast.resume_percentile(50):.0f} / "
        f"{fast.resume_percentile(95):.0f} s, {slow_resumes(fast)}; {moved:,} of its {total:,} resumes moved "
        "(batch jobs' counted; a batch cell frozen mid-way in RAM never moves). What would reach the target is "
        "resumes that cost seconds when the pool is full: a person's notebook state kept in RAM where its "
        "next cell runs (fewer pressure parks of idle notebooks while batch fills the pool, or room held for "
        "its resume on its node, not built) and a network faster than the "
        f"{costs.NETWORK_BYTES_S * 8 / 1e9:g} Gbit/s modelled for moves; no setting tried here does it.")


def first_hours(workload, hours: float | None):
    """``workload`` with only the cells submitted in its first ``hours`` (None: all)."""
    if hours is None:
        return workload
    return NotebookWorkload([c for c in workload.cells if c.submit < hours * 3600], workload.sessions, workload.rule)


def backlog_run(workload, data, seed, size, policy, log) -> NotebookResult:
    _, tasks = read_openb_tasks(data) if data else openb_tables(seed)
    gpu = tasks.gpu_pods()
    result = simulate_notebooks(workload, policy, size, backlog=BatchSource(gpu.milli, gpu.num, gpu.lifetime,
                                                                            seed=seed))
    log(f"backlog {policy.name}: util {result.cluster_utilization:.1%}, "
        f"p95 {result.wait_percentile(95):g} s ({result.seconds:.0f} s)")
    return result


def backlog_part(workload, data, seed, size, log, hours=None, window=False) -> tuple[str, list]:
    """The backlog subsection over the whole month, or over its first ``hours``; ``window``: the short
    table of the first ``hours`` with the quick variants too, that follows the month's."""
    _, tasks = read_openb_tasks(data) if data else openb_tables(seed)
    gpu = tasks.gpu_pods()
    workload = first_hours(workload, hours)
    results = [backlog_run(workload, data, seed, size, policy, log) for policy in backlog_variants(window)]
    best = max((r for r in results if r.wait_percentile(95) <= TARGET_WAIT_S),
               key=lambda r: r.cluster_utilization, default=None)
    met = best is not None and best.cluster_utilization >= 0.85
    is_eight = np.array([workload.sessions[c.session].gpus == 8 for c in workload.cells])
    fast = min(results[:-1], key=lambda r: (r.wait_percentile(95), -r.cluster_utilization))
    top_util = max(results, key=lambda r: r.cluster_utilization)
    slow = fast.waits > TARGET_WAIT_S
    slow_eight = is_eight[slow].mean() if slow.any() else 0.0
    period = f"the first {hours:g} hours of the month" if hours else "the whole month"
    plot = None if window else plot_backlog(results)
    if window:
        window_met = [r for r in results if r.wait_percentile(95) <= TARGET_WAIT_S and r.cluster_utilization >= 0.85]
        return "\n".join([
            f"**The first {hours:g} hours only**, with the headroom variants too:",
            "",
            md_table(HEADERS + ("int. cells waiting > 10 s", "batch GPU-h lost"),
                     [row + [f"{np.mean(r.waits > TARGET_WAIT_S):.1%}", f"{r.lost_gpu_hours:,.0f}"]
                      for row, r in zip(rows(results), results)]),
            "",
            (f"In these hours the target is met by {', '.join(r.policy for r in window_met)} (the whole month: "
             "above)." if window_met else "In these hours no variant meets the target either.")
            + moves_words(results),
            ""]), [r.row() for r in results]
    text = [
        "### Notebooks plus a batch backlog",
        "",
        f"The sensei month on {size} GPUs ("
        + ("gpupool's size for the notebooks alone without park costs" if size == BACKLOG_POOL
           else "gpupool's size above") + f") plus openb's {len(gpu.num):,} GPU pods as "
        "**preemptible batch jobs**, drawn (seeded, with replacement) whenever held plus queued demand falls "
        "under 120 % of the pool, so the backlog never runs dry; a job needs its `gpu_milli` slice or `num_gpu` "
        "whole GPUs for its openb lifetime (deletion − scheduled); a preempted job is parked in place with its "
        "cell frozen (its state moved off the GPU, as a notebook's) and resumes on its node when room comes there, "
        "keeping its progress (the service's default; a cell frozen mid-way never moves, since the move's spill "
        "would interrupt it, unless the node has spilled it to disk already). A parked notebook's resume goes "
        "to its node, else to another node with room (a move, `c.PoolLeases.resume_moves`). Every queue, pressure and batch-placement decision is the service's rule "
        "(`hub_plugin/rules/priority.py`): interactive requests go first (`class_rank`); `plan` at the 5 s "
        f"sweep ticks parks idle leases {PRESSURE_GRACE_S:g} s after the oldest request pressing on them was "
        "asked and, for a waiting interactive request only, preempts running batch leases (by default "
        f"{PRESSURE_GRACE_S:g} + {PREEMPTION_NOTICE_S:g} s after it: grace + `preemption_notice`), its "
        "victims node by node (the node with the most preemptible batch GPUs first); a resume with room nowhere "
        "it may go presses on its own node's leases only; for a waiting interactive request for several whole GPUs the "
        "plan is given each node's free GPUs (`plan(..., free_gpus)`, GPUs being parked counted free) and takes the "
        "leases of the one node that covers it at least cost, what taking them frees counted in whole GPUs, GPU by "
        "GPU (`rules/clearing.py`: no idle notebook parked if it can, then the fewest running GPUs; the node it "
        "cleared at the last sweep kept while it can still be cleared; a request no node can be cleared for "
        "presses on nothing), and no batch job or resume is placed on that node while the request waits, nor on the node of "
        "a person's resume that fits nowhere (`batch_may_start`). Variants: **gpupool** "
        "(the service's defaults); **a resume waits for its own node** (`resume_moves` off; in the first 48 "
        "hours' table only); **no "
        "preemption** (`allow_preemption = False`); **batch yields, batch "
        "first, preempted at once**: no batch request is placed while an interactive one waits "
        "(`batch_may_start`), `Rule(batch_first=True)` preempts running batch before it parks a person's idle "
        "notebook, and `Rule(preemption_grace=0)` with a 5 s `preemption_notice` (the job's warning is the "
        "notice alone, so a waiting person gets capacity within one or two sweeps); "
        "**idle leases on a cleared node parked 5 s after the ask**: an idle lease on the node cleared for such a request is "
        "parked 5 s after the request was asked, not after the 2 min grace (`Rule(clear_grace=5)`, "
        "`c.PoolPressure.pressure_clear_grace`); "
        "**preempted jobs restart**: a preempted job is queued again as a new request and its work is lost "
        "(a job that cannot be parked, e.g. its node has no checkpointer); **headroom n nodes**: batch is not "
        "placed on an idle node while n or fewer are idle. **reservation (no classes)**: today's service, whole "
        "GPUs, 30 min cull, one queue, no preemption. "
        f"Measured over {period}. {POOL_WIDE_CHURN}",
        "",
        md_table(HEADERS + ("int. cells waiting > 10 s", "batch GPU-h lost"),
                 [row + [f"{np.mean(r.waits > TARGET_WAIT_S):.1%}", f"{r.lost_gpu_hours:,.0f}"]
                  for row, r in zip(rows(results), results)]),
        "",
    ]
    if plot:
        text += [f"![utilization with a backlog]({plot})", ""]
    text += [
        f"- Target, cluster utilization ≥ 85 % while interactive p95 wait ≤ 10 s: **{_verdict(best, met)}**"
        + (f" ({best.policy}: {best.cluster_utilization:.1%}, p95 {best.wait_percentile(95):.0f} s)." if best else
           " (no variant keeps p95 ≤ 10 s).")
        + (_met_words(results) if met else
           f" Best utilization {top_util.cluster_utilization:.1%} ({top_util.policy}), "
           + (f"{top_util.cluster_utilization - 0.85:.1%} of the pool above 85 %, but its interactive p95 is "
              f"{top_util.wait_percentile(95):.0f} s; " if top_util.cluster_utilization >= 0.85 else
              f"short of 85 % by {0.85 - top_util.cluster_utilization:.1%} of the pool; ")
           + f"the lowest interactive p95 is {fast.wait_percentile(95):.0f} s ({fast.policy}), "
           f"{np.mean(slow):.1%} of the cells waiting over 10 s where under 5 % may, {slow_eight:.0%} of them "
           f"8-GPU cells ({is_eight.mean():.0%} of all cells), "
           "which need a whole node. " + backlog_why(fast)),
        "",
    ]
    return "\n".join(text), [r.row() for r in results]


def moves_words(results) -> str:
    """The service's defaults against the same with ``resume_moves`` off, in words (empty without that row)."""
    off = [r for r in results if "resume_moves" in r.policy]
    if not off:
        return ""
    on, off = results[0], off[0]
    over = lambda r: np.mean(r.waits > TARGET_WAIT_S)  # noqa: E731
    q = lambda r: f"{r.wait_percentile(95):,.0f} / {r.wait_percentile(99):,.0f} s"  # noqa: E731
    return (f" Resumes that move (the defaults) against resumes that wait for their own node: p95 / p99 {q(on)} "
            f"against {q(off)}, {over(on):.1%} of the cells waiting over 10 s against {over(off):.1%}, "
            f"utilization {on.cluster_utilization:.1%} against {off.cluster_utilization:.1%}: a move "
            f"{'spares' if on.wait_percentile(99) < off.wait_percentile(99) else 'does not spare'} the long "
            f"waits for a node, but costs a new worker and the state's copy (resume p50 "
            f"{on.resume_percentile(50):.0f} s against {off.resume_percentile(50):.0f} s), so "
            f"{'more' if over(on) > over(off) else 'fewer'} cells wait over 10 s.")


def _verdict(best, met: bool) -> str:
    """The target's verdict in bold, saying whether the service's default rules reach it."""
    if not met:
        return "not met"
    return "met with the service's defaults" if "defaults" in best.policy else "met only with opt-in settings"


def _met_words(results) -> str:
    """What a met backlog target rests on, and the best the same rules reach when preempted jobs restart."""
    restarting = [r for r in results if "restart" in r.policy]
    words = (" Preempted jobs are parked in place and keep their progress (the service's default now); the "
             "opt-in settings of the variants below the defaults are `batch_yields`, `batch_first`, "
             "`preemption_grace = 0`, `preemption_notice = 5`, `pressure_clear_grace = 5`.")
    if restarting:
        other = restarting[0]
        words += (f" Where preempted jobs restart from nothing, the same rules reach {other.cluster_utilization:.1%} "
                  f"at p95 {other.wait_percentile(95):.0f} s ({other.policy}).")
    return words


#: The paper's own simulator (hkust-adsl/kubernetes-scheduler-simulator,
#: experiments/analysis/expected_results/analysis_allo_discrete.csv, openb_pod_list_default, workload tuned to
#: 130 %, seeds 42-51): unallocated GPU share at 130 % arrived, mean of its 10 seeds.
PAPER_ARTIFACT_130 = {"FGD": 0.0461, "BestFit": 0.0692, "Random": 0.1253}
MULTIDIM_SECTION = "### openb with CPU and memory (the paper's setting)"


def multidim_part(data, seeds, log) -> str:
    nodes, tasks = read_openb_tasks(data) if data else openb_tables(seeds[0])
    gpus = sum(n.gpus for n in nodes)
    runs = {name: [] for name in multidim.POLICIES}
    drawn_sizes = []
    for seed in seeds:
        drawn = multidim.sample(tasks, gpus, 1.3, seed)
        drawn_sizes.append(len(drawn.num))
        for name in multidim.POLICIES:
            runs[name].append(multidim.fill(nodes, drawn, name, seed=seed))
            log(f"openb cpu+memory seed {seed} {name}: {runs[name][-1].seconds:.0f} s")
    loads = [0.8, 0.9, 1.0, 1.1, 1.2, 1.3]
    mean = {name: [float(np.mean([r.at(x) for r in rs])) for x in loads] for name, rs in runs.items()}
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rs in runs.items():
        ax.plot(rs[0].arrived * 100, np.mean([r.unallocated for r in rs], axis=0) * 100, label=name)
    ax.set(xlabel="arrived GPU demand (% of capacity)", ylabel="unallocated GPUs (% of capacity)",
           title="openb with CPU and memory: unallocated GPUs", xlim=(70, 130), ylim=(0, 35))
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "sim_openb_multidim.png", dpi=110)
    plt.close(fig)
    at = {name: v[-1] for name, v in mean.items()}
    f, b, ff, k = at["fgd"], at["bestfit"], at["firstfit"], at["fgd-k8s"]
    per_seed = ", ".join(f"{rf.at(1.3) / rb.at(1.3):.2f}" for rf, rb in zip(runs["fgd"], runs["bestfit"]))
    paper = PAPER_ARTIFACT_130
    return "\n".join([
        MULTIDIM_SECTION,
        "",
        f"The {len(nodes):,} nodes with their cores and RAM (`cpu_milli`, `memory_mib`), {gpus:,} GPUs; about "
        f"{int(np.mean(drawn_sizes)):,} tasks per seed drawn from all {len(tasks.num):,} pods (CPU-only ones too: "
        "they take cores and memory from GPU nodes) until GPU demand is 130 % of capacity; they arrive one by one "
        "and never leave; a task that fits nowhere fails. A task goes only where its CPU, memory and GPU asks all "
        "fit. Every policy is measured alike: unallocated = 1 − allocated GPU ÷ capacity, as the paper plots it. "
        "Ties go to the lowest node name, as in the paper's simulator. "
        "**fgd** = least growth of the fragmentation measure (`rules/fragmentation.py: node_fragmentation`: a "
        "task type that does not fit the node in some dimension counts all its unallocated GPUs; one that fits, "
        "the GPUs with less free than it asks (any partly used one for whole-GPU types); a CPU-only type, all "
        "unallocated GPUs), weighted by every task type of the draw (counts, exact sums); task types are CPU + GPU "
        "asks as in the paper's simulator, memory only constrains. **fgd+memory** = the same with memory in "
        "each type and in the measure (what the service's rule does where host memory binds). **fgd-k8s** = fgd "
        "scored as the paper's simulator does it (a Kubernetes score plugin: `int(100 × sigmoid(−growth in "
        "GPUs))`, highest wins, ties to the lowest node), shown to explain the gap to the paper's figures. "
        "**bestfit** = the paper's BestFit: least free CPU + free GPU after placement, each in units of the "
        "largest node's, equal weights, then its tightest GPU. **firstfit**; **random**. "
        f"Mean of seeds {', '.join(map(str, seeds))}.",
        "",
        md_table(["policy"] + [f"{x:.0%}" for x in loads] + ["failed tasks at 130 %", "seconds per run"],
                 [[n] + [f"{v:.2%}" for v in mean[n]]
                  + [f"{np.mean([r.failed[-1] for r in runs[n]]):.1%}", f"{np.mean([r.seconds for r in runs[n]]):.0f}"]
                  for n in runs]),
        "",
        "![unallocated GPUs, CPU and memory](sim_openb_multidim.png)",
        "",
        f"- Target, unallocated at saturation ≤ 0.6 × best fit's: **{'met' if f <= 0.6 * b else 'not met'}**: fgd "
        f"{f:.2%} vs best fit {b:.2%} (ratio {f / b:.2f}; per seed {per_seed}); first fit {ff:.2%}."
        + ("" if f <= 0.6 * b else f" Short by {f - 0.6 * b:.2%} of capacity."),
        f"- The paper's own simulator, on the same trace at 130 % (its published expected results, 10 seeds): "
        f"FGD {paper['FGD']:.2%}, BestFit {paper['BestFit']:.2%}, Random {paper['Random']:.2%}: ratio "
        f"{paper['FGD'] / paper['BestFit']:.2f}, so the 0.6 target is beyond the paper's own result on this "
        f"trace. Here BestFit ({b:.2%}) and Random ({at['random']:.2%}) land near its figures; FGD scored as its "
        f"Kubernetes plugin scores ({k:.2%}, ratio {k / b:.2f}) lands near its FGD. The difference between fgd and "
        "fgd-k8s is the plugin's integer score: growths within one bucket (about 40 milli-GPUs near zero) tie "
        "and go to the lowest node, a first-fit order among near-equal candidates; it is an artifact of the "
        "Kubernetes score range, not the paper's algorithm, so the rule keeps the exact least growth.",
        "- Why fgd lost to first fit before (6.36 % vs 5.58 %, seed 0, and it already refused tasks at 90 % "
        "arrived): its measure weighed only the draw's 48 most frequent task types, and with memory in the type "
        "those cover 94 % of the trace's pods; the rest did not steer it. One-off ablations on "
        "seed 0 (exact sums, not run by this script): that rule 6.81 %; every type instead of 48: 5.55 %; and "
        "types as the paper's simulator keys them (CPU and GPU, memory only a constraint): 5.04 %. Counting "
        "a CPU-only type's unallocated GPUs whether it fits or not (the paper's simulator; before, none when it "
        "fit) corrects the definition but moved nothing measurable (5.55 % either way with every type). The "
        "float shares also let rounding break ties: the same rule gave 6.36 % or 6.53 % depending on summation "
        "order; weights are now integer counts. The old bestfit summed each node's own shares of GPU, CPU "
        "and memory (8.17 % at seed 0), not the paper's BestFit.",
        "- The service: `scheduler.place()` already calls this measure (`rules/hosts.py: host_aware_delta`) on "
        "nodes where a lease's host CPU or memory ask can make a request shape not fit (`hosts.binds`), with the "
        "pool's expected shapes and their default host shares, memory included (as fgd+memory). The changes "
        "above do not alter its decisions: its shapes all ask for GPUs and its weights are shares.",
        ""])


def replace_part(opening: str, text: str, path: Path = HERE / "REPORT.md") -> None:
    """Replace the part of REPORT.md whose first line starts with ``opening`` (up to the next ``### `` or ``## ``):
    the openb-with-CPU-and-memory subsection, or the ETA paragraphs."""
    report = path.read_text()
    start = report.index(f"\n{opening}") + 1
    ends = [i for i in (report.find("\n### ", start), report.find("\n## ", start)) if i != -1]
    end = min(ends) + 1 if ends else len(report)
    path.write_text(report[:start] + text.rstrip("\n") + "\n\n" + report[end:])


def plot_sweeps(sweeps, dedicated) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, cache in sweeps.items():
        sizes = sorted(cache)
        ax.plot(sizes, [max(cache[s].wait_percentile(95), 1) for s in sizes], marker="o", label=name)
    ax.axhline(TARGET_WAIT_S, color="grey", ls="--", lw=1, label="10 s")
    ax.axvline(dedicated.pool_size, color="black", ls=":", lw=1, label=f"dedicated ({dedicated.pool_size})")
    ax.set(yscale="log", xlabel="pool size (GPUs)", ylabel="p95 interactive wait (s, 1 = none)",
           title="sensei June 2021: p95 wait vs pool size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "sim_sensei_wait.png", dpi=110)
    plt.close(fig)
    return "sim_sensei_wait.png"


def plot_backlog(results) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r.policy for r in results]
    ax.bar(names, [r.cluster_utilization * 100 for r in results], label="cluster utilization")
    ax.axhline(85, color="grey", ls="--", lw=1, label="85 %")
    ax.set(ylabel="% of pool GPU-hours busy", title="sensei + openb batch backlog")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "sim_backlog_utilization.png", dpi=110)
    plt.close(fig)
    return "sim_backlog_utilization.png"


def load_sensei(data, seed, users):
    if data is not None:
        return sensei_workload(data, seed=seed, users=users)
    return build_sessions(sensei_rows(seed), slice_millis(seed), users=users, seed=seed)


def openb_part(data: Path, log) -> tuple[str, dict]:
    nodes, num, milli = read_openb(data)
    specs = openb_specs(nodes)
    runs = {name: [] for name in OPENB_POLICIES}
    for seed in OPENB_SEEDS:
        tasks = sample_tasks(num, milli, len(specs), 1.3, seed)
        for name in OPENB_POLICIES:
            runs[name].append(fill(specs, *tasks, name))
        log(f"openb seed {seed} done")
    loads = [0.8, 0.9, 1.0, 1.1, 1.2, 1.3]
    mean = {name: [np.mean([r.at(x) for r in rs]) for x in loads] for name, rs in runs.items()}
    # place() on all 6,212 GPUs vs through the placement index: same decisions, timed here.
    tasks = sample_tasks(num, milli, len(specs), 1.0, 0)
    timing = {}
    for full in (True, False):
        pool, t = SimulatedPool(specs, full_scan=full), time.perf_counter()
        for gpus, m in list(zip(tasks[0].tolist(), tasks[1].tolist()))[:300]:
            placed = pool.place(m, gpus)
            if hasattr(placed, "gpus"):
                pool.take(placed)
        timing[full] = (time.perf_counter() - t) / 300 * 1000
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rs in runs.items():
        ax.plot(rs[0].arrived * 100, np.mean([r.unallocated for r in rs], axis=0) * 100, label=name)
    ax.set(xlabel="arrived GPU demand (% of capacity)", ylabel="unallocated GPUs (% of capacity)",
           title="openb (Alibaba 2023): unallocated GPUs as load grows", xlim=(70, 130), ylim=(0, 35))
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "sim_openb_unallocated.png", dpi=110)
    plt.close(fig)
    g, b = mean["gpupool"][-1], mean["bestfit"][-1]
    text = [
        "### openb on the GPU dimension only (`scheduler.place()` itself)",
        "",
        f"Cluster: the {len(nodes):,} nodes and {len(specs):,} GPUs of `openb_node_list_gpu_node.csv`. Tasks: drawn "
        "with replacement (seeded) from the 7,064 GPU pods of `openb_pod_list_default.csv` until their GPU demand is "
        "130 % of capacity; they arrive one by one and never leave (the workload-inflation experiment of Weng et "
        "al., ATC '23). `num_gpu == 1` asks `gpu_milli`/1000 of one GPU; `num_gpu ≥ 2` that many whole GPUs on one "
        "node. Only the GPU dimension is modelled (no CPU or memory limits, GPU models ignored, CPU-only pods left "
        "out), so the numbers are not the paper's. Policies: **gpupool** = `scheduler.place()` (fragmentation-aware "
        "best fit: least growth of Weng et al.'s fragmentation measure, with the sampled tasks' mix as the expected "
        "workload, as FGD uses the target workload); **firstfit**; **bestfit** = node left with the least "
        "free GPU capacity, then its tightest GPU (the paper's BestFit on the GPU dimension); **random** node. "
        f"Mean of seeds {', '.join(map(str, OPENB_SEEDS))}.",
        "",
        "Unallocated share of GPU capacity by arrived demand (% of capacity):",
        "",
        md_table(["policy"] + [f"{x:.0%}" for x in loads] + ["failed tasks at 130 %"],
                 [[name] + [f"{v:.2%}" for v in mean[name]]
                  + [f"{np.mean([r.failed[-1] for r in runs[name]]):.1%}"] for name in runs]),
        "",
        f"![unallocated GPUs]({'sim_openb_unallocated.png'})",
        "",
        f"- Target, unallocated at saturation ≤ 0.6 × best fit's: **{'met' if g <= 0.6 * b else 'not met'}**: "
        f"gpupool {g:.2%} vs best fit {b:.2%} (ratio {g / b:.2f}). On the GPU dimension alone every policy but "
        "random leaves under 4 % unallocated at saturation, and what is left is slivers (e.g. 190 milli after an "
        "810) that almost no task of this trace fits: the fragmentation measure has little left to win. The "
        "paper's larger gains come with CPU and memory constraints, which make nodes run out before their GPUs "
        "do; this model leaves those out.",
        f"- Speed: `place()` on all 6,212 GPUs takes {timing[True]:.1f} ms per decision; through the placement "
        f"index (same decisions, checked in `tests/rules/test_simulator.py`) {timing[False]:.2f} ms. A whole fill "
        f"({len(runs['gpupool'][0].arrived) and runs['gpupool'][0].decisions:,} decisions) takes "
        f"{np.mean([r.seconds for r in runs['gpupool']]):.1f} s.",
    ]
    return "\n".join(text), {"loads": loads, "mean_unallocated": mean,
                             "place_ms": {"full": timing[True], "subset": timing[False]}}



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=Path("../shared/data"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=["backlog", "openb-multidim", "eta", "notebooks"],
                   help="notebooks: redo only the notebooks-alone subsection of REPORT.md (the month, its parking "
                   "table, the users and the ETA) and its plot (6-10 min); backlog: redo only the backlog "
                   "subsection of REPORT.md and its plot (the month, about 13 min on 2 shared cores, the service's "
                   "defaults 2.5 min of it; then its first 48 hours, about a minute); openb-multidim: redo only "
                   "the openb-with-CPU-and-memory subsection of REPORT.md and its plot (about 4 min); eta: redo only the ETA "
                   "paragraphs of REPORT.md")
    p.add_argument("--hours", type=float, help="with --only backlog: the subsection measures only the month's "
                   "first HOURS, and says so, then (HOURS over 48) its first 48 hours (default: the month, then "
                   "its first 48 hours)")
    p.add_argument("--pool-size", type=int, default=336, help="with --only backlog: GPUs")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    data = args.data if (args.data / "sensei_june_60sec.csv").exists() else None
    words = "the public trace," if data else "**generated** traces (no public traces in --data),"
    workload = load_sensei(data, args.seed, 100)
    if args.only == "eta":
        replace_part("**ETA** (", eta_part(workload, log))
        log("wrote the ETA paragraphs of bench/REPORT.md")
        return 0
    if args.only == "openb-multidim":
        replace_part(f"{MULTIDIM_SECTION}\n", multidim_part(args.data if (args.data / "openb_pod_list_default.csv").exists() else None,
                                       OPENB_SEEDS, log))
        log("wrote the openb-with-CPU-and-memory subsection of bench/REPORT.md")
        return 0
    if args.only == "notebooks":
        sensei_text, _, best = sensei_part(workload, words, log)
        replace_part("### Notebooks alone", "\n".join([sensei_text, users_part(data, args.seed, best, log),
                                                        eta_part(workload, log)]))
        log("wrote the notebooks-alone subsection of bench/REPORT.md")
        return 0
    if args.only == "backlog":
        backlog_text, _ = backlog_part(workload, data, args.seed, args.pool_size, log, args.hours)
        if args.hours is None or args.hours > 48:
            backlog_text += "\n" + backlog_part(workload, data, args.seed, args.pool_size, log, 48.0, window=True)[0]
        replace_part("### Notebooks plus a batch backlog", backlog_text)
        log("wrote the backlog subsection of bench/REPORT.md")
        return 0
    sensei_text, _, best = sensei_part(workload, words, log)
    users_text = users_part(data, args.seed, best, log)
    eta_text = eta_part(workload, log)
    size = BACKLOG_POOL
    backlog_text, _ = backlog_part(workload, data, args.seed, size, log)
    backlog_text += "\n" + backlog_part(workload, data, args.seed, size, log, 48.0, window=True)[0]
    multidim_text = multidim_part(data, OPENB_SEEDS, log)
    openb_text, _ = openb_part(data, log) if data else ("", None)
    body = "\n".join([
        SECTION,
        "",
        "Replays against the real scheduler (`hub_plugin/rules/scheduler.py: place`) and reclaim rule "
        "(`hub_plugin/rules/reclaim.py: decide`) on a virtual clock, with the service's rules for request classes, "
        "pressure parks and preemption (`hub_plugin/rules/priority.py`) and the ETA (`hub_plugin/rules/eta.py`), "
        "and the simulator's own for multi-dimension "
        "placement (`hub_plugin/simulate/multidim.py`). Sources: Adobe Sensei notebook cells of June 2021 as "
        "released with NotebookOS (Carver et al., arXiv 2503.20591, ds2-lab/NotebookOS-Dashboard); the Alibaba "
        "GPU-sharing trace openb (Weng et al., \"Beware of Fragmentation: Scheduling GPU-Sharing Workloads with "
        "Fragmentation Gradient Descent\", USENIX ATC '23, alibaba/clusterdata cluster-trace-gpu-v2023). Data "
        "licences are unconfirmed (../shared/data/README.md): internal simulation only; without them "
        "`gpupool simulate` generates traces of the same form.",
        "",
        "Reproduce (from the repository root):",
        "",
        "```",
        ".venv/bin/python bench/simulate_report.py            # this whole section and bench/sim_*.png",
        f".venv/bin/gpupool simulate --data ../shared/data --pool-size {size},{size + 32}",
        f".venv/bin/gpupool simulate --data ../shared/data --pool-size {size} --policy gpupool --backlog",
        ".venv/bin/python bench/simulate_report.py --only notebooks   # the notebooks-alone subsection (6-10 min)",
        ".venv/bin/python bench/simulate_report.py --only backlog   # the backlog subsection alone (about 14 min)",
        ".venv/bin/gpupool simulate --data ../shared/data --users 300 --pool-size 352",
        ".venv/bin/gpupool simulate --workload openb --data ../shared/data --dimensions all",
        ".venv/bin/python bench/simulate_report.py --only openb-multidim   # that subsection alone (about 4 min)",
        ".venv/bin/gpupool simulate --from-store sqlite:///.state/service/gpupool.sqlite   # your own pool",
        ".venv/bin/gpupool simulate --pool-size 352          # generated traces: runs from the wheel",
        "```",
        "",
        sensei_text,
        users_text,
        eta_text,
        backlog_text,
        multidim_text,
        openb_text,
        "",
        f"Generated by `bench/simulate_report.py` in {time.perf_counter() - t0:.0f} s.",
    ])
    write_section(SECTION, body)
    log("wrote bench/REPORT.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
