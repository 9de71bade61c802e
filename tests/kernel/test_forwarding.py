"""The gpupool kernel forwards the front end's messages to the worker.

Message by message through jupyter_client, as a notebook front end speaks:
execute (one execution, on the worker; counts that agree), complete, inspect,
is_complete, comms both ways and comm_info, stdin, the debugger on the
control channel, ``%gpu`` lines inside forwarded cells, and bad messages
(an error reply where the protocol has one, else a logged warning; the
kernel keeps working). The pool fixtures come from conftest (``e2e_pool``).
"""

from __future__ import annotations

import queue
import re
import time

import pytest

from frontend import remote_value, run, start_gpupool_kernel
from gpupool.magics.kernel import GPUPoolKernel

WORKER_ONLY = "worker_only_name_4821"


def request(kc, channel: str, msg_type: str, content: dict, timeout: float = 30) -> dict:
    """Send ``msg_type`` on ``channel`` ("shell" or "control") and return its reply message."""
    msg = kc.session.msg(msg_type, content)
    getattr(kc, f"{channel}_channel").send(msg)
    get = kc.get_shell_msg if channel == "shell" else kc.get_control_msg
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = get(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            return reply
    raise AssertionError(f"no reply to {msg_type}")


def iopub_until(kc, predicate, timeout: float = 30) -> list[dict]:
    """IOPub messages until one satisfies ``predicate`` (that one included)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            continue
        seen.append(msg)
        if predicate(msg):
            return seen
    raise AssertionError(f"not seen on IOPub: {[m['msg_type'] for m in seen]}")


@pytest.fixture
def attached(kernel):
    """A gpupool notebook kernel attached to a quarter GPU, with a name only the worker has."""
    km, kc = kernel
    assert run(kc, "%gpu acquire 0.25").ok
    cell = run(kc, f"{WORKER_ONLY} = 42\ndef documented():\n    '''Says hello from the worker.'''\n")
    assert cell.ok, cell.text()
    return km, kc


def test_a_cell_runs_once_on_the_worker_and_counts_agree(attached):
    _, kc = attached
    local_pid = remote_value(kc, "%%local\nimport os; os.getpid()")
    msg_id = kc.execute("import os\nos.getpid()")
    seen = iopub_until(kc, lambda m: m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                       and m["parent_header"].get("msg_id") == msg_id)
    mine = [m for m in seen if m["parent_header"].get("msg_id") == msg_id]
    kinds = [m["msg_type"] for m in mine]
    assert kinds == ["status", "execute_input", "execute_result", "status"], kinds
    reply = kc.get_shell_msg(timeout=10)
    count = reply["content"]["execution_count"]
    inputs, result = mine[1], mine[2]
    assert inputs["content"]["execution_count"] == count == result["content"]["execution_count"]
    assert int(result["content"]["data"]["text/plain"]) != local_pid, "it ran on the worker"
    # Neither kernel runs ipykernel's shell-channel thread (gpupool.kernelapp: no subshells).
    for where in ("", "%%local\n"):
        threads = remote_value(kc, f"{where}sorted(t.name for t in __import__('threading').enumerate())")
        assert "Shell channel" not in threads, (where, threads)
    failed = run(kc, "1 / 0")
    traceback = "\n".join(c for kind, content in failed.outputs if kind == "error" for c in content["traceback"])
    assert f"Cell In[{failed.reply['execution_count']}]" in re.sub(r"\x1b\[[0-9;]*m", "", traceback)
    after = run(kc, "%%local\n1")
    assert after.reply["execution_count"] == failed.reply["execution_count"] + 1, "local numbering goes on"
    # stop_on_error, as ipykernel: a cell queued behind a failing one is aborted; one sent after the error is not.
    ids = [kc.execute("1 / 0"), kc.execute("queued = 1")]
    replies = {}
    while len(replies) < 2:
        reply = kc.get_shell_msg(timeout=30)
        replies[reply["parent_header"]["msg_id"]] = reply["content"]["status"]
    assert [replies[i] for i in ids] == ["error", "aborted"], replies
    iopub_until(kc, lambda m: m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                and m["parent_header"].get("msg_id") == ids[1])  # the aborted cell ends too
    assert run(kc, "after_error = 1").ok


def test_one_execution_count_whichever_kernel_runs_the_cell(attached):
    """%gpu-only and %%local cells run here, the others on the worker: one counter, up by one a cell."""
    _, kc = attached
    cells = ["%gpu status", "%gpu status", "print('here')", "y = 1", "%%local\n1", "%gpu status", "1 / 0",
             "%gpu push y", "y"]
    counts = []
    for code in cells:
        msg_id = kc.execute(code)
        seen = iopub_until(kc, lambda m: m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                           and m["parent_header"].get("msg_id") == msg_id)
        inputs = [m["content"]["execution_count"] for m in seen
                  if m["msg_type"] == "execute_input" and m["parent_header"].get("msg_id") == msg_id]
        reply = kc.get_shell_msg(timeout=30)
        counts.append(reply["content"]["execution_count"])
        assert inputs == [counts[-1]], (code, inputs, counts)
    assert counts == list(range(counts[0], counts[0] + len(cells))), counts
    failed = run(kc, "1 / 0")
    traceback = "\n".join(c for kind, content in failed.outputs if kind == "error" for c in content["traceback"])
    assert f"Cell In[{counts[-1] + 1}]" in re.sub(r"\x1b\[[0-9;]*m", "", traceback)
    # In[n] and Out[n] name the same cells on both sides.
    n = counts[-1] + 1
    assert remote_value(kc, f"(In[{n}], Out[{n - 1}])") == ("1 / 0", 1)
    assert remote_value(kc, f"%%local\nIn[{n}]") == "1 / 0"


def test_a_local_cell_that_raises_shows_its_traceback_once_and_fails(attached):
    """A %%local cell's error is one ``error`` output, its real traceback, and an error reply naming it."""
    _, kc = attached
    failed = run(kc, "%%local\nraise ValueError('local only')")
    errors = [content for kind, content in failed.outputs if kind == "error"]
    assert len(errors) == 1, errors
    assert (errors[0]["ename"], errors[0]["evalue"]) == ("ValueError", "local only")
    assert "local only" in "\n".join(errors[0]["traceback"])
    reply = failed.reply
    assert (reply["status"], reply["ename"], reply["evalue"]) == ("error", "ValueError", "local only")
    assert reply["traceback"] == errors[0]["traceback"]
    plain = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(errors[0]["traceback"]))
    assert f"Cell In[{reply['execution_count']}]" in plain, plain
    shown = run(kc, "%%local\n6 * 7")
    results = [content for kind, content in shown.outputs if kind == "execute_result"]
    assert [r["execution_count"] for r in results] == [shown.reply["execution_count"]], results


