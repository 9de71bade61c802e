"""Workers run as an unprivileged user the admin configures
(``c.AgentWorkers.worker_user``), not as the agent's user, and cannot read the
agent's credentials.

The end-to-end test needs root (the agent switches user when it starts a
worker) and creates the system user ``gpupool-test-worker`` when it is
missing; elsewhere it is skipped with that reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from workercell import run_worker_cell
from worker_account import USER, worker_account
from gpupool.node.worker_user import WorkerUser
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest
from procs import processes_mentioning, start_agent, start_service, wait_for

PROBE = """\
import json, os
def attempt(action):
    try:
        action()
        return "allowed"
    except OSError as exc:
        return type(exc).__name__
print(json.dumps({
    "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
    "home": os.environ.get("HOME"), "cwd": os.getcwd(),
    "token_file": attempt(lambda: open(TOKEN_FILE).read()),
    "state_dir": attempt(lambda: os.listdir(STATE_DIR)),
    "agent_env": attempt(lambda: open(f"/proc/{AGENT_PID}/environ", "rb").read()),
    "workers_dir": attempt(lambda: os.listdir(WORKERS_DIR)),
}))
"""


def warm_ready(agent) -> int:
    """How many warm workers the agent has said are ready (``warm worker warm-HEX ready``)."""
    return sum(" warm worker warm-" in line and " ready: pid " in line for line in agent.log.read_text().splitlines())


@pytest.mark.skipif(os.geteuid() != 0, reason="starting workers as another user needs an agent running as root")
def test_workers_run_as_the_worker_user_and_cannot_read_the_agents_token(shared_root, python_reachable):
    account = worker_account()
    service = start_service(shared_root)
    agent = start_agent(shared_root, service, extra_args=[f"--worker-user={USER}"])
    try:
        token_file = service.process.agent_token_file
        assert token_file.stat().st_uid == os.getuid() and token_file.stat().st_mode & 0o777 == 0o600
        # The lease takes the warm worker (started as the worker user too); another is started.
        wait_for(lambda: warm_ready(agent) >= 1, 60, "a warm worker", log=agent.log)
        lease = service.client().create_lease(LeaseRequest(fraction=0.5))
        lease = wait_for(lambda: (got := service.client().get_lease(lease.id)).state is not LeaseState.starting
                         and got, 60, "the lease's worker")
        assert lease.state is LeaseState.active, lease.reason
        assert psutil.Process(lease.worker["pid"]).uids().real == account.pw_uid

        code = (f"TOKEN_FILE = {str(token_file)!r}\nSTATE_DIR = {str(agent.state_dir)!r}\n"
                f"WORKERS_DIR = {str(agent.state_dir / 'workers')!r}\nAGENT_PID = {agent.proc.pid}\n{PROBE}")
        seen = json.loads(asyncio.run(run_worker_cell(lease.connection, code)))
        assert (seen["uid"], seen["euid"], seen["gid"]) == (account.pw_uid, account.pw_uid, account.pw_gid)
        assert 0 not in seen["groups"], "none of root's groups"
        assert seen["token_file"] == "PermissionError"
        assert seen["state_dir"] == seen["workers_dir"] == "PermissionError", "it may enter, not list"
        assert seen["agent_env"] == "PermissionError"
        assert seen["home"] == seen["cwd"] and Path(seen["cwd"]).stat().st_uid == account.pw_uid
        _check_workdir_rule(shared_root, lease.connection, account)

        wait_for(lambda: warm_ready(agent) >= 2, 60, "the next warm worker", log=agent.log)
        workers = processes_mentioning(f"{agent.state_dir / 'workers'}{os.sep}kernel-")
        assert len(workers) == 2 and all(psutil.Process(pid).uids().real == account.pw_uid for pid in workers)
        # Once read, the connection files (the keys) and the logs are the agent's again:
        # workers share the worker user, so none may read another's.
        for path in (agent.state_dir / "workers").iterdir():
            assert path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077 == 0, path
        assert {p.name for p in (agent.state_dir / "workers").iterdir()} >= {f"{lease.id}.lease.json"}

        released = service.client().release(lease.id)
        assert released.state is LeaseState.released
        assert not psutil.pid_exists(lease.worker["pid"]) or \
            psutil.Process(lease.worker["pid"]).status() == psutil.STATUS_ZOMBIE
    finally:
        agent.stop()  # raises if a worker process is left
        service.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="starting workers as another user needs an agent running as root")
def test_a_worker_users_lease_is_saved_to_disk_at_an_agent_restart_and_resumes(shared_root, python_reachable):
    """The worker writes its spill into the agent's spill folder as the worker user (the folder is
    0711, the lease's own 0700): an agent restarted with SIGTERM keeps the lease, and its resume
    loads the spill into a new worker of that user."""
    account = worker_account()
    service = start_service(shared_root)
    args = [f"--worker-user={USER}", "--warm-workers=0"]
    agent = start_agent(shared_root, service, extra_args=args)
    client = service.client()
    try:
        lease_id = client.create_lease(LeaseRequest(fraction=0.5)).id
        lease = wait_for(lambda: (got := client.get_lease(lease_id)).state is not LeaseState.starting and got, 60,
                         "the lease's worker")
        assert lease.state is LeaseState.active, lease.reason
        asyncio.run(run_worker_cell(lease.connection, "x = 41"))
        spills = agent.state_dir / "spill"
        assert spills.stat().st_mode & 0o777 == 0o711, "enter, not list"
        port = int(agent.url.rsplit(":", 1)[1])
        assert agent.stop() == 0
        saved = client.get_lease(lease.id)
        assert saved.state is LeaseState.parked and saved.parked["tier"] == "disk", saved.events
        assert (spills / lease.id).stat().st_uid == account.pw_uid
        agent = start_agent(shared_root, service, extra_args=args, port=port)
        client.resume(lease.id)
        resumed = wait_for(lambda: (got := client.get_lease(lease.id)).state is LeaseState.active and got, 60,
                           "the resume")
        assert psutil.Process(resumed.worker["pid"]).uids().real == account.pw_uid
        assert asyncio.run(run_worker_cell(resumed.connection, "print(x + 1)")).strip() == "42"
        client.release(lease.id)
    finally:
        agent.stop()
        service.stop()


WORKDIR_PROBE = """\
import json
from gpupool.node.worker_extension.workdir import enter_workdir
print(json.dumps([enter_workdir(OPEN, "ann"), enter_workdir(CLOSED, "ann")]))
"""


def _check_workdir_rule(root: Path, connection: dict, account) -> None:
    """The notebook's folder is used when the worker's account may enter it;
    a folder it may not enter gives the owner's scratch folder."""
    open_dir, closed_dir = root / "notebooks-shared", root / "notebooks-private"
    open_dir.mkdir(mode=0o755)
    closed_dir.mkdir(mode=0o700)
    scratch = root / "scratch"  # the node's scratch root: shared by worker accounts, like /tmp
    scratch.mkdir()
    scratch.chmod(0o1777)
    code = (f"import os\nos.environ['GPUPOOL_SCRATCH_DIR'] = {str(scratch)!r}\n"
            f"OPEN, CLOSED = {str(open_dir)!r}, {str(closed_dir)!r}\n{WORKDIR_PROBE}")
    (opened, followed), (fallback, followed_closed) = json.loads(asyncio.run(run_worker_cell(connection, code)))
    assert (opened, followed) == (str(open_dir), True)
    assert (fallback, followed_closed) == (str(scratch / "ann"), False)
    assert (scratch / "ann").stat().st_uid == account.pw_uid and (scratch / "ann").stat().st_mode & 0o777 == 0o700


