"""The warning before idle reclaim reaches the notebook.

The service sends ``idle_deadline`` and ``idle_warning`` with each lease; the
notebook kernel's heartbeat thread raises one warning per idle period, then a
notice when the lease is parked or reclaimed. The gpupool kernel sends each
at once as an event on the ``gpupool.status`` comm and says it at the top of
the next cell: never under an old cell (notices land where the
user looks). Through a real service, agent and gpupool notebook kernel; the
whole IOPub stream is read (every parent), as a notebook front end sees it.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from traitlets import TraitError

from frontend import install_kernelspec, start_gpupool_kernel
from transcript import Transcript
from gpupool.hub_plugin.config import PoolLeases
from gpupool.hub_plugin.rules.reclaim import idle_deadline
from gpupool.magics.heartbeat import idle_warning_text
from gpupool.schema import LeaseState, isoformat, parse_time
from gpupool.wire.leases import Lease
from procs import start_agent, start_service

WARNING = re.compile(r"gpupool: lease (L-[0-9a-f]{12}) has been idle \d+s; it will be (parked within \d+s: its GPU goes "
                     r"back to the pool, its worker waits frozen with its variables and the next cell resumes it|"
                     r"reclaimed within \d+s: released, its worker stopped and its variables lost) \(run a cell to "
                     r"keep it\)")
#: Seconds: the service's warning lead, long so that a slow machine still runs a
#: cell between the warning and the park. The client beats every second (TTL 3 s).
LEAD = 20.0

# -- pure parts -------------------------------------------------------------------

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def lease_at(idle_for: float | None, idle_timeout: float = 600.0, warning: float = 60.0) -> Lease:
    """An active lease idle for ``idle_for`` seconds at T0 (None: a cell runs)."""
    since = None if idle_for is None else T0 - timedelta(seconds=idle_for)
    deadline = None if since is None else since + timedelta(seconds=idle_timeout)
    return Lease(id="L-1", owner="ann", state=LeaseState.active, fraction=0.5, gpu_count=1, memory=1,
                 idle_timeout=idle_timeout, idle_since=isoformat(since), idle_deadline=isoformat(deadline),
                 idle_warning=warning)


PARKS = ("its GPU goes back to the pool, its worker waits frozen with its variables and the next cell resumes it "
         "(run a cell to keep it)")


@pytest.mark.parametrize("lease, expected", [
    # parked at the service's deadline, beats every 15 s: due once <= 60 + 15 s are left
    (lease_at(524), None),
    (lease_at(525), f"lease L-1 has been idle 8m 45s; it will be parked within 1m 15s: {PARKS}"),
    (lease_at(600), f"lease L-1 has been idle 10m; it will be parked within 0s: {PARKS}"),
    # on_idle release: released at the deadline, the variables lost
    (replace(lease_at(525), on_idle="release"), "lease L-1 has been idle 8m 45s; it will be reclaimed within 1m 15s: "
                                                "released, its worker stopped and its variables lost (run a cell to "
                                                "keep it)"),
    (lease_at(None), None),  # a cell runs: no deadline
    (lease_at(599, warning=0), None),  # warnings turned off
])
def test_the_warning_is_due_one_beat_before_its_lead_and_says_when_and_what(lease, expected):
    assert idle_warning_text(lease, interval=15.0, now=T0) == expected


@pytest.mark.parametrize("setting, timeout, lead", [(60.0, 1800.0, 60.0), (60.0, 60.0, 20.0), (60.0, 3.0, 1.0),
                                                     (0.0, 60.0, 0.0), (60.0, None, 60.0)])
def test_the_warning_lead_is_never_more_than_a_third_of_the_idle_timeout(setting, timeout, lead):
    from gpupool.hub_plugin.lease_views import warning_lead
    assert warning_lead(setting, timeout) == lead


def test_a_warning_is_stale_once_its_lease_is_not_active_or_its_deadline_passed():
    from gpupool.magics.heartbeat import KernelHeartbeat

    beat = KernelHeartbeat(None, "L-1", 15.0)  # never started: only what it last saw counts
    assert not beat.warning_stale()
    now = datetime.now(timezone.utc)
    beat.last = replace(lease_at(30), idle_deadline=isoformat(now + timedelta(seconds=60)))
    assert not beat.warning_stale(), "the deadline is ahead: the warning is true"
    beat.last = replace(lease_at(30), idle_deadline=isoformat(now))
    assert beat.warning_stale(), "the deadline passed: the pool parks or releases it, seen or not"
    for state in (LeaseState.releasing, LeaseState.parking, LeaseState.parked):
        beat.last = replace(lease_at(30), state=state, idle_deadline=None)
        assert beat.warning_stale(), state
    beat.last, beat.ended = lease_at(30), replace(lease_at(30), state=LeaseState.reclaimed)
    assert beat.warning_stale()


def test_after_a_cell_the_next_beat_comes_soon_while_the_service_still_sees_the_worker_busy():
    """The status bar's countdown comes with the first beat that sees the worker idle: while the
    service (told by the agent every few seconds) still sees it busy, beats keep the busy rhythm. After
    the warning the beat comes a moment after the deadline, and past it (the lease not parked yet)
    at the busy rhythm: it beat every 50 ms until the park."""
    from gpupool.magics.heartbeat import KernelHeartbeat

    beat = KernelHeartbeat(None, "L-1", 15.0, busy_interval=2.0)  # never started: the rule alone
    busy = replace(lease_at(None), worker={"execution_state": "busy"})
    assert beat._until_due(busy) == 2.0
    assert beat._until_due(replace(busy, worker={"execution_state": "idle"})) is None
    assert beat._until_due(replace(busy, state=LeaseState.parking)) is None
    now = datetime.now(timezone.utc)
    idle = replace(lease_at(0), worker={"execution_state": "idle"}, idle_since=isoformat(now),
                   idle_deadline=isoformat(now + timedelta(seconds=600)))
    assert 500 < beat._until_due(idle) < 600, "then the deadline's own timing"
    beat._warned_for = idle.idle_since  # warned: the next beat comes a moment after the deadline
    assert 600 < beat._until_due(idle) <= 601
    past = replace(idle, idle_deadline=isoformat(now - timedelta(seconds=30)))
    assert beat._until_due(past) == 2.0, "past it (the park not done: its agent restarting), the busy rhythm"


def test_work_after_a_quiet_spell_beats_at_once_and_back_to_back_cells_keep_the_busy_rhythm():
    """The heartbeat thread is woken when work starts after a quiet spell (a beat at once) or just
    after a beat (the next one busy_interval after it, not the idle interval later); cells back
    to back beat every busy_interval, not once per cell."""
    from gpupool.heartbeat import LeaseHeartbeat

    beats: list[float] = []

    class Service:
        def heartbeat(self, lease_id: str) -> Lease:
            beats.append(time.monotonic())
            return lease_at(None)

    def beats_within(count: int, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while len(beats) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(beats) >= count

    beat = LeaseHeartbeat(Service(), "L-1", 60.0, busy_interval=0.3)
    beat.start()
    try:
        time.sleep(0.5)
        assert beats == [], "the idle interval is a minute"
        beat.running(True)
        assert beats_within(1, 2.0), "work after a quiet spell beats at once"
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # cells back to back
            beat.running(False)
            beat.running(True)
            time.sleep(0.002)
        assert 4 <= len(beats) <= 9, f"{len(beats)} beats: one per busy_interval, not one per cell"
        beat.running(False)
        count = len(beats)
        assert beats_within(count + 1, 2.0)  # the beat after the last cell: the thread now waits a minute
        beat.running(True)  # work again, just after that beat
        assert beats_within(count + 2, 2.0), "the next beat comes busy_interval after the last, not a minute"
    finally:
        beat.stop()


def test_the_words_of_an_ended_lease_say_the_variables_are_lost_and_how_to_go_on():
    from gpupool.magics.words import CELL_DID_NOT_RUN, ended_words

    idle = replace(lease_at(7), state=LeaseState.reclaimed, on_idle="release", reason="idle for 7s")
    assert ended_words(idle, CELL_DID_NOT_RUN) == (
        "lease L-1 was reclaimed: idle for 7s. The worker's variables were lost with it (an idle release brings "
        "nothing back; --on-idle park, the default, keeps them): none came back to this notebook, which keeps "
        "only those it held itself; this cell did not run. Run %gpu acquire 0.5 to attach again, then rerun the "
        "cells that made them.")
    admin = replace(lease_at(7), state=LeaseState.released, gpu_count=2, fraction=1.0,
                    reason="released by admin root: admin needs it")
    assert ended_words(admin) == (
        "lease L-1 was released: released by admin root: admin needs it. The worker's variables were lost with "
        "it: none came back to this notebook, which keeps only those it held itself. Run %gpu acquire 2 to "
        "attach again, then rerun the cells that made them.")


def test_the_idle_deadline_exists_only_for_an_active_lease_with_an_idle_worker():
    row = SimpleNamespace(state="active", worker_state="idle", idle_since=T0, idle_timeout=90.0)
    assert idle_deadline(row) == T0 + timedelta(seconds=90)
    assert idle_deadline(SimpleNamespace(**{**vars(row), "worker_state": "busy"})) is None
    assert idle_deadline(SimpleNamespace(**{**vars(row), "idle_since": None})) is None
    assert idle_deadline(SimpleNamespace(**{**vars(row), "state": "released"})) is None


@pytest.mark.parametrize("value, expected", [("2m", 120.0), (30, 30.0), (0, 0)])
def test_idle_warning_setting_reads_durations_and_zero_turns_it_off(value, expected):
    assert PoolLeases(idle_warning=value).idle_warning == expected
    assert PoolLeases().idle_warning == 60.0


@pytest.mark.parametrize("value", ["soon", -5])
def test_a_bad_idle_warning_setting_is_refused(value):
    with pytest.raises(TraitError, match="idle_warning"):
        PoolLeases(idle_warning=value)


# -- through a real notebook kernel ----------------------------------------------------


@pytest.fixture(scope="module")
def warning_pool(tmp_path_factory):
    """Service (heartbeat TTL 3 s, idle warning LEAD), one agent, the kernelspec:
    ``(service, kernels dir)``."""
    root = tmp_path_factory.mktemp("idle-warning")
    service = start_service(root, config={"heartbeat_ttl": 3.0, "idle_warning": LEAD})
    agent = start_agent(root, service)
    kernels = install_kernelspec(root / "prefix", service.url, service.user_token)
    yield service, kernels
    agent.stop()
    service.stop()


@pytest.fixture
def notebook(warning_pool, tmp_path):
    """A gpupool notebook kernel read through a :class:`Transcript`."""
    km, kc = start_gpupool_kernel(warning_pool[1], tmp_path)
    yield Transcript(kc)
    kc.stop_channels()
    km.shutdown_kernel(now=False)


def test_one_warning_per_idle_period_then_the_park_notice_tops_the_next_cell_which_resumes_in_place(
        warning_pool, notebook):
    service, _ = warning_pool
    client = service.client()
    notebook.listen()
    notebook.execute("%gpu acquire 0.25 --idle-timeout 24s")
    lease_id, = [lease.id for lease in client.list_leases(active=True)]
    notebook.execute("kept = [1, 2, 3]\nimport os\npid = os.getpid()")

    # First idle period: warned at about 15 s idle (24 - 24/3 - one beat); parked by the service at 24 s.
    first = notebook.wait_for_event("idle_warning", 30, "the first idle warning")
    assert WARNING.fullmatch("gpupool: " + first["message"])[1] == lease_id
    assert "it will be parked within" in first["message"]
    assert not notebook.lines(WARNING), "nothing is written under an old cell"
    lease = client.get_lease(lease_id)
    assert lease.state is LeaseState.active and lease.idle_warning == 24 / 3  # a third of the timeout, not LEAD
    if lease.idle_deadline is not None:  # null only if the worker reported busy meanwhile
        assert parse_time(lease.idle_deadline) == parse_time(lease.idle_since) + timedelta(seconds=24)

    # The next cell says the warning at its top, runs on the same lease and starts a new idle period.
    second_cell, _ = notebook.execute("kept.append(4)\nprint(os.environ['GPUPOOL_LEASE_ID'])")
    (_, parent, _), = notebook.lines(WARNING)
    assert parent == second_cell
    assert notebook.lines(lease_id)[-1][1] == second_cell

    parked = notebook.wait_for_event("parked", 60, "the park notice")
    warnings = [e for e in notebook.events if e["event"] == "idle_warning"]
    assert len(warnings) == 2, f"one warning per idle period: {notebook.events}"
    assert notebook.events.index(warnings[1]) < notebook.events.index(parked)
    assert re.fullmatch(rf"lease {lease_id} was parked, idle for \d+s \(idle timeout 24s\): its worker is "
                        r"frozen on node-1 with its variables in host memory( \([\d.]+ [KMG]iB\))? and its GPU is "
                        r"back in the pool; the next cell resumes it where it was", parked["message"]), parked
    assert not notebook.lines("was parked"), "not written under the last cell"
    third_cell, _ = notebook.execute("%%local\n1")
    (_, parent, _), = notebook.lines("was parked")
    assert parent == third_cell
    assert client.get_lease(lease_id).state is LeaseState.parked

    # The next forwarded cell resumes the same worker: same process, same variables.
    fourth_cell, _ = notebook.execute("print(kept, os.getpid() == pid, os.environ['GPUPOOL_LEASE_ID'])")
    said = "".join(text for cell, text in notebook.streams if cell == fourth_cell)
    assert re.search(rf"gpupool: resumed {lease_id} on node-1 GPU \d+ in [\d.]+s \(parked [\d.]+s\)", said), said
    assert f"[1, 2, 3, 4] True {lease_id}" in said, said
    resumed = client.get_lease(lease_id)
    assert resumed.state is LeaseState.active and resumed.parked is None


def test_without_parking_the_warning_says_variables_are_lost_and_the_reclaim_is_told(warning_pool, notebook):
    service, _ = warning_pool
    notebook.listen()
    notebook.execute("%gpu acquire 0.25 --idle-timeout 5s --on-idle release")
    lease_id, = [lease.id for lease in service.client().list_leases(active=True)]

    reclaimed = notebook.wait_for_event("ended", 30, "the reclaim notice")
    assert reclaimed["message"].startswith(f"lease {lease_id} was reclaimed: idle")
    warning, = [e for e in notebook.events if e["event"] == "idle_warning"]
    assert notebook.events.index(warning) < notebook.events.index(reclaimed)
    assert "its variables lost" in warning["message"] and "reclaimed within" in warning["message"]
    next_cell, _ = notebook.execute("%%local\n1 + 1")
    said = [parent for parent, text in notebook.streams if "gpupool: lease" in text]
    assert said and set(said) == {next_cell}, "both notices top the next cell"
    status, _ = notebook.execute("%gpu status")
    assert not [text for parent, text in notebook.streams if parent == status and "reclaimed" in text], \
        "told once: the kernel let the ended lease go"
    assert service.client().get_lease(lease_id).state is LeaseState.reclaimed


def test_a_cell_after_an_idle_release_says_it_did_not_run_and_what_was_lost_without_the_stale_warning(
        warning_pool, notebook):
    service, _ = warning_pool
    notebook.listen()
    notebook.execute("%gpu acquire 0.25 --idle-timeout 5s --on-idle release")
    lease_id, = [lease.id for lease in service.client().list_leases(active=True)]
    notebook.execute("u = 1")
    notebook.wait_for_event("ended", 30, "the reclaim notice")
    cell, reply = notebook.execute("print(u)", ok=False)
    said = "".join(text for parent, text in notebook.streams if parent == cell)
    assert "has been idle" not in said, "no warning of a release that already happened: " + said
    assert said.count(f"lease {lease_id} was reclaimed: idle") == 1, said
    assert "The worker's variables were lost with it (an idle release brings nothing back" in said, said
    assert "this cell did not run. Run %gpu acquire 0.25 to attach again" in said, said
    assert reply["ename"] == "UsageError"


def test_no_notice_of_a_lease_given_up_reaches_a_later_cell(warning_pool, notebook):
    """A notice that comes while (or after) the lease is released is stale: no cell says it."""
    notebook.listen()
    notebook.execute("%gpu acquire 0.25 --idle-timeout 30s")
    notebook.execute("q = 5")
    notebook.wait_for_event("idle_warning", 30, "the idle warning")
    # The warning waits for the next cell; a release cell says it (true then), and what comes
    # while it runs (the heartbeat thread's beat, a park racing the release) is dropped.
    release, _ = notebook.execute("%%local\n"
                                  "kernel = get_ipython().kernel\n"
                                  "beat = kernel.gpu.attachment.heartbeat\n"
                                  "get_ipython().run_line_magic('gpu', 'release')\n"
                                  "kernel.notices.notify('idle_warning', 'stale: idle 3s', beat=beat)\n"
                                  "beat.say('stale: was parked after idle', kind='parked')")
    later, _ = notebook.execute("%%local\n1")
    assert not [text for parent, text in notebook.streams if parent == later and "gpupool:" in text], \
        notebook.text()
    assert "stale" not in notebook.text()
    assert not [e for e in notebook.events if e["message"].startswith("stale")]


def test_a_parked_lease_is_told_once_when_the_next_cell_resumes_it(warning_pool, notebook):
    notebook.listen()
    notebook.execute("%gpu acquire 0.25 --idle-timeout 6s")
    notebook.execute("import json\nkept = [1, 2, 3]")
    notebook.wait_for_event("parked", 30, "the park notice")
    resumed, _ = notebook.execute("print(len(kept))", timeout=120)
    said = "".join(text for parent, text in notebook.streams if parent == resumed)
    assert said.count("gpupool: resumed ") == 1 and "was parked" not in said, said
    assert "has been idle" not in said, "no warning atop the resume cell about the park that came true"
    assert "3\n" in said