def test_only_the_front_ends_messages_are_relayed(attached):
    """What the worker says to another client (a parking connection's transfer comm, the agent's
    shutdown) never reaches the front end; the worker's output of the front end's cells does."""
    _, kc = attached
    msg_id = kc.execute("%%local\n"
                        "from gpupool.remote import RemoteKernel\n"
                        "other = RemoteKernel(get_ipython().kernel.gpu.attachment.lease.connection)\n"
                        "other.wait_ready()\n"
                        "other.execute(\"print('foreign output'); from comm import create_comm; "
                        "c = create_comm(target_name='foreign'); c.send({}); c.close()\", lambda m: None)\n"
                        "other.close()")
    seen = iopub_until(kc, lambda m: m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                       and m["parent_header"].get("msg_id") == msg_id)
    assert kc.get_shell_msg(timeout=30)["content"]["status"] == "ok"
    mine = kc.execute("print('own output')")
    seen += iopub_until(kc, lambda m: m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                        and m["parent_header"].get("msg_id") == mine)
    sessions = {kc.session.session}
    foreign = [m for m in seen if m["parent_header"] and m["parent_header"].get("session") not in sessions]
    assert not foreign, [(m["msg_type"], m["content"]) for m in foreign]
    assert any(m["msg_type"] == "stream" and m["content"]["text"] == "own output\n" for m in seen)


def test_completion_inspection_and_is_complete_are_the_workers(attached):
    _, kc = attached
    code = WORKER_ONLY[:12]
    completion = request(kc, "shell", "complete_request", {"code": code, "cursor_pos": len(code)})
    assert WORKER_ONLY in completion["content"]["matches"]
    inspected = request(kc, "shell", "inspect_request", {"code": "documented", "cursor_pos": 10, "detail_level": 0})
    assert inspected["content"]["found"] and "Says hello from the worker" in inspected["content"]["data"]["text/plain"]
    value = request(kc, "shell", "inspect_request", {"code": WORKER_ONLY, "cursor_pos": 3, "detail_level": 0})
    assert "42" in value["content"]["data"]["text/plain"]
    assert request(kc, "shell", "is_complete_request", {"code": "for i in x:"})["content"]["status"] == "incomplete"
    question = run(kc, f"{WORKER_ONLY}?")
    page, = question.reply["payload"]
    assert question.ok and page["source"] == "page" and "42" in page["data"]["text/plain"]


