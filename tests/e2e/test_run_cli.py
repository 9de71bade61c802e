"""``gpupool run`` against a real service and agent (simulated GPUs): a
script's output, argv, stdin and exit status come through as with
``python script.py``; the lease is batch and released; a full pool makes it
wait or refuses it; Ctrl-C interrupts the remote script. Bad arguments:
tests/service/test_bad_input.py's CLI table."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from procs import start_agent, start_service

from gpupool.api import ServiceClient
from gpupool.run_cli import ScriptRun
from gpupool.schema import LeaseState
from gpupool.wire.leases import LeaseRequest

GPUPOOL = Path(sys.executable).with_name("gpupool")

SCRIPT = """\
import sys
print("argv", sys.argv[1:], __name__, __file__.endswith("job.py"))
print("to stderr", file=sys.stderr)
print("back on stdout")
print("hello", input("name? "))
if "--raise" in sys.argv:
    def fail():
        return 1 / 0
    fail()
if "--exit" in sys.argv:
    sys.exit(3)
"""

LOOP = """\
import sys, time
print("started", flush=True)
try:
    time.sleep(60)
except KeyboardInterrupt:
    print("caught", flush=True)
    if "--stubborn" in sys.argv:
        time.sleep(60)
    raise
"""

# Counts wall-clock ticks: a frozen script misses some, an interrupted one would never print "done".
TICKS = """\
import time
start = time.time()
print("started", flush=True)
for i in range(150):
    time.sleep(0.1)
print("done", i, time.time() - start > 15, flush=True)
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A service (requests may queue 10 min) and one agent with two simulated GPUs: ``(service, scripts folder)``."""
    root = tmp_path_factory.mktemp("run")
    service = start_service(root, config={"max_wait": "10m"})
    agent = start_agent(root, service)
    (root / "job.py").write_text(SCRIPT)
    (root / "loop.py").write_text(LOOP)
    try:
        yield service, root
    finally:
        agent.stop()
        service.stop()


@pytest.fixture
def env(pool):
    service, _ = pool
    return {**os.environ, "GPUPOOL_URL": service.url, "GPUPOOL_TOKEN": service.user_token}


def run(env, *args: str, stdin: str = "", timeout: float = 60) -> subprocess.CompletedProcess:
    """``gpupool run ARGS`` to its end; stderr merged into stdout, in order."""
    return subprocess.run([str(GPUPOOL), "run", *args], env=env, input=stdin, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def lease_of(output: str, pool):
    """The lease the run's ``running ... on L-...`` line names, as the service has it now."""
    found = re.search(r"running \S+ on (L-[0-9a-f]+)", output)
    assert found, output
    return pool[0].client().get_lease(found.group(1))


@contextmanager
def looping_run(pool, env, name: str, *args: str):
    """``gpupool run loop.py ARGS`` with its output in ``NAME.log``: ``(process, log path)`` once the
    script said it started; the process is killed on the way out, whatever happened."""
    log = pool[1] / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(GPUPOOL), "run", str(pool[1] / "loop.py"), *args], env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        assert until(lambda: "started" in log.read_text(), 30), log.read_text()
        yield proc, log
    finally:
        proc.kill()