def agent_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpupool.cli", "agent", "--service-url=http://127.0.0.1:1",
                           *args], capture_output=True, text=True, timeout=60, env={**os.environ,
                                                                                     "GPUPOOL_AGENT_TOKEN": "t"})


def test_an_unknown_worker_user_is_one_clear_line(tmp_path):
    result = agent_command("--worker-user=no-such-user-gpupool", f"--state-dir={tmp_path / 'agent'}",
                           "--simulate=1xA100-80GB")
    assert result.returncode != 0
    assert "there is no user 'no-such-user-gpupool' on this node" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "agent").exists(), "nothing was started or written"


@pytest.mark.skipif(os.geteuid() != 0, reason="an agent switches to another user only when it runs as root")
def test_a_setup_the_worker_user_cannot_use_is_refused_naming_the_closed_folder(tmp_path):
    """Its Python, or its state dir (here: inside a 0700 folder), must be
    reachable by the worker user; the agent refuses to start otherwise."""
    worker_account()
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    state_dir = closed / "agent"
    result = agent_command(f"--worker-user={USER}", f"--state-dir={state_dir}", "--simulate=1xA100-80GB")
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert f"worker user '{USER}' cannot" in result.stderr, result.stderr
    named = [folder for folder in [*Path(sys.executable).resolve().parents, *state_dir.parents]
             if f" {folder}" in result.stderr and folder != Path("/")]
    assert named, f"the message names the closed folder: {result.stderr}"
    assert not state_dir.exists(), "nothing was written"