def test_completion_and_inspection_see_names_the_worker_has_not_received_yet(attached):
    _, kc = attached
    assert run(kc, "%%local\nimport json as local_json_4821").ok
    code = "local_json_4821.dum"
    completion = request(kc, "shell", "complete_request", {"code": code, "cursor_pos": len(code)})
    assert "dumps" in completion["content"]["matches"], completion["content"]
    inspected = request(kc, "shell", "inspect_request", {"code": "local_json_4821.dumps", "cursor_pos": 18,
                                                         "detail_level": 0})
    assert inspected["content"]["found"] and "Serialize" in inspected["content"]["data"]["text/plain"]
    question = run(kc, "local_json_4821.dumps?")
    assert question.ok and "Serialize" in question.reply["payload"][0]["data"]["text/plain"], question.reply
    nothing = request(kc, "shell", "complete_request", {"code": "no_such_name_4821.", "cursor_pos": 18})
    assert nothing["content"]["status"] == "ok" and nothing["content"]["matches"] == []


def test_completing_an_item_of_an_object_only_this_kernel_holds_completes_here(kernel):
    """``localdata_zz[`` then Tab, for a dict defined before the attach and not sent along yet, offers
    its keys as a local kernel does (the worker answered with its own names, and that stopped here)."""
    _, kc = kernel
    assert run(kc, "localdata_zz = {'kk_one': 1}").ok
    assert run(kc, "%gpu acquire 0.25").ok
    for code in ("localdata_zz[", "localdata_zz['kk"):
        reply = request(kc, "shell", "complete_request", {"code": code, "cursor_pos": len(code)})
        assert any("kk_one" in match for match in reply["content"]["matches"]), (code, reply["content"])


@pytest.mark.parametrize("code, name", [
    ("localdata[", "localdata"), ("x = localdata['k", "localdata"), ("data.sh", "data"), ("a[0].b", "a"),
    ("f(localdata[", "localdata"), ("localdata", None), ("x.", "x"), ("1.", None),
    ("y = 1\nlocaldata.ke", "localdata"), ("localdata.keys()\nz", None),
])
def test_the_object_a_completion_asks_about(code, name):
    from gpupool.magics.routing import completed_object
    assert completed_object(code, len(code)) == name


def test_comms_go_both_ways_and_comm_info_lists_both_sides(attached):
    _, kc = attached
    setup = run(kc, "seen = []\n"
                    "def opened(comm, msg):\n"
                    "    comm.on_msg(lambda m: (seen.append(m['content']['data']), comm.send({'echo': m['content']['data']})))\n"
                    "get_ipython().kernel.comm_manager.register_target('echo', opened)\n"
                    "from comm import create_comm\n"
                    "from_worker = create_comm(target_name='from-worker', data={'hello': 1})")
    assert setup.ok, setup.text()
    opened = [c for kind, c in setup.outputs if kind == "comm_open"]
    assert opened and opened[0]["target_name"] == "from-worker", "the worker's comm_open reaches the front end"
    open_msg = kc.session.msg("comm_open", {"comm_id": "c-echo", "target_name": "echo", "data": {}})
    kc.shell_channel.send(open_msg)
    message = kc.session.msg("comm_msg", {"comm_id": "c-echo", "data": {"n": 7}})
    kc.shell_channel.send(message)
    echoed = [m for m in iopub_until(kc, lambda m: m["msg_type"] == "status" and m["content"]["execution_state"]
                                     == "idle" and m["parent_header"].get("msg_id") == message["header"]["msg_id"])
              if m["parent_header"].get("msg_id") == message["header"]["msg_id"]]
    # One busy and one idle, the worker's, around the reply: JupyterLab stops listening
    # for a comm message's output (an @interact function's) at its idle.
    assert [m["msg_type"] for m in echoed] == ["status", "comm_msg", "status"], echoed
    assert echoed[1]["content"]["data"] == {"echo": {"n": 7}}
    assert remote_value(kc, "seen") == [{"n": 7}]
    # The notebook kernel's own comm target stays here.
    kc.shell_channel.send(kc.session.msg("comm_open", {"comm_id": "c-status", "target_name": "gpupool.status",
                                                       "data": {}}))
    reply = request(kc, "shell", "comm_info_request", {})["content"]
    info = reply["comms"]
    assert "gpupool_worker_comms" not in reply, "the worker answered: its comms are known"
    assert info["c-echo"]["target_name"] == "echo" and info["c-status"]["target_name"] == "gpupool.status"
    assert any(v["target_name"] == "from-worker" for v in info.values())
    only = request(kc, "shell", "comm_info_request", {"target_name": "echo"})["content"]["comms"]
    assert list(only) == ["c-echo"]
    kc.shell_channel.send(kc.session.msg("comm_close", {"comm_id": "c-echo", "data": {}}))
    assert wait_until(lambda: "c-echo" not in request(kc, "shell", "comm_info_request", {})["content"]["comms"])


