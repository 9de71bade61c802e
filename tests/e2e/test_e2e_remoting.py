"""The remoting client through a real notebook kernel: every output
kind, bounded output, the namespace following the user, devices remembered
across release, ``%%gpu`` on a lease of its own, version checks.

The pool fixtures come from test_e2e_notebook (a service with a 3 s heartbeat
TTL and one agent with two simulated A100s, shared by this module).
"""

from __future__ import annotations

import re
import time

import pytest

from frontend import run
from frontend import STAND_IN, busy_seen, remote_value
from service_api import active_leases, ended_lease
from gpupool.heartbeat import beat_interval
from gpupool.magics.namespace import local_candidates, names_read
from gpupool.transfer import version_mismatches
from procs import wait_for

# -- pure parts ------------------------------------------------------------------


def test_names_read_finds_globals_a_cell_uses_and_skips_locals_and_builtins():
    cell = ("y = x + 1\ndef f(a):\n    return a + z\nprint(f(y))\nclass C:\n    k = m\n"
            "[i * n for i in r]\n%time q\n")
    assert set(names_read(cell)) == {"x", "z", "m", "n", "r"}, "y and f: the cell binds them before it reads them"
    assert set(names_read("%%time\nk + 1")) == {"k"}, "a cell magic's body is read too"
    assert names_read("def broken(:") == []


@pytest.mark.parametrize(("cell", "read"), [
    ("X = np.ones(3); print(X)", ["np"]),  # the cell's own X: a local X of that name is not sent
    ("def f(): return 1\nf()", []),
    ("X = X + 1", ["X"]),  # read before it is bound
    ("X += 1", ["X"]),
    ("def g():\n    global X\n    X += 1\ng()", ["X"]),
    ("X = 1\nX += 1", []),
    ("if c:\n    X = 1\nprint(X)", ["c", "X"]),  # the if may not bind it
    ("for i in r:\n    pass\nprint(i)", ["i", "r"]),
    ("def f(): return X\nX = 1\nf()", ["X"]),  # read in a body defined before X is bound: sent
    ("a, *b = 1, 2, 3\nprint(a, b, c)", ["c"]),
    ("a[0] = 1", ["a"]),
])
def test_names_read_leaves_out_what_the_cell_binds_before_it_reads_it(cell, read):
    assert names_read(cell) == read


def test_local_candidates_leave_out_private_hidden_and_shell_names():
    user_ns = {"x": 1, "_y": 2, "In": [], "get_ipython": print, "hid": 3}
    assert local_candidates("x + _y + In[0] + hid + nowhere\nget_ipython()", user_ns, {"hid": 3}) == ["x"]


@pytest.mark.parametrize(("cell", "read"), [
    ("total = 0", []),  # no local name in the text: nothing is parsed, nothing read
    ("print('df')", []),  # in the text, but in a string: parsed, not read
    ("%%time\nmodel(df)", ["model", "df"]),  # a cell magic's body is read
    ("dfx = 1\nprint(dfx)", []),  # df is a part of another name only
    ("größe * 2", ["größe"]),  # a name that is no ASCII word
])
def test_local_candidates_read_only_cells_that_name_a_local_value(cell, read):
    assert local_candidates(cell, {"df": 1, "model": print, "größe": 2}, {}) == read


def test_version_mismatches_name_what_differs_and_ignore_patch_levels():
    here = {"python": "3.11.9", "numpy": "2.4.6", "cloudpickle": "3.1.1", "torch": "2.13.0", "pandas": "2.2.0"}
    there = {"python": "3.11.2", "numpy": "1.26.4", "cloudpickle": "3.1.0", "torch": "2.13.1+cu124"}
    assert version_mismatches(here, there) == ["cloudpickle 3.1.1 here, 3.1.0 on the worker",
                                               "numpy 2.4.6 here, 1.26.4 on the worker"]
    assert version_mismatches(here, here) == []


# -- through a real kernel ---------------------------------------------------------


OUTPUT_KINDS = """\
import sys
from IPython.display import HTML, Markdown, clear_output, display
print('first')
handle = display(HTML('<i>v1</i>'), display_id=True)
handle.update(HTML('<i>v2</i>'))
sys.stdout.write('step 1\\rstep 2\\r'); sys.stdout.flush()
clear_output(wait=True)
print('after clear', file=sys.stderr)
Markdown('**done**')
"""


