"""A move (``%gpu acquire`` while attached) that the pool refuses: one
clear line, the notebook still on its old lease, and the hint to release
first only where releasing would help (the pool had no room), never for a
quota. Nothing says "moving" before the pool gave the new lease.

Driven through a real IPython shell against a real service and agent (two
simulated A100s): ``hours`` may use almost no GPU-hours a day; ``tester``
and ``bob`` are unlimited.
"""

from __future__ import annotations

import contextlib
import re
import time
from typing import Iterator

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from procs import start_agent, start_service

from gpupool.wire.leases import LeaseRequest

TOKENS = {"hours": "hours-token-move", "bob": "bob-token-move"}
#: 0.36 GPU-seconds a day: used up by a second on one GPU.
CONFIG = {"heartbeat_ttl": 3600.0, "quotas": {"user:hours": {"gpu_hours_per_day": 0.0001}}}
RELEASE_FIRST = "%gpu release then %gpu acquire"


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("move-refusals")
    service = start_service(root, tokens=TOKENS, config=CONFIG)
    agent = start_agent(root, service)
    yield service
    agent.stop()
    assert service.stop() == 0


@contextlib.contextmanager
def shell_as(service, user: str, monkeypatch) -> Iterator:
    """A shell of its own with the extension loaded, its client ``user``
    (IPython's global test shell starts once per process: tests/kernel/test_magics_input.py's)."""
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setenv("GPUPOOL_URL", service.url)
    monkeypatch.setenv("GPUPOOL_TOKEN", service.extra_tokens[user])
    monkeypatch.delenv("GPUPOOL_KERNEL_ID", raising=False)
    ip = InteractiveShell()
    ip.run_line_magic("load_ext", "gpupool.magics")
    try:
        yield ip
    finally:
        with contextlib.suppress(UsageError):
            ip.run_line_magic("gpu", "release --discard")
        ip.run_line_magic("unload_ext", "gpupool.magics")


def attached(ip) -> str:
    return ip.magics_manager.registry["GPUMagics"].attachment.lease.id


def refused_move(ip, line: str) -> tuple[str, str]:
    """The UsageError's words and what was printed, for ``%gpu LINE`` that must be refused."""
    with capture_output() as out, pytest.raises(UsageError) as raised:
        ip.run_line_magic("gpu", line)
    return str(raised.value), out.stdout + out.stderr


def test_a_move_refused_by_the_daily_gpu_hours_gives_no_hint_to_release_first(pool, monkeypatch):
    """A release gives back no GPU-hours, and the move's ``replaces`` keeps the old lease out of max_gpus."""
    with shell_as(pool, "hours", monkeypatch) as ip:
        ip.run_line_magic("gpu", "acquire 1")
        old = attached(ip)
        client = pool.client("hours")
        while client.quota()["usage"]["today_gpu_hours"] < 0.0001:  # the running lease uses it up
            time.sleep(0.2)
        words, printed = refused_move(ip, "acquire 0.5")
        # the use as it is (the running lease goes on using it), not clamped to the limit
        shown = re.match(r"could not move: daily GPU-hours used up \(([0-9.]+) of 0\.0001\)", words)
        assert shown and float(shown[1]) >= 0.0001, words
        assert words.endswith(f"still attached to {old}, nothing changed"), words
        assert RELEASE_FIRST not in words and "moving" not in printed, (words, printed)
        assert attached(ip) == old and [lease.id for lease in client.list_leases()] == [old]


def test_a_move_refused_for_room_says_to_release_first_and_a_move_given_room_says_where(pool, monkeypatch):
    """The old lease's GPU is what the new one needs: releasing first helps, so the hint is given."""
    with shell_as(pool, "tester", monkeypatch) as ip:
        ip.run_line_magic("gpu", "acquire 1")
        old = attached(ip)
        bob = pool.client("bob")
        other = bob.create_lease(LeaseRequest(fraction=1.0))
        try:
            words, printed = refused_move(ip, "acquire 0.75")
            assert words.startswith("could not move: no GPU can take 0.75 now"), words
            assert words.endswith(f"still attached to {old}, nothing changed (a move holds both leases for a "
                                  "moment: where the old one leaves no room, %gpu release then %gpu acquire)"), words
            assert "moving" not in printed, printed
        finally:
            bob.release(other.id)
        with capture_output() as out:
            ip.run_line_magic("gpu", "acquire 0.75")
        new = attached(ip)
        assert re.search(rf"moving {old} to {new}; its variables go worker to worker\n.*moved {old} to {new}: ",
                         out.stdout, re.S), out.stdout


def test_a_refused_move_of_a_parked_lease_parks_it_again(pool, monkeypatch):
    """A move resumes a parked lease first (its variables travel from its live worker); refused then,
    the lease is parked again as it was, its GPU back in the pool, not left holding it while idle."""
    with shell_as(pool, "tester", monkeypatch) as ip:
        ip.run_line_magic("gpu", "acquire 1")
        old = attached(ip)
        with capture_output():
            ip.run_line_magic("gpu", "park")
        bob = pool.client("bob")
        other = bob.create_lease(LeaseRequest(fraction=1.0))
        try:
            words, _ = refused_move(ip, "acquire 1")  # the same size: refused before any resume
            assert words.startswith(f"already attached to {old}"), words
            assert pool.client().get_lease(old).state.value == "parked"
            words, _ = refused_move(ip, "acquire 0.75")  # the old lease's GPU, resumed, leaves no room
            assert words.startswith("could not move: "), words
            assert f"still attached to {old}, parked again as it was" in words, words
            assert pool.client().get_lease(old).state.value == "parked"
        finally:
            bob.release(other.id)