def test_a_widget_message_while_parked_resumes_the_lease_and_reaches_its_live_comm(attached):
    _, kc = attached
    setup = run(kc, "def opened(comm, msg):\n"
                    "    comm.on_msg(lambda m: comm.send({'echo': m['content']['data']}))\n"
                    "get_ipython().kernel.comm_manager.register_target('echo', opened)")
    assert setup.ok, setup.text()
    kc.shell_channel.send(kc.session.msg("comm_open", {"comm_id": "c-parked", "target_name": "echo", "data": {}}))
    assert run(kc, "%gpu park").ok
    # The frozen worker cannot list its comms: the reply says so, and JupyterLab marks no widget dead.
    parked = request(kc, "shell", "comm_info_request", {})["content"]
    assert parked["gpupool_worker_comms"] == "unknown" and "c-parked" not in parked["comms"], parked
    message = kc.session.msg("comm_msg", {"comm_id": "c-parked", "data": {"n": 8}})
    kc.shell_channel.send(message)
    seen = iopub_until(kc, lambda m: m["msg_type"] == "comm_msg" and m["content"].get("comm_id") == "c-parked",
                       timeout=60)
    assert seen[-1]["content"]["data"] == {"echo": {"n": 8}}, "the comm kept its state through the park"
    status = run(kc, "%gpu status")
    assert re.search(r"L-\S+\s+(starting|active)\s", status.outputs[-1][1]["data"]["text/plain"]), status.text()
    assert "was parked" not in status.text(), "%gpu park said it; no notice repeats it"