def until(predicate, timeout: float) -> bool:
    """Whether ``predicate()`` came true within ``timeout`` seconds (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def assert_nothing_held(pool) -> None:
    assert until(lambda: not pool[0].client().list_leases(), 10), pool[0].client().list_leases()


def test_a_script_runs_as_main_with_its_argv_stdin_and_output_in_order(pool, env):
    done = run(env, "--gpus", "0.5", str(pool[1] / "job.py"), "a", "b c", stdin="ann\n")
    assert done.returncode == 0, done.stdout
    lines = done.stdout.splitlines()
    body = [line for line in lines if not line.startswith("gpupool:")]
    assert body == ["argv ['a', 'b c'] __main__ True", "to stderr", "back on stdout", "name? hello ann"], lines
    assert lines[-1].startswith("gpupool: released L-"), lines
    lease = lease_of(done.stdout, pool)
    assert (lease.lease_class, lease.fraction, lease.state) == ("batch", 0.5, LeaseState.released)
    assert_nothing_held(pool)


def test_a_jupyterhub_terminal_runs_with_its_own_hub_token(pool, env):
    """A single-user server's terminal has GPUPOOL_URL and JUPYTERHUB_API_TOKEN but no GPUPOOL_TOKEN:
    the command sends the hub token, as a kernel does (the standalone service takes any token it knows)."""
    hub_terminal = {k: v for k, v in env.items() if k != "GPUPOOL_TOKEN"}
    hub_terminal["JUPYTERHUB_API_TOKEN"] = env["GPUPOOL_TOKEN"]
    done = run(hub_terminal, "--gpus", "0.25", str(pool[1] / "job.py"), stdin="hub\n")
    assert done.returncode == 0, done.stdout
    assert "name? hello hub" in done.stdout.splitlines(), done.stdout
    assert_nothing_held(pool)


def test_the_script_runs_in_the_folder_it_was_run_from(pool, env, tmp_path):
    """As a notebook's worker does: the node sees this folder (one host here), so the script runs
    there, not in the worker's home, and the start line names no other folder."""
    (tmp_path / "data.txt").write_text("found\n")
    (tmp_path / "where.py").write_text("import os\nprint(os.getcwd())\nprint(open('data.txt').read().strip())\n")
    done = subprocess.run([str(GPUPOOL), "run", "--gpus", "0.25", "where.py"], env=env, cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert done.returncode == 0, done.stdout
    body = [line for line in done.stdout.splitlines() if not line.startswith("gpupool:")]
    assert body == [str(tmp_path), "found"], done.stdout
    start, = [line for line in done.stdout.splitlines() if line.startswith("gpupool: running where.py on ")]
    assert "; in " not in start, start
    assert_nothing_held(pool)


@pytest.mark.parametrize("flag, status, tail", [
    ("--raise", 1, ["    fail()", "  File \"{path}\", line 8, in fail", "    return 1 / 0", "ZeroDivisionError: division by zero"]),
    ("--exit", 3, ["name? hello bob"]),
])
def test_exit_status_is_the_scripts(pool, env, flag, status, tail):
    path = str(pool[1] / "job.py")
    done = run(env, "--interactive", path, flag, stdin="bob\n")
    assert done.returncode == status, done.stdout
    body = [line for line in done.stdout.splitlines() if not line.startswith("gpupool:")]
    expected = [line.format(path=path) for line in tail]
    assert [line for line in body if "~" not in line and "^" not in line][-len(tail):] == expected, body
    if flag == "--raise":
        assert "Traceback (most recent call last):" in body and f'  File "{path}", line 9, in <module>' in body
        assert "gpupool" not in "\n".join(body)  # the script's frames only, as Python prints them
    assert lease_of(done.stdout, pool).lease_class == "interactive"
    assert_nothing_held(pool)


def test_a_full_pool_refuses_or_makes_it_wait(pool, env):
    client = pool[0].client()
    holders = [client.create_lease(LeaseRequest(fraction=1.0)) for _ in range(2)]
    try:
        refused = run(env, "--wait", "0", str(pool[1] / "job.py"))
        assert refused.returncode == 2, refused.stdout
        assert refused.stdout.startswith("gpupool run: no GPU can take 1.00"), refused.stdout
        assert "Traceback" not in refused.stdout
        assert sorted(lease.id for lease in client.list_leases()) == sorted(lease.id for lease in holders)
        log = pool[1] / "waiting.log"
        with open(log, "w") as out:
            waiting = subprocess.Popen([str(GPUPOOL), "run", "--wait", "5m", str(pool[1] / "job.py")], env=env,
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        assert until(lambda: "queued (batch): 1st in line" in log.read_text(), 20), log.read_text()
        client.release(holders.pop().id)
        assert waiting.wait(60) == 1  # it ran: input() met the end of stdin, as python's would
        text = log.read_text()
        assert lease_of(text, pool).lease_class == "batch"
        # As Python says it: no frames of ipykernel's input(), the end of stdin in its words
        assert text.splitlines()[-2] == "EOFError: EOF when reading a line", text
        assert "ipykernel" not in text and '    print("hello", input("name? "))' in text, text
    finally:
        for lease in holders:
            client.release(lease.id)
    assert_nothing_held(pool)


@pytest.mark.parametrize("stubborn", [False, True], ids=["interrupted", "interrupted-twice"])
def test_ctrl_c_interrupts_the_script_and_releases(pool, env, stubborn):
    with looping_run(pool, env, f"loop-{stubborn}", *(["--stubborn"] * stubborn)) as (proc, log):
        proc.send_signal(signal.SIGINT)
        if stubborn:
            assert until(lambda: "caught" in log.read_text(), 10), log.read_text()
            time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 130
    text = log.read_text()
    assert "caught" in text and ("gpupool: interrupted twice" in text) == stubborn, text
    assert ("KeyboardInterrupt" in text) != stubborn, text
    assert lease_of(text, pool).state is LeaseState.released
    assert_nothing_held(pool)


def test_sigterm_twice_as_timeout_sends_it_releases_without_a_traceback(pool, env):
    # `timeout` and process managers send SIGTERM to the process and to its group: the second one lands
    # while the lease is being released, and must neither end the run with a traceback nor leave the lease.
    with looping_run(pool, env, "term") as (proc, log):
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while "stopped by SIGTERM" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signal.SIGTERM)  # while it releases
        assert proc.wait(20) == 128 + signal.SIGTERM, log.read_text()
    text = log.read_text()
    assert "Traceback" not in text and "gpupool: released L-" in text, text
    assert lease_of(text, pool).state is LeaseState.released
    assert_nothing_held(pool)


def test_a_worker_killed_mid_run_ends_it_with_the_leases_words(pool, env):
    # The heartbeat beats every busy_interval (2 s) while work runs, also when the work starts just after a
    # beat: sleeping out the idle interval (up to 15 s) would let the worker's silence (10 s) come first.
    with looping_run(pool, env, "killed") as (proc, log):
        lease = lease_of(log.read_text(), pool)
        os.kill(lease.worker["pid"], signal.SIGKILL)
        assert proc.wait(30) == 2, log.read_text()
    text = log.read_text()
    assert f"lease {lease.id} failed: the worker process was killed by signal 9" in text, text
    assert "stopped answering" not in text and "Traceback" not in text, text
    assert_nothing_held(pool)


def test_the_preemptible_help_says_what_happens():
    """Frozen where it is and resumed with everything kept (README), not 'given back'; the setting's help too."""
    from gpupool.hub_plugin.config import PoolPressure

    shown = subprocess.run([str(GPUPOOL), "run", "--help"], stdout=subprocess.PIPE, text=True, timeout=60).stdout
    words = " ".join(shown[shown.index("--preemptible"):].split())
    assert "frozen where it is and resumed later with everything kept" in words and "given back" not in words, shown
    setting = " ".join(PoolPressure.class_traits()["allow_preemption"].help.split())
    assert "running cell frozen where it is, and resumed later with everything kept" in setting, setting


def test_a_preempted_script_is_told_of_its_park_and_resume_and_goes_on(tmp_path):
    root = tmp_path
    service = start_service(root, tokens={"ann": "ann-token-" + "6" * 16},
                            config={"pressure_grace": 2.0, "preemption_notice": 1.0, "idle_warning": 0})
    agent = start_agent(root, service, simulate="1xA100-80GB")
    (root / "ticks.py").write_text(TICKS)
    env = {**os.environ, "GPUPOOL_URL": service.url, "GPUPOOL_TOKEN": service.user_token}
    log = root / "ticks.log"
    ann = service.client("ann")
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen([str(GPUPOOL), "run", "--preemptible", str(root / "ticks.py")], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        assert until(lambda: "started" in log.read_text(), 60), log.read_text()
        waiter = ann.create_lease(LeaseRequest(fraction=1.0, wait=120))
        assert waiter.state is LeaseState.queued, waiter
        assert until(lambda: "was parked" in log.read_text(), 60), log.read_text()
        assert until(lambda: ann.get_lease(waiter.id).state is LeaseState.active, 60), ann.get_lease(waiter.id)
        ann.release(waiter.id)
        assert proc.wait(timeout=120) == 0, log.read_text()
        said = log.read_text()
        lease_id = lease_of(said, (service,)).id
        assert re.search(rf"gpupool: lease {lease_id} was parked \(.+\): the script is frozen where it is on "
                         r"node-1 and goes on when the pool resumes the lease", said), said
        # As the notebook says it (gpupool.tables.resumed_words): where it runs again and for how long it was parked
        assert re.search(rf"gpupool: resumed {lease_id} on node-1 GPU 0 \(parked \d+s\); the script goes on", said), said
        assert "done 149 True" in said, said  # every tick, past the freeze
    finally:
        if "proc" in locals():
            proc.kill()
        agent.stop()
        service.stop()


class _CtrlCAt(ServiceClient):
    """A real client that sends this process a real SIGINT (a Ctrl-C) just before or just after
    the service answers the release: the two sides of the moment the release goes through."""

    def __init__(self, service, when: str) -> None:
        super().__init__(service.url, service.user_token, timeout=30)
        self.when = when

    def release(self, lease_id: str, reason: str | None = None):
        if self.when == "before":
            os.kill(os.getpid(), signal.SIGINT)
        released = super().release(lease_id, reason=reason)
        if self.when == "after":
            os.kill(os.getpid(), signal.SIGINT)
        return released


@pytest.mark.parametrize("when", ["before", "after"])
def test_ctrl_c_while_releasing_says_what_is_true(pool, env, capsys, when):
    """A Ctrl-C after the release went through says it was released, nothing alarming; one before it
    says that the lease may still be held, how to see it and when the service reclaims it."""
    service = pool[0]
    client = _CtrlCAt(service, when)
    lease = service.client().create_lease(LeaseRequest(fraction=0.25))
    run = ScriptRun(client, LeaseRequest(fraction=0.25), "job.py", "", [])
    run.lease = lease
    run._release()  # never raises: the Ctrl-C is said, not re-raised
    said = capsys.readouterr().err
    held = service.client().get_lease(lease.id)
    if when == "after":
        assert held.state is LeaseState.released, held
        assert f"gpupool: released {lease.id}" in said and "may" not in said and "reclaim" not in said, said
    else:
        assert held.state is not LeaseState.released, held
        assert f"interrupted before {lease.id} was released: it may still be held" in said, said
        assert "gpupool status" in said and "heartbeats stopped" in said, said
        service.client().release(lease.id)
    assert_nothing_held(pool)
