"""Lease cgroups (:mod:`gpupool.node.cgroups`) on this host's real
cgroup file systems: v2 (``cgroup.kill``, and the freeze-and-kill fallback)
and v1 (freezer, memory, pids, cpu), and the "none" mode's warning and its
weaker process-group kill.

The v2 and v1 tests need root and the hierarchy mounted; elsewhere they are
skipped with the reason. Each test works in a subtree of its own
(``gpupool/test-HEX`` under the test process's cgroup) and removes it.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpupool.node import cgroups
from gpupool.node.cgroups import CgroupError, containment
from gpupool.node.cgroups.hybrid import HybridCgroup
from gpupool.node.cgroups.mounts import default_root, own_cgroups, read_mounts
from gpupool.node.cgroups.none import NoContainment

# A process that, once told on its stdin, leaves a daemon behind: a double
# fork with setsid (a new session, reparented to init), which writes its pid.
DAEMONIZE = ("read -r _; (setsid sh -c 'echo $$ > \"$0.tmp\" && mv \"$0.tmp\" \"$0\"; exec sleep 600' \"$1\" "
             "</dev/null >/dev/null 2>&1 &); exec sleep 600")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(predicate, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def subtree(mode: str, tmp_path: Path) -> cgroups.Containment:
    """A containment of ``mode`` in a subtree of its own, or skip saying why."""
    if os.geteuid() != 0:
        pytest.skip("making cgroups needs root")
    try:
        return containment(mode, f"gpupool/test-{secrets.token_hex(4)}", tmp_path)
    except CgroupError as exc:
        pytest.skip(f"no cgroup {mode} here: {exc}")


@pytest.fixture(params=["v2", "v1"])
def tree(request, tmp_path):
    made = subtree(request.param, tmp_path)
    yield made
    for name in made.names():
        group = made.find(name)
        group.kill()
        group.remove()
    made.close()


def start_daemonizer(tmp_path: Path, group: cgroups.LeaseCgroup) -> tuple[subprocess.Popen, int]:
    """A shell in ``group`` that leaves a setsid daemon; returns (shell, daemon pid)."""
    pidfile = tmp_path / f"daemon-{group.name}.pid"
    shell = subprocess.Popen(["sh", "-c", DAEMONIZE, str(pidfile), str(pidfile)], stdin=subprocess.PIPE,
                             start_new_session=True)
    group.add(shell.pid)
    shell.stdin.write(b"go\n")
    shell.stdin.close()
    daemon = int(wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), "the daemon's pid"))
    assert os.getsid(daemon) != os.getsid(shell.pid), "the daemon left the shell's session"
    assert daemon not in {child.pid for child in psutil.Process(shell.pid).children(recursive=True)}
    return shell, daemon


def test_kill_reaches_a_double_forked_daemon_and_remove_leaves_nothing(tree, tmp_path):
    group = tree.create("lease-L-1")
    assert group.confines  # what the workers ask, never the kind's name
    assert tree.names() == ["lease-L-1"] and tree.find("lease-L-1") is not None
    shell, daemon = start_daemonizer(tmp_path, group)
    assert group.pids() == {shell.pid, daemon}
    assert group.kill() == []
    assert not alive(daemon) and shell.wait(5) == -signal.SIGKILL
    group.remove()
    assert tree.names() == [] and tree.find("lease-L-1") is None
    group.remove()  # gone already: no error


def test_remove_refuses_while_processes_remain(tree, tmp_path):
    group = tree.create("lease-L-2")
    shell, daemon = start_daemonizer(tmp_path, group)
    with pytest.raises(CgroupError, match="still in it"):
        group.remove()
    group.kill()
    shell.wait(5)
    group.remove()


def test_create_kills_a_stale_cgroup_of_the_same_name(tree, tmp_path):
    shell, daemon = start_daemonizer(tmp_path, tree.create("warm-stale"))
    fresh = tree.create("warm-stale")
    assert fresh.pids() == set() and not alive(daemon)
    shell.wait(5)


def test_v2_without_cgroup_kill_freezes_and_kills(tmp_path, monkeypatch):
    tree = subtree("v2", tmp_path)
    try:
        group = tree.create("lease-L-old-kernel")
        shell, daemon = start_daemonizer(tmp_path, group)
        real_exists = Path.exists
        monkeypatch.setattr(Path, "exists", lambda self: self.name != "cgroup.kill" and real_exists(self))
        assert group.kill() == []
        monkeypatch.undo()
        assert not alive(daemon) and shell.wait(5) == -signal.SIGKILL
        assert (group.path / "cgroup.freeze").read_text().strip() == "0", "thawed again"
        group.remove()
    finally:
        tree.close()


def test_limits_are_written_where_the_controllers_are(tmp_path):
    tree = subtree("v1", tmp_path)
    try:
        group = tree.create("lease-L-limits")
        group.set_limits(cpu=1.5, memory=512 * 2**20)
        assert int((group.paths["memory"] / "memory.limit_in_bytes").read_text()) == 512 * 2**20
        assert (group.paths["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "150000"
        group.remove()
    finally:
        tree.close()
    v2 = subtree("v2", tmp_path)
    try:
        group = v2.create("lease-L-limits")
        sleeper = subprocess.Popen(["sleep", "60"])
        group.add(sleeper.pid)
        if "memory" in (group.path / "cgroup.controllers").read_text().split():
            group.set_limits(cpu=0.5, memory=2**30)
            assert (group.path / "memory.max").read_text().strip() == str(2**30)
        elif isinstance(group, HybridCgroup) and "memory" in group.v1.paths:
            # A hybrid host: the v1 hierarchies hold the limits, and the worker's processes move there.
            group.set_limits(cpu=0.5, memory=2**30)
            assert int((group.v1.paths["memory"] / "memory.limit_in_bytes").read_text()) == 2**30
            assert (group.v1.paths["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
            assert sleeper.pid in {int(p) for p in (group.v1.paths["memory"] / "cgroup.procs").read_text().split()}
        else:
            with pytest.raises(CgroupError, match="memory controller is not enabled .*Delegate=yes"):
                group.set_limits(memory=2**30)
        group.kill()
        sleeper.wait()
        group.remove()
        assert not any(path.exists() for path in getattr(getattr(group, "v1", None), "paths", {}).values())
    finally:
        v2.close()


def test_auto_picks_v2_then_v1_then_none_with_the_reasons(tmp_path, caplog):
    if os.geteuid() != 0:
        pytest.skip("making cgroups needs root")
    mounts = read_mounts()
    expected = "v2" if any(m.fstype == "cgroup2" for m in mounts) else "v1"
    made = containment("auto", f"gpupool/test-{secrets.token_hex(4)}", tmp_path)
    assert made.mode == expected
    made.close()
    fake = tmp_path / "mounts"
    fake.write_text("proc /proc proc rw 0 0\n")
    with caplog.at_level(logging.WARNING, "gpupool.agent"):
        none = containment("auto", "", tmp_path, mounts=fake)
    assert isinstance(none, NoContainment)
    [record] = [r for r in caplog.records if "NO CGROUP CONTAINMENT" in r.getMessage()]
    assert "v2: no cgroup2 file system is mounted" in record.getMessage()
    assert "v1: the v1 freezer controller is not mounted" in record.getMessage()
    with pytest.raises(CgroupError, match="cgroup v2 containment is not available: no cgroup2"):
        containment("v2", "", tmp_path, mounts=fake)


def test_mode_none_warns_once_and_misses_a_daemon_in_a_session_of_its_own(tmp_path, caplog):
    """The documented weaker mode: the process group and tree die, a daemon
    that left both does not."""
    with caplog.at_level(logging.WARNING, "gpupool.agent"):
        none = containment("none", "", tmp_path)
        group = none.create("lease-L-none")
        assert not group.confines
        shell, daemon = start_daemonizer(tmp_path, group)
        assert group.pids() == {shell.pid}, "the daemon is out of its sight"
        assert group.kill() == []
        none.create("lease-L-other")
    try:
        assert shell.wait(5) == -signal.SIGKILL
        assert alive(daemon), "without a cgroup, a double-forked daemon outlives the kill"
        warnings = [r for r in caplog.records if "NO CGROUP CONTAINMENT" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        assert "cgroup_mode = 'none'" in warnings[0].getMessage()
    finally:
        os.kill(daemon, signal.SIGKILL)
    with pytest.raises(CgroupError, match="cgroup_mode = 'none'"):
        group.set_limits(memory=2**30)


def test_mounts_and_own_cgroups_are_parsed(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("cgroup2 /sys/fs/cgroup/uni\\040fied cgroup2 rw,nsdelegate 0 0\n"
                      "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\n"
                      "tmpfs /run tmpfs rw 0 0\n")
    found = read_mounts(mounts)
    assert [(str(m.path), m.fstype) for m in found] == [("/sys/fs/cgroup/uni fied", "cgroup2"),
                                                       ("/sys/fs/cgroup/cpu,cpuacct", "cgroup")]
    assert "cpuacct" in found[1].options
    own = tmp_path / "cgroup"
    own.write_text("4:memory:/a/b\n2:cpu,cpuacct:/\n1:name=systemd:/s\n0::/system.slice/x.service\n")
    assert own_cgroups(own) == {"memory": "/a/b", "cpu": "/", "cpuacct": "/", "name=systemd": "/s",
                                "": "/system.slice/x.service"}


def test_the_root_is_under_the_agents_cgroup_and_cannot_leave_the_mount(tmp_path):
    mount = tmp_path / "cg"  # not a cgroup file system: the error names the path it made
    mounts = tmp_path / "mounts"
    mounts.write_text(f"cgroup2 {mount} cgroup2 rw 0 0\n")
    own = tmp_path / "cgroup"
    own.write_text("0::/system.slice/agent.service\n")
    with pytest.raises(CgroupError, match=f"leads out of {mount}"):
        containment("v2", "../../..", tmp_path, mounts=mounts, self_cgroup=own)
    # Relative: under the agent's own cgroup; with the default, a subtree of this state dir.
    with pytest.raises(CgroupError, match=f"{mount}/system.slice/agent.service/gpupool/agent-[0-9a-f]{{12}} has "
                                          "neither cgroup.kill nor cgroup.freeze"):
        containment("v2", "", tmp_path, mounts=mounts, self_cgroup=own)
    with pytest.raises(CgroupError, match=f"{mount}/workers has neither"):
        containment("v2", "/workers", tmp_path, mounts=mounts, self_cgroup=own)
    assert default_root(tmp_path) == default_root(f"{tmp_path}/./")


def test_a_kill_without_waiting_still_kills(tree, tmp_path):
    """``kill(timeout=0)`` (a worker found dead, on the event loop) sends the
    kill and returns; the processes die without anyone waiting."""
    group = tree.create("lease-L-now")
    shell, daemon = start_daemonizer(tmp_path, group)
    group.kill(timeout=0.0)
    wait_until(lambda: not alive(daemon) and shell.poll() is not None, "the kill to land")
    group.remove()


# Waits for a line on stdin (the test puts it in the cgroup first), then touches 128 MiB, page by page.
OVERFILL = "import sys; sys.stdin.readline(); b = bytearray(128 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1"


def test_each_kind_counts_the_oom_kills_of_its_memory_limit(tree):
    """A process past its cgroup's memory limit is killed by the kernel, and
    the cgroup says so; one killed by anyone else is no OOM kill."""
    over, other = tree.create("lease-L-oom"), tree.create("lease-L-sigkill")
    for group in (over, other):
        try:
            group.set_limits(memory=64 * 2**20)
        except CgroupError as exc:
            pytest.skip(f"no memory controller here: {exc}")
    hog = subprocess.Popen([sys.executable, "-c", OVERFILL], stdin=subprocess.PIPE)
    sleeper = subprocess.Popen(["sleep", "60"])
    # Hybrid hosts move processes to the v1 memory cgroup when limits are set: add first, then limit again.
    for group, proc in ((over, hog), (other, sleeper)):
        group.add(proc.pid)
        group.set_limits(memory=64 * 2**20)
    assert over.oom_kills() == 0 and other.oom_kills() == 0
    hog.stdin.write(b"go\n")
    hog.stdin.close()
    assert hog.wait(30) == -signal.SIGKILL
    sleeper.kill()
    sleeper.wait()
    assert over.oom_kills() == 1 and other.oom_kills() == 0
    for group in (over, other):
        group.remove()


def test_no_cgroup_cannot_tell_an_oom_kill(tmp_path, caplog):
    group = NoContainment("a test", logging.getLogger("test")).create("lease-L-none")
    assert group.oom_kills() is None


# Counts up in a file, forever, from a process and a setsid daemon of its own.
COUNTER = ("import os, sys, time\npath = sys.argv[1]\nif os.fork() == 0:\n    os.setsid(); path += '.daemon'\n"
           "n = 0\nwhile True:\n    n += 1\n"
           "    open(path + '.tmp', 'w').write(str(n)); os.replace(path + '.tmp', path)\n"
           "    time.sleep(0.01)\n")


def counts(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def start_counter(tmp_path: Path, group: cgroups.LeaseCgroup) -> tuple[subprocess.Popen, list[Path]]:
    """A counting process (and its setsid daemon) in ``group``, both counting already."""
    path = tmp_path / f"count-{group.name}"
    gate = subprocess.Popen([sys.executable, "-c", "import sys, os; sys.stdin.readline(); os.execv(sys.executable, "
                             f"[sys.executable, '-c', {COUNTER!r}, {str(path)!r}])"], stdin=subprocess.PIPE,
                            start_new_session=True)
    group.add(gate.pid)
    gate.stdin.write(b"go\n")
    gate.stdin.close()
    files = [path, path.with_name(path.name + ".daemon")]
    wait_until(lambda: all(counts(f) > 2 for f in files), "both processes counting")
    return gate, files


def test_freeze_stops_every_process_where_it_is_and_thaw_lets_them_go_on(tree, tmp_path):
    group = tree.create("lease-L-freeze")
    shell, files = start_counter(tmp_path, group)
    assert not group.frozen()
    group.freeze()
    assert group.frozen() and tree.find("lease-L-freeze").frozen(), "the kernel keeps the state"
    before = [counts(f) for f in files]
    time.sleep(0.4)
    assert [counts(f) for f in files] == before, "a frozen process ran"
    assert len(group.pids()) == 2 and shell.pid in group.pids(), "frozen, still in their cgroup"
    group.thaw()
    assert not group.frozen()
    wait_until(lambda: all(counts(f) > b + 3 for f, b in zip(files, before)), "both counting again")
    group.kill()
    shell.wait(5)
    group.remove()


def test_a_frozen_cgroup_is_killed_and_limits_set_while_frozen_hold_after_the_thaw(tree):
    group = tree.create("lease-L-frozen-limits")
    hog = subprocess.Popen([sys.executable, "-c", OVERFILL], stdin=subprocess.PIPE)
    group.add(hog.pid)
    group.freeze()
    try:
        group.set_limits(memory=64 * 2**20)  # what a resume does before it thaws
    except CgroupError as exc:
        group.thaw()
        hog.kill()
        pytest.skip(f"no memory controller here: {exc}")
    group.add(hog.pid)  # hybrid: set_limits moved it to the v1 memory cgroup
    hog.stdin.write(b"go\n")
    hog.stdin.close()
    time.sleep(0.3)
    assert hog.poll() is None, "frozen: it cannot even read its stdin"
    group.thaw()
    assert hog.wait(30) == -signal.SIGKILL and group.oom_kills() == 1
    sleeper = subprocess.Popen(["sleep", "60"])
    group.add(sleeper.pid)
    group.freeze()
    assert group.kill() == [] and sleeper.wait(5) == -signal.SIGKILL, "a frozen cgroup dies at once"
    group.remove()


def test_without_a_cgroup_freeze_is_sigstop_of_the_process_tree(tmp_path, caplog):
    group = NoContainment("a test", logging.getLogger("test")).create("lease-L-stop")
    assert "SIGSTOP" in group.freeze_method
    shell, files = start_counter(tmp_path, _Adding(group))
    group.freeze()
    assert group.frozen() and psutil.Process(shell.pid).status() == psutil.STATUS_STOPPED
    before = [counts(f) for f in files]
    time.sleep(0.4)
    assert [counts(f) for f in files] == before, "its child (a session of its own, still its child) stopped too"
    group.thaw()
    wait_until(lambda: all(counts(f) > b + 3 for f, b in zip(files, before)), "counting again")
    group.kill()
    shell.wait(5)
    for proc in psutil.process_iter(["cmdline"]):
        if str(files[0]) in " ".join(proc.info["cmdline"] or ()):
            proc.kill()


class _Adding:
    """A GroupOnly whose ``add`` happens after the start (it has no start gate), for :func:`start_counter`."""

    def __init__(self, group) -> None:
        self.group, self.name = group, group.name

    def add(self, pid: int) -> None:
        self.group.add(pid)