def wait_until(predicate, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_bad_messages_get_an_error_or_a_warning_and_the_kernel_goes_on(attached):
    _, kc = attached
    kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": "no-such-comm", "data": {}}))
    malformed = request(kc, "shell", "complete_request", {"code": 5})
    assert malformed["content"]["status"] == "error" and "code must be a string" in malformed["content"]["evalue"]
    debug = request(kc, "control", "debug_request", {"type": "request", "seq": 1, "command": "noSuchCommand",
                                                     "arguments": {}})
    assert debug["msg_type"] == "debug_reply"
    assert remote_value(kc, f"{WORKER_ONLY} + 1") == 43, "still working"


def test_gpu_lines_inside_a_forwarded_cell_run_in_the_notebook_kernel(attached):
    _, kc = attached
    both = run(kc, "x = 1\n%gpu status")
    assert both.ok, both.text()
    assert "L-" in both.text() and remote_value(kc, "x") == 1
    loop = run(kc, "for i in range(2):\n    %gpu status\nprint('done', i)")
    assert loop.ok, loop.text()
    assert loop.text().count("active") >= 2 and "done 1" in loop.stdout
    assert loop.text().count("the names holding GPU memory are listed by a %gpu status between cells") == 2
    refused = run(kc, "print('before')\ny = 2\n%gpu release")
    assert not refused.ok and refused.reply["ename"] == "UsageError", refused.text()
    assert "%gpu release cannot run inside a cell that runs on the worker; put it in a cell of its own" \
        in refused.text()
    assert "before" not in refused.text(), "refused before anything ran"
    again = run(kc, "z = 3\nif z:\n    %gpu acquire 1")
    assert not again.ok and "a second %gpu acquire cannot run inside" in again.text()
    assert remote_value(kc, "'y' in globals() or 'z' in globals()") is False, "no line of either cell ran"
    quoted = run(kc, 's = """\n%gpu release\n"""')
    assert quoted.ok, "a %gpu line in a string is text: " + quoted.text()
    assert run(kc, "%gpu status").ok


def test_input_from_a_forwarded_cell_goes_to_the_front_end_only_if_it_allows_stdin(attached):
    _, kc = attached
    cell = run(kc, "name = input('who? ')\nname.upper()", stdin=["ann"])
    assert cell.ok and cell.outputs[-1][1]["data"]["text/plain"] == "'ANN'"
    refused = run(kc, "input('who? ')")
    assert not refused.ok and refused.reply["ename"] == "StdinNotImplementedError"


def test_the_debugger_answers_from_the_worker(attached):
    _, kc = attached
    features = request(kc, "shell", "kernel_info_request", {})["content"]["supported_features"]
    assert "debugger" in features and "kernel subshells" not in features
    init = request(kc, "control", "debug_request", {
        "type": "request", "seq": 1, "command": "initialize",
        "arguments": {"clientID": "test", "adapterID": "python", "linesStartAt1": True, "columnsStartAt1": True,
                      "pathFormat": "path"}})
    assert init["content"].get("success"), init["content"]
    attach = request(kc, "control", "debug_request", {"type": "request", "seq": 2, "command": "attach",
                                                      "arguments": {}})
    assert attach["content"].get("success"), attach["content"]
    info = request(kc, "control", "debug_request", {"type": "request", "seq": 3, "command": "debugInfo",
                                                    "arguments": {}})
    assert info["content"]["success"]
    assert run(kc, "%%local\ncpu_only_gamma = [7, 'seven']").ok  # a name only this kernel holds yet
    variables = request(kc, "control", "debug_request", {"type": "request", "seq": 4, "command": "inspectVariables",
                                                         "arguments": {}})
    listed = {v["name"]: v for v in variables["content"]["body"]["variables"]}
    assert WORKER_ONLY in listed, "the Variables panel lists the worker's names"
    local = listed.get("cpu_only_gamma (local)")
    assert local is not None, f"the CPU kernel's own name, marked, is listed too: {sorted(listed)}"
    assert (local["value"], local["type"], local["variablesReference"], local["evaluateName"]) == \
        ("[7, 'seven']", "list", 0, "cpu_only_gamma")
    assert f"{WORKER_ONLY} (local)" not in listed and "cpu_only_gamma" not in listed, "each name once"
    rich = request(kc, "control", "debug_request", {"type": "request", "seq": 5, "command": "richInspectVariables",
                                                    "arguments": {"variableName": "cpu_only_gamma (local)"}})
    assert rich["content"]["success"] and rich["content"]["body"]["data"]["text/plain"] == "[7, 'seven']"
    sent = run(kc, "print(cpu_only_gamma)").stdout  # read by a cell: sent along, the worker's from then on
    assert "sent along cpu_only_gamma" in sent and sent.endswith("[7, 'seven']\n"), sent
    variables = request(kc, "control", "debug_request", {"type": "request", "seq": 6, "command": "inspectVariables",
                                                         "arguments": {}})
    listed = {v["name"] for v in variables["content"]["body"]["variables"]}
    assert "cpu_only_gamma" in listed and "cpu_only_gamma (local)" not in listed, "now the worker's"
    request(kc, "control", "debug_request", {"type": "request", "seq": 7, "command": "disconnect",
                                             "arguments": {"restart": False, "terminateDebuggee": False}})


AWAIT_CELL = "import asyncio\nawait asyncio.sleep(0.05)\nprint('awaited')"


def test_top_level_await_runs_here_and_on_the_worker_and_an_interrupt_ends_it(kernel):
    """A cell of top-level ``await`` (IPython's autoawait) gets its reply, detached and attached, as
    in a plain kernel; interrupted mid-await it fails and the next cell runs (it got no reply, and
    every later cell waited behind it: the kernels read their shell socket on the main thread)."""
    km, kc = kernel
    for where in ("here", "on the worker"):
        cell = run(kc, AWAIT_CELL, timeout=30)
        assert cell.ok and cell.stdout == "awaited\n", (where, cell.text())
        if where == "here":
            assert run(kc, "%gpu acquire 0.25").ok
    msg_id = kc.execute("print('waiting', flush=True)\nawait asyncio.sleep(120)")
    iopub_until(kc, lambda m: m["parent_header"].get("msg_id") == msg_id and "waiting" in m["content"].get("text", ""))
    km.interrupt_kernel()
    reply = kc.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=30)
    assert reply["content"]["status"] == "error", reply["content"]
    assert run(kc, "print('next')", timeout=30).stdout == "next\n"


def test_the_worker_starts_in_the_notebooks_folder(kernel, tmp_path):
    _, kc = kernel
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    acquired = run(kc, "%gpu acquire 0.25")
    assert acquired.ok and f"the worker runs in this notebook's folder, {tmp_path}" in acquired.stdout
    assert remote_value(kc, "open('data.csv').read()") == "a,b\n1,2\n"
    assert remote_value(kc, "import os; os.getcwd()") == str(tmp_path)