# -- a pool of worker users (c.AgentWorkers.worker_users) ---------------------------------------------------------

POOL = [f"gpupool-test-w{i}" for i in range(3)]

# Run in lease A's worker: a daemon (double fork, setsid) that for 30 s looks
# for every worker's connection file on every command line (the names are
# not guessable, but /proc/PID/cmdline shows them) and tries to read it, and
# tries lease B's files and environment; it writes what it saw to PROBE_LOG.
SNOOPER = r'''
import os, subprocess, sys
code = """
import glob, json, os, sys, time
if os.fork(): sys.exit(0)
os.setsid()
if os.fork(): sys.exit(0)
print(os.getpid(), flush=True)
os.close(1)
seen = {}
def attempt(path):
    try:
        with open(path, "rb") as f:
            f.read()
        return "allowed"
    except OSError as exc:
        return type(exc).__name__
end = time.time() + 30
while time.time() < end:
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            args = open(cmdline, "rb").read().replace(b"\\0", b" ").split()  # a forked worker's title is one string
        except OSError:
            continue
        for i, arg in enumerate(args[:-1]):
            if arg == b"-f" and args[i + 1].endswith(b".json"):
                path = args[i + 1].decode()
                if path != MINE:
                    seen[path] = attempt(path)
    for path in [OTHER_HOME + "/secret.txt", f"/proc/{OTHER_PID}/environ"]:
        seen[path] = attempt(path)
    with open(PROBE_LOG + ".tmp", "w") as out:
        json.dump(seen, out)
    os.replace(PROBE_LOG + ".tmp", PROBE_LOG)
    time.sleep(0.02)
"""
out = subprocess.run([sys.executable, "-c", PREAMBLE + code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                     stderr=subprocess.DEVNULL, check=True).stdout
print(int(out))
'''


def pool_accounts() -> list[pwd.struct_passwd]:
    accounts = []
    for name in POOL:
        try:
            accounts.append(pwd.getpwnam(name))
        except KeyError:
            if shutil.which("useradd") is None:
                pytest.skip("useradd is not available to create the worker users")
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                           check=True, capture_output=True)
            accounts.append(pwd.getpwnam(name))
    return accounts


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.skipif(os.geteuid() != 0, reason="starting workers as other users needs an agent running as root")
def test_two_users_workers_on_one_node_run_as_accounts_of_their_own_and_cannot_reach_each_other(
        shared_root, python_reachable):
    accounts = {account.pw_uid: account.pw_name for account in pool_accounts()}
    service = start_service(shared_root, tokens={"bob": "bob-token-" + os.urandom(8).hex()})
    agent = start_agent(shared_root, service, extra_args=[
        "--warm-workers=1", *(f"--AgentWorkers.worker_users={name}" for name in POOL)])
    daemon = None
    try:
        first = service.client().create_lease(LeaseRequest(fraction=0.25))
        ann = wait_for(lambda: (got := service.client().get_lease(first.id)).state is not LeaseState.starting
                       and got, 60, "ann's worker")
        assert ann.state is LeaseState.active, ann.reason
        second = service.client("bob").create_lease(LeaseRequest(fraction=0.25))
        bob = wait_for(lambda: (got := service.client("bob").get_lease(second.id)).state is not LeaseState.starting
                       and got, 60, "bob's worker")
        assert bob.state is LeaseState.active, bob.reason
        ann_uid = psutil.Process(ann.worker["pid"]).uids().real
        bob_uid = psutil.Process(bob.worker["pid"]).uids().real
        assert ann_uid in accounts and bob_uid in accounts and ann_uid != bob_uid

        bob_home = asyncio.run(run_worker_cell(bob.connection, "import os\nopen('secret.txt', 'w').write('bob')\n"
                                                              "print(os.getcwd())")).strip()
        ann_home = asyncio.run(run_worker_cell(ann.connection, "import os\nprint(os.getcwd())")).strip()
        probe_log = Path(ann_home) / "probe.json"
        mine = next(arg for arg in psutil.Process(ann.worker["pid"]).cmdline() if arg.endswith(".json"))
        preamble = (f"MINE = {mine!r}\nOTHER_HOME = {bob_home!r}\nOTHER_PID = {bob.worker['pid']}\n"
                    f"PROBE_LOG = {str(probe_log)!r}\n")
        daemon = int(asyncio.run(run_worker_cell(ann.connection, f"PREAMBLE = {preamble!r}\n{SNOOPER}")))
        assert os.getsid(daemon) != os.getsid(ann.worker["pid"])
        # Bob's worker, the warm worker that replaced ann's, and a fresh warm one
        # started while the daemon watches (its file is its own account's then).
        third = service.client("bob").create_lease(LeaseRequest(fraction=0.25))
        wait_for(lambda: service.client("bob").get_lease(third.id).state is not LeaseState.starting, 60,
                 "the third lease")

        def seen_enough():
            try:
                seen = json.loads(probe_log.read_text())
            except (OSError, ValueError):
                return None
            return seen if sum(path.endswith(".json") for path in seen) >= 2 else None

        seen = wait_for(seen_enough, 30, "the daemon to find other workers' connection files")
        assert seen, "the daemon saw other workers"
        assert all(result != "allowed" for result in seen.values()), seen
        assert seen[f"{bob_home}/secret.txt"] == "PermissionError"
        assert seen[f"/proc/{bob.worker['pid']}/environ"] == "PermissionError"

        assert service.client().release(ann.id).state is LeaseState.released
        wait_for(lambda: not alive(daemon), 10, "the daemon to die with ann's lease")
        assert not probe_log.exists(), "the account's work directory is emptied before it is used again"
    finally:
        agent.stop()
        service.stop()
        if daemon is not None and alive(daemon):
            os.kill(daemon, signal.SIGKILL)