def test_each_output_kind_arrives_in_order_with_display_handles(kernel):
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25").ok
    cell = run(kc, OUTPUT_KINDS)
    assert cell.ok, cell.text()
    assert cell.kinds == ["stream", "display_data", "update_display_data", "stream", "clear_output", "stream",
                          "execute_result"], cell.outputs
    shown, updated = cell.outputs[1][1], cell.outputs[2][1]
    assert shown["data"]["text/html"] == "<i>v1</i>" and updated["data"]["text/html"] == "<i>v2</i>"
    assert shown["transient"]["display_id"] == updated["transient"]["display_id"]
    assert cell.outputs[3][1] == {"name": "stdout", "text": "step 1\rstep 2\r"}
    assert cell.outputs[4][1] == {"wait": True}
    assert cell.outputs[5][1] == {"name": "stderr", "text": "after clear\n"}
    assert cell.outputs[6][1]["data"]["text/markdown"] == "**done**"


def test_matplotlib_figure_and_pandas_table_show_as_they_would_locally(kernel):
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25").ok
    figure = run(kc, "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()")
    assert figure.ok, figure.text()
    pictures = [c for kind, c in figure.outputs if kind == "display_data" and "image/png" in c["data"]]
    assert len(pictures) == 1 and pictures[0]["data"]["text/plain"].startswith("<Figure")
    pandas = run(kc, "import importlib.util; importlib.util.find_spec('pandas') is not None")
    if pandas.outputs[-1][1]["data"]["text/plain"] != "True":
        pytest.skip("pandas is not installed")
    table = run(kc, "import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    assert table.ok and "<table" in table.outputs[-1][1]["data"]["text/html"]


def test_huge_output_is_cut_visibly(kernel):
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25").ok
    assert run(kc, "%%local\n%config GPUMagics.max_output_bytes = 65536").ok
    cell = run(kc, "print('x' * 200_000)\nfor i in range(1000):\n    print(i)\n'end'")
    assert cell.ok, cell.text()
    assert len(cell.stdout) <= 65536
    assert "passed 64.0 KiB; the rest is cut (c.GPUMagics.max_output_bytes)" in cell.stderr
    assert "of output not shown" in cell.stderr
    result, = [c for kind, c in cell.outputs if kind == "execute_result"]
    assert result["data"]["text/plain"] == "'end'", "the result still arrives"


def test_names_only_the_local_kernel_has_are_sent_along(kernel):
    _, kc = kernel
    assert run(kc, "import threading\nbase = list(range(10))\nscale = 3\nlock = threading.Lock()").ok
    assert run(kc, "%gpu acquire 0.25").ok
    uses = "print(sum(base) * scale)\ntry:\n    lock\nexcept NameError:\n    print('no lock here')"
    first = run(kc, uses)
    assert first.ok, first.text()
    note, *rest = first.stdout.splitlines()
    assert note.startswith("gpupool: sent along base (list, ") and ", scale (int, " in note
    assert rest == ["135", "no lock here"]
    assert first.stderr.startswith("gpupool: could not send lock: _thread.lock cannot be sent"), first.stderr
    assert first.stderr.count("\n") == 1, "one line per value that cannot be sent"
    again = run(kc, uses)
    assert "sent along" not in again.stdout, "the worker has them now"
    assert run(kc, "%%local\nscale = 100").ok
    assert remote_value(kc, "scale") == 100, "a %%local cell's newer value is sent again: one namespace, as if local"


def test_release_keeps_state_and_the_next_attach_puts_it_back_on_its_device(kernel):
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25").ok
    assert run(kc, STAND_IN).ok
    released = run(kc, "%gpu release")
    assert released.ok, released.text()
    assert "brought back 3 variables (on_gpu, weights, model; " in released.stdout
    assert "; on_gpu was on cuda:0), 1 module (torch), 1 class (FakeGPUArray)" in released.stdout
    assert remote_value(kc, "on_gpu.device, on_gpu.data, weights.tolist(), type(model).__name__") == (
        "cpu", [1, 2], [0.0, 1.0, 2.0, 3.0], "Linear")
    assert run(kc, "%gpu acquire 0.25").ok
    back = run(kc, "import os\n(on_gpu.device, on_gpu.data, weights.device.type, float(weights.sum()), "
                   "os.environ['GPUPOOL_LEASE_ID'][:2])")
    assert back.ok, back.text()
    assert "sent along on_gpu (FakeGPUArray" in back.stdout
    assert eval(back.outputs[-1][1]["data"]["text/plain"]) == ("cuda:0", [1, 2], "cpu", 6.0, "L-")  # noqa: S307


def test_gpu_cell_runs_on_a_lease_of_its_own_and_brings_variables_back(e2e_pool, kernel):
    service, _, _ = e2e_pool
    _, kc = kernel
    local_pid = remote_value(kc, "import os; seed = 21; os.getpid()")
    cell = run(kc, "%%gpu 0.5\nimport os\nworker_pid = os.getpid()\nresult = seed * 2\nprint('on', os.environ['GPUPOOL_LEASE_ID'][:2])")
    assert cell.ok, cell.text()
    assert "gpupool: sent along seed (int" in cell.stdout and "on L-" in cell.stdout
    assert "gpupool: released L-" in cell.stdout and "brought back" in cell.stdout
    worker_pid, result, pid = remote_value(kc, "worker_pid, result, os.getpid()")
    assert result == 42 and worker_pid != local_pid and pid == local_pid
    assert active_leases(service) == []
    # As if local: the notebook's folder, and the notebook's cell number in a traceback
    failed = run(kc, "%%gpu 0.25\nimport os\nhere = os.getcwd()\nraise ValueError('boom')")
    plain = re.sub(r"\x1b\[[0-9;]*m", "", failed.text())  # IPython colours its tracebacks
    assert not failed.ok and f"Cell In[{failed.reply['execution_count']}], line 3" in plain, plain
    assert remote_value(kc, "here == os.getcwd()") is True
    # A widget of such a cell shows as its text: its comm stays on the worker, which ends with the cell.
    widget = run(kc, "%%gpu 0.25\nimport ipywidgets\nipywidgets.IntSlider(value=7)")
    assert widget.ok, widget.text()
    shown = [content["data"] for kind, content in widget.outputs if kind in ("display_data", "execute_result")]
    assert shown and all("application/vnd.jupyter.widget-view+json" not in data for data in shown), shown
    assert any("IntSlider(value=7)" in data.get("text/plain", "") for data in shown), shown


def test_attach_compares_versions_and_is_quiet_when_they_match(kernel):
    _, kc = kernel
    attach = run(kc, "%gpu acquire 0.25")
    assert attach.ok and "versions differ" not in attach.stderr and "could not compare" not in attach.stderr


def test_an_idle_lease_is_parked_in_place_and_the_next_cell_resumes_everything_it_held(e2e_pool, kernel):
    service, _, _ = e2e_pool
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25 --idle-timeout 4s").ok
    # What no pickle carries: a lock held, a generator half-way, an open file.
    parked_id = remote_value(kc, "import os, threading\nkept = [1, 2, 3]\nlock = threading.Lock(); lock.acquire()\n"
                            "gen = iter(range(10)); next(gen)\nnotes = open('notes.txt', 'w+'); notes.write('a')\n"
                            "pid = os.getpid()\nos.environ['GPUPOOL_LEASE_ID']")
    parked = wait_for(lambda: (lease := service.client().get_lease(parked_id)).state.value == "parked" and lease,
                      30, "the lease parked")
    assert parked.parked["tier"] == "memory", parked
    assert [lease.state.value for lease in active_leases(service)] == ["parked"]
    pool = service.client().pool()
    assert sum(gpu["allocated_fraction"] for node in pool["nodes"] for gpu in node["gpus"]) == 0, "its share is back"
    time.sleep(beat_interval(parked) + 0.5)  # the notebook kernel learns of the park at its next heartbeat
    local = run(kc, "%%local\n'kept' in globals()")
    assert f"gpupool: lease {parked_id} was parked, idle for" in local.stderr, \
        "the notice is said at the top of the next cell, not written into an old one"
    assert local.outputs[-1][1]["data"]["text/plain"] == "False", "nothing came to the notebook kernel"
    status = run(kc, "%gpu status")
    table = status.outputs[-1][1]["data"]["text/plain"]
    assert re.search(rf"{parked_id}\s+parked\s+node-1 .* parked in memory on node-1", table) and not status.stderr, table
    cell = run(kc, "print(kept + [4], lock.locked(), next(gen), notes.tell(), os.getpid() == pid, "
                   "os.environ['GPUPOOL_LEASE_ID'])")
    assert cell.ok, cell.text()
    assert re.search(rf"gpupool: resumed {parked_id} on node-1 GPU \d+ in [\d.]+s \(parked [\d.]+s\)", cell.stdout)
    assert f"[1, 2, 3, 4] True 1 1 True {parked_id}" in cell.stdout, cell.text()
    assert [lease.id for lease in active_leases(service)] == [parked_id]


def test_gpu_park_parks_now_and_release_discard_gives_up_a_parked_lease_without_resuming_it(e2e_pool, kernel):
    service, _, _ = e2e_pool
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25").ok
    lease_id = remote_value(kc, "import os\nx = 5\nos.environ['GPUPOOL_LEASE_ID']")
    parked = run(kc, "%gpu park")
    assert parked.ok and f"gpupool: lease {lease_id} was parked by its owner: its worker is frozen on node-1" \
        in parked.stdout, parked.text()
    assert service.client().get_lease(lease_id).state.value == "parked"
    again = run(kc, "print(x + 1)")
    assert f"gpupool: resumed {lease_id}" in again.stdout and "6\n" in again.stdout, again.text()
    assert run(kc, "%gpu park").ok
    gone = run(kc, "%gpu release --discard")
    assert gone.ok and "its variables were discarded" in gone.stdout and "resumed" not in gone.stdout, gone.text()
    ended = service.client().get_lease(lease_id)
    assert ended.state.value == "released" and ended.parked is None, ended
    assert "not attached" in run(kc, "%gpu status").stdout


def test_acquire_of_another_size_moves_the_variables_worker_to_worker(e2e_pool, kernel):
    """``%gpu acquire 0.5`` while on 0.25: a new lease, the variables and modules moved into its worker
    from the old worker's data plane, what cannot travel named, the old lease released; asking for what
    it holds, or for what the pool cannot give, changes nothing."""
    service, _, _ = e2e_pool
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25 --idle-timeout 10m").ok
    old = remote_value(kc, "import os, threading\nimport numpy as np\nbig = np.arange(400_000, dtype=np.float64)\n"
                      "small = 7\nlock = threading.Lock()\npid = os.getpid()\n"
                      "open('moved.txt', 'w').write('one\\ntwo\\n')\n"
                      "fh = open('moved.txt')\nfh.readline()\nos.environ['GPUPOOL_LEASE_ID']")
    same = run(kc, "%gpu acquire 0.25")
    assert not same.ok and f"already attached to {old}" in same.text(), same.text()
    refused = run(kc, "%gpu acquire 3")
    assert not refused.ok and f"still attached to {old}, nothing changed" in refused.text(), refused.text()
    moved = run(kc, "%gpu acquire 0.5")
    assert moved.ok, moved.text()
    new = re.search(rf"moved {old} to (L-\S+): 0\.50 of ", moved.stdout)
    assert new and "variables (big, small, pid, fh; 3.1 MiB)" in moved.stdout, moved.stdout
    assert "open files arrived as in-memory copies of what they held, no longer open: fh (_io.TextIOWrapper)" \
        in moved.stdout, moved.stdout
    assert "3 modules (os, threading, np)" in moved.stdout, "imported there, not pickled"
    assert "lost with the worker: 1 that cannot be pickled (lock)" in moved.stdout, moved.stdout
    shown = re.search(r"1 output \((Out\[(\d+)\]); ", moved.stdout)
    assert shown, "the cell's result went along: " + moved.stdout
    there = run(kc, "print(big.sum() == np.arange(400_000).sum(), small, 'lock' in globals(), os.getpid() != pid, "
                f"os.environ['GPUPOOL_LEASE_ID'], {shown.group(1)}, _{shown.group(2)})")
    assert there.stdout.split() == ["True", "7", "False", "True", new.group(1), old, old], there.text()
    assert [lease.id for lease in active_leases(service)] == [new.group(1)]
    assert service.client().get_lease(new.group(1)).idle_timeout == 600, "the idle timeout asked goes along"
    assert service.client().get_lease(old).state.value == "released"
    assert run(kc, "%%local\n'big' in globals()").outputs[-1][1]["data"]["text/plain"] == "False", \
        "nothing was defined in the notebook kernel"


HOLDERS = """\
from gpupool.node import simgpu
x = simgpu.zeros(64 << 20, 'uint8')
view = x[:10]
def f():
    pinned = simgpu.zeros(32 << 20, 'uint8')
    1 / 0
"""


def test_status_lists_the_names_holding_gpu_memory_and_a_park_drops_the_last_traceback(e2e_pool, kernel):
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25").ok
    assert run(kc, HOLDERS).ok
    assert "ZeroDivisionError" in run(kc, "f()").text()
    status = run(kc, "%gpu status")
    table = status.outputs[-1][1]["data"]["text/plain"]
    assert re.search(r"\nx +64\.0 MiB +simgpu:0 +ndarray\n", table), table
    assert re.search(r"\nlast traceback \(ZeroDivisionError; frames of Cell In\[\d+\], Cell In\[\d+\]\) +32\.0 MiB "
                     r"+simgpu:0 +traceback\n", table), table
    assert re.search(r"\nview +in x +simgpu:0 +ndarray", table), "a view is x's memory, counted once"
    parked = run(kc, "%gpu park")
    assert parked.ok and "; not kept: the last traceback (ZeroDivisionError; frames of Cell In[" in parked.stdout \
        and "cleared so that the memory its frames held could be freed" in parked.stdout, parked.text()
    assert "holds GPU memory" not in run(kc, "%gpu status").outputs[-1][1]["data"]["text/plain"], \
        "a parked worker is not asked (it would wake)"
    assert run(kc, "print(simgpu.memory_allocated(0) >> 20)").stdout.endswith("64\n"), "the traceback's 32 MiB freed"
    table = run(kc, "%gpu status").outputs[-1][1]["data"]["text/plain"]
    assert "last traceback" not in table and re.search(r"\nx +64\.0 MiB", table), table
    assert run(kc, "%gpu release --discard").ok


def test_on_idle_release_opts_out_of_parking(e2e_pool, kernel):
    service, _, _ = e2e_pool
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25 --idle-timeout 2s --on-idle release").ok
    lease, = active_leases(service)
    ended = ended_lease(service, lease.id, 30, "idle reclaim")
    assert ended.state.value == "reclaimed" and "idle" in ended.reason


def test_a_worker_deaf_to_interrupts_is_named_and_restart_gives_a_fresh_one(e2e_pool, kernel):
    service, _, _ = e2e_pool
    km, kc = kernel
    assert run(kc, "%gpu acquire 0.25").ok
    old_pid = remote_value(kc, "import os; os.getpid()")
    msg_id = kc.execute("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(600)")
    wait_for(lambda: busy_seen(kc, msg_id), 10, "the deaf cell started")
    km.interrupt_kernel()
    reply = _reply_to(kc, msg_id, 60)
    assert reply["status"] == "error" and "did not stop within 10s" in reply["evalue"], reply
    assert "%gpu restart gives you a fresh worker" in reply["evalue"]
    restarted = run(kc, "%gpu restart")
    assert restarted.ok, restarted.text()
    assert "restarted: released L-" in restarted.stdout
    assert remote_value(kc, "import os; os.getpid()") != old_pid
    assert len(active_leases(service)) == 1


def _reply_to(kc, msg_id: str, timeout: float) -> dict:
    """The shell reply to ``msg_id`` (skipping replies to earlier requests)."""
    while True:
        msg = kc.get_shell_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg["content"]


def test_shell_commands_and_line_magics_in_routed_cells_run_on_the_worker(e2e_pool, kernel):
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25 --on-idle release").ok
    lease_id = remote_value(kc, "import os; os.environ['GPUPOOL_LEASE_ID']")
    shell = run(kc, "!printenv GPUPOOL_LEASE_ID CUDA_VISIBLE_DEVICES")
    assert shell.ok and shell.stdout.split()[0] == lease_id and shell.stdout.split()[1].startswith("GPU-")
    assert remote_value(kc, "%env GPUPOOL_LEASE_ID") == lease_id
    assert run(kc, "%gpu release --discard").ok