def test_the_worker_takes_the_notebooks_home(e2e_pool, tmp_path, monkeypatch):
    """``~`` on the worker is the notebook's home where the node sees it (it was the agent's)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "mymod_zz.py").write_text("WHERE = 'home'\n")
    monkeypatch.setenv("HOME", str(home))
    km, kc = start_gpupool_kernel(e2e_pool[2], tmp_path)
    try:
        assert run(kc, "%gpu acquire 0.25").ok
        assert remote_value(kc, "import os; os.path.expanduser('~')") == str(home)
        assert remote_value(kc, "open(os.path.expanduser('~/mymod_zz.py')).read()") == "WHERE = 'home'\n"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def test_functions_keep_their_source_both_ways(kernel):
    """A function defined in a cell here and called on the worker shows its cell's lines in its
    traceback (``Cell In[n]``, as locally) and to ``inspect``; one defined on the worker does so
    here after ``%gpu release`` (cloudpickle named their code ``<dynamic-code>``, with no source)."""
    _, kc = kernel
    defined = run(kc, "def g(a):\n    b = a - a\n    return a / b")
    assert defined.ok
    assert run(kc, "%gpu acquire 0.25").ok
    failed = run(kc, "g(3)")
    assert not failed.ok and "ZeroDivisionError" in failed.text()
    trace = re.sub(r"\x1b\[[0-9;]*m", "", failed.text())
    assert f"Cell In[{defined.reply['execution_count']}], line 3" in trace and "return a / b" in trace, trace
    assert "<dynamic-code>" not in trace
    assert remote_value(kc, "import inspect; inspect.getsource(g)").startswith("def g(a):")
    assert run(kc, "def h():\n    return 'from the worker'").ok
    assert run(kc, "%gpu release").ok
    assert remote_value(kc, "import inspect; inspect.getsource(h)") == "def h():\n    return 'from the worker'\n"


def test_release_brings_imports_back_as_imports(kernel):
    _, kc = kernel
    assert run(kc, "%gpu acquire 0.25").ok
    assert run(kc, "import json as js\ndef twice(v):\n    return 2 * v\nclass Box:\n    pass").ok
    released = run(kc, "%gpu release")
    assert "1 module (js), 1 function (twice), 1 class (Box)" in released.stdout, released.stdout
    assert remote_value(kc, "js.dumps(twice(2)), type(Box()).__name__") == ("4", "Box")


def test_a_release_brings_the_workers_results_home_as_out_and_underscore_n(kernel):
    """``Out[n]`` and ``_n`` of cells that ran on the worker are the objects themselves here after
    ``%gpu release`` (not their text), within c.GPUMagics.release_state_cap, the latest first: one
    that does not fit is named as left on the worker."""
    _, kc = kernel
    assert run(kc, '%%local\n%config GPUMagics.release_state_cap = "4MiB"').ok
    assert run(kc, "%gpu acquire 0.25").ok
    listed = run(kc, "[1, 2, 3]").reply["execution_count"]
    assert run(kc, "import numpy as np\nclass Box:\n    def __repr__(self):\n        return 'a box'").ok
    big = run(kc, "np.ones(3 * 2**20 // 8)").reply["execution_count"]  # 3 MiB
    boxed = run(kc, "Box()").reply["execution_count"]
    nothing = run(kc, "y = 1").reply["execution_count"]
    small = run(kc, "np.arange(4)").reply["execution_count"]  # 3 + 3 MiB would pass the cap: its own 3 MiB wait
    after = run(kc, "big = np.ones(3 * 2**20 // 8)")
    assert after.ok
    released = run(kc, "%gpu release")
    assert released.ok, released.text()
    assert remote_value(kc, f"Out[{listed}], _{listed}") == ([1, 2, 3], [1, 2, 3])
    assert remote_value(kc, f"type(Out[{boxed}]).__name__, Out[{boxed}] is _{boxed}") == ("Box", True)
    assert remote_value(kc, f"Out[{small}].tolist(), {nothing} in Out, {big} in Out") == ([0, 1, 2, 3], False, False)
    assert f"3 outputs (Out[{listed}], Out[{boxed}], Out[{small}]" in released.stdout, released.stdout
    assert f"(Out[{big}])" in released.stdout and "over the size cap" in released.stdout, released.stdout


def test_a_local_cell_that_rebinds_a_sent_name_wins_over_the_workers_older_copy(kernel):
    """``%%local`` rebinding a name the worker got earlier: the next cell on the worker that reads it
    gets the notebook's new value, and a release keeps the notebook's value of a name the worker did
    not bind since (it is newer), saying so; a name the worker bound after the local cell comes back."""
    _, kc = kernel
    assert run(kc, "results = ['epoch1']\nlast = 0").ok
    assert run(kc, "%gpu acquire 0.25").ok
    assert remote_value(kc, "len(results), last") == (1, 0)
    assert run(kc, "%%local\nresults = ['epoch1', 'epoch2']\nlast = 1\nnotes = 'here'").ok
    assert remote_value(kc, "results") == ["epoch1", "epoch2"], "sent again: the notebook's is newer"
    assert run(kc, "last = 7").ok, "bound on the worker after the local cell: the worker's is newer"
    assert run(kc, "%%local\nresults = ['epoch1', 'epoch2', 'epoch3']").ok
    released = run(kc, "%gpu release")
    assert released.ok and "kept the notebook's own results" in released.stdout, released.outputs
    assert remote_value(kc, "results, last, notes") == (["epoch1", "epoch2", "epoch3"], 7, "here")


def test_a_release_follows_the_workers_cd_where_it_shares_the_notebooks_folder(kernel, tmp_path):
    _, kc = kernel
    (tmp_path / "sub").mkdir()
    assert run(kc, "%gpu acquire 0.25").ok
    assert run(kc, "%cd sub").ok
    released = run(kc, "%gpu release")
    assert f"now in {tmp_path / 'sub'}" in released.stdout, released.stdout
    assert remote_value(kc, "import os; os.getcwd()") == str(tmp_path / "sub")


def test_local_takes_no_arguments(kernel):
    _, kc = kernel
    refused = run(kc, "%%local --please-run-remotely\nx = 1")
    assert not refused.ok and "%%local takes no arguments" in refused.text()
    assert not run(kc, "x").ok, "nothing ran"


def test_kernel_class_forwards_only_while_attached():
    kernel = GPUPoolKernel.__new__(GPUPoolKernel)
    kernel.gpu = type("G", (), {"attachment": None})()
    assert kernel.forwarded_code("x = 1") is None, "detached: everything runs here"
    kernel.gpu.attachment = object()
    assert kernel.forwarded_code("x = 1\n%gpu status") == "x = 1\n%gpu status"
    assert kernel.forwarded_code("%gpu status\n# comment\n%gpu pool") is None
    assert kernel.forwarded_code("%%local\nx") is None
    assert kernel.forwarded_code("%%gpu\nx = 1\n") == "x = 1\n"
    assert kernel.forwarded_code("%%gpu 0.5\nx") is None, "the magic refuses an amount while attached"


def test_a_completion_while_parked_is_answered_here():
    """A frozen worker answers nothing: completion, inspection and is_complete are this kernel's own."""
    import asyncio
    from types import SimpleNamespace

    kernel = GPUPoolKernel.__new__(GPUPoolKernel)
    kernel.gpu = SimpleNamespace(attachment=SimpleNamespace(parked=object(), ended=None, is_parked=True))
    answered = []

    async def local(stream, ident, parent):
        answered.append(parent)

    parent = {"header": {"msg_type": "complete_request"}, "content": {"code": "x.", "cursor_pos": 2}}
    asyncio.run(kernel._forward_or_local(None, None, parent, local, ("code", "cursor_pos")))
    assert answered == [parent]