@pytest.mark.skipif(os.geteuid() != 0, reason="making files and processes of other users needs root")
def test_the_pool_hands_each_account_to_one_worker_and_takes_it_back_clean(tmp_path):
    from gpupool.node.worker_user import NoFreeWorkerUser, WorkerUserPool

    users = [WorkerUser.lookup(account.pw_name) for account in pool_accounts()]
    scratch, workdir = tmp_path / "scratch", tmp_path / "home"
    scratch.mkdir()
    workdir.mkdir()
    pool = WorkerUserPool(users, scratch=[scratch])
    taken = [pool.take() for _ in users]
    assert sorted(u.uid for u in taken) == sorted(u.uid for u in users), "each account once"
    with pytest.raises(NoFreeWorkerUser, match="all 3 worker users are in use .*c.AgentWorkers.worker_users"):
        pool.take()
    first = taken[0]
    left = scratch / "left-by-the-lease"
    left.mkdir()
    (left / "data").write_text("x")
    os.chown(left, first.uid, first.gid)
    os.chown(left / "data", first.uid, first.gid)
    kept = scratch / "someone-elses"
    kept.write_text("y")
    # A shared root the account made, in which another account has its folder,
    # and a folder of its own inside a root's (the workers' scratch folders).
    shared = scratch / "made-by-it"
    (shared / "other-owner").mkdir(parents=True)
    (shared / "its-owner").mkdir()
    os.chown(shared, first.uid, first.gid)
    os.chown(shared / "its-owner", first.uid, first.gid)
    os.chown(shared / "other-owner", taken[1].uid, taken[1].gid)
    nested = scratch / "gpupool-scratch" / "ann"
    nested.mkdir(parents=True)
    (nested / "secret").write_text("ann's")
    os.chown(nested, first.uid, first.gid)
    os.chown(nested / "secret", first.uid, first.gid)
    (workdir / "notebook-output").write_text("z")
    runner = subprocess.Popen(["sleep", "60"], **first.popen_kwargs())
    try:
        assert not pool.give_back(first, workdir), "a process still runs as it"
        assert left.exists() and first not in pool.free
    finally:
        runner.kill()
        runner.wait()
    assert pool.give_back(first, workdir)
    assert not left.exists() and kept.exists() and list(workdir.iterdir()) == []
    assert not nested.exists() and (scratch / "gpupool-scratch").exists(), "its folder in root's goes"
    assert sorted(p.name for p in shared.iterdir()) == ["other-owner"], "another account's folder stays"
    assert pool.free == [first] and pool.take() == first
    with pytest.raises(ValueError, match="one uid twice"):
        WorkerUserPool([first, first])