def test_worker_messages_are_checked_as_session_checks_them():
    """RemoteKernel's deserialize (Session.deserialize without date parsing) keeps its checks."""
    import zmq
    from jupyter_client.session import Session

    from gpupool.kernelmsg import deserialize

    sender, reader = Session(key=b"k"), Session(key=b"k")
    frames = sender.serialize(sender.msg("stream", {"text": "hi"}), ident=[])
    parts = [zmq.Frame(f) for f in frames[frames.index(b"<IDS|MSG>") + 1:]] + [zmq.Frame(b"\0" * 64)]
    msg = deserialize(reader, parts)
    assert msg["content"] == {"text": "hi"} and isinstance(msg["header"]["date"], str)
    assert bytes(msg["buffers"][0]) == b"\0" * 64
    with pytest.raises(ValueError, match="Duplicate Signature"):
        deserialize(reader, parts)
    forged = [parts[0], *parts[1:4], zmq.Frame(b'{"text": "forged"}')]
    with pytest.raises(ValueError, match="Invalid Signature"):
        deserialize(Session(key=b"k"), forged)
    with pytest.raises(ValueError, match="Unsigned"):
        deserialize(Session(key=b"k"), [zmq.Frame(b""), *parts[1:5]])
    with pytest.raises(TypeError, match="at least 5"):
        deserialize(Session(key=b"k"), parts[:3])


@pytest.mark.parametrize("code, target", [
    ("np.arange?", "np.arange"), ("np.arange??", "np.arange"), ("?np", "np"), ("np?  ", "np"),
    ("x", None), ("x = 1", None), ("print(x)?", None), ("a?\nb", None),
])
def test_a_help_cell_reads_the_name_it_asks_about(code, target):
    from gpupool.magics.routing import help_target

    assert help_target(code) == target


@pytest.mark.parametrize("code, lines", [
    ("print(1)\n%gpu release", ["release"]),
    ("for i in range(2):\n    %gpu status\n%gpu acquire 1 --wait", ["status", "acquire 1 --wait"]),
    ('s = """\n%gpu release\n"""', []), ("x = 1", []), ("def f(:\n%gpu release", []),
])
def test_the_gpu_lines_of_a_cell_are_found_where_ipython_runs_them(code, lines):
    from IPython.core.inputtransformer2 import TransformerManager

    from gpupool.magics.routing import gpu_lines

    assert gpu_lines(TransformerManager().transform_cell(code)) == lines


def test_gpupool_log_lines_go_to_the_kernels_own_stderr_never_into_a_cell(kernel, e2e_pool):
    """A heartbeat that failed logs a warning from a thread of its own: Python's last-resort handler
    would print it into whichever cell ran last (docs/api.md, "Notices": never into an old cell);
    it goes to the kernel process's stderr, the Jupyter server's log, instead."""
    _, kc = kernel
    done = run(kc, "import logging\nlogging.getLogger('gpupool.heartbeat').warning('heartbeat for L-0 failed: test')")
    assert done.ok and "heartbeat for L-0" not in done.text(), done.text()
    log = e2e_pool[2].parent / "gpupool-kernels.log"
    wait_for_text = time.monotonic() + 10
    while "heartbeat for L-0 failed: test" not in log.read_text() and time.monotonic() < wait_for_text:
        time.sleep(0.1)
    assert "[gpupool WARNING" in log.read_text() and "heartbeat for L-0 failed: test" in log.read_text()


def test_a_wait_on_a_worker_the_lease_left_ends_with_words():
    """A cell that reached the worker as its lease was parked to disk waits on a worker that is gone:
    once the lease resumed on a new worker, the wait ends (it hung) and says the cell did not finish."""
    from types import SimpleNamespace

    from gpupool.errors import GPUPoolError, Reason
    from gpupool.magics.attachment import Attachment
    from gpupool.magics.park import Parked

    attachment = object.__new__(Attachment)
    attachment.heartbeat = SimpleNamespace(ended=None)
    attachment.parked = Parked(SimpleNamespace(id="L-1", node="node-1"),
                               new_worker=SimpleNamespace(id="L-1", node="node-2"))
    with pytest.raises(GPUPoolError) as raised:
        attachment.check_alive()
    assert raised.value.code == Reason.worker_unreachable
    assert raised.value.message.startswith("lease L-1 was parked to disk as this reached its worker, and resumed on "
                                           "a new worker on node-2"), raised.value.message
    assert raised.value.message.endswith("run it again")


def test_what_a_park_could_not_keep_is_said_at_the_resume_unless_its_notice_said_it():
    """A preempted cell interrupted as its park spilled to disk ended with a bare KeyboardInterrupt: the
    notice (if any) came while the lease was parking, before the service knew. The resume's line says it."""
    from types import SimpleNamespace

    from gpupool.magics.park import Parked

    parking = SimpleNamespace(parked={"tier": "disk"})
    spilled = SimpleNamespace(parked={"tier": "disk", "lost": ["the running cell was interrupted", "lock: a lock"]})
    parked = Parked(parking)
    assert parked.not_kept() == ""
    assert parked.not_kept(spilled) == "; not kept by the park: the running cell was interrupted; lock: a lock"
    parked.lost_said = ("lock: a lock",)  # its notice said that much
    assert parked.not_kept(spilled, spilled) == "; not kept by the park: the running cell was interrupted"
    assert Parked(spilled, lost_said=tuple(spilled.parked["lost"])).not_kept(spilled) == ""

