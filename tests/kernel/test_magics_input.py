"""Bad input to the magics: one clear line, no traceback, nothing changed.

Driven through a real IPython shell, as ipyparallel's magics tests do; the
service URL points at a port where nothing listens, so any call that got
past validation would fail with "cannot reach" instead of the message
asserted here.
"""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp

from procs import free_port


@pytest.fixture(scope="module")
def shell():
    ip = globalipapp.get_ipython()  # looked up now: after a first call (another module's) it is the shell's
    ip.run_line_magic("load_ext", "gpupool.magics")
    yield ip
    ip.run_line_magic("unload_ext", "gpupool.magics")


@pytest.fixture(autouse=True)
def unreachable_service(monkeypatch):
    monkeypatch.setenv("GPUPOOL_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("GPUPOOL_TOKEN", "t")


@pytest.mark.parametrize("line, words", [
    ("frobnicate", "unknown %gpu command 'frobnicate'"),
    ("acquire", "say how much: %gpu acquire 0.5 (a share of one GPU) or %gpu acquire 2 (whole GPUs)"),
    ("acquire 0", "more than 0"),
    ("acquire -0.5", "more than 0"),
    ("acquire 1.5", "not whole"),
    ("acquire half", "cannot read 'half'"),
    ("acquire 0.5 --memory lots", "cannot read 'lots' as a memory size"),
    ("acquire 0.5 --idle-timeout forever", "cannot read 'forever' as a duration"),
    ("acquire 0.5 --cpus -2", "--cpus must be more than 0 cores, got -2"),
    ("acquire 0.5 --cpus many", "invalid float value: 'many'"),
    ("acquire 0.5 --host-memory lots", "cannot read 'lots' as a memory size"),
    ("acquire 0.5 --colour red", "unrecognized arguments"),
    # Split as a shell splits: the quotes go, a value with a space stays one value; one left open is a UsageError
    ("acquire 0.5 --memory '20 lots'", "--memory: cannot read '20 lots' as a memory size"),
    ('acquire 0.5 --idle-timeout "forever"', "--idle-timeout: cannot read 'forever' as a duration"),
    ("acquire 0.5 --memory '20GiB", "--memory: cannot read .*: a quote in it is not closed; quote a value whole"),
    ('acquire "0.5', "a quote in it is not closed"),
    ("push 'x", "a quote in it is not closed"),
    ("status ''", "takes no arguments"),
    ("release", "not attached"),
    ("push", "needs variable names"),
    ("push nothing_by_this_name", "not attached to a GPU; run %gpu acquire 0.5 first"),  # that first, detached
    ("pull x", "not attached"),
    ("status extra", "takes no arguments"),
])
def test_bad_input_is_one_usage_error(shell, line, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        shell.run_line_magic("gpu", line)
    assert shell.magics_manager.registry["GPUMagics"].attachment is None


@pytest.mark.parametrize("rest", ["0.5 --memory '20GiB' --idle-timeout '1h'", '0.5 --memory "20 GiB" --idle-timeout "1 h"',
                                  "'0.5' --memory=20GiB --idle-timeout=1h"])
def test_quoted_values_read_as_the_shell_reads_them(rest):
    """``%gpu acquire 0.5 --memory '20GiB'`` (a new-user trial), as ``gpupool run`` gets it from the shell."""
    from gpupool.magics.commands import acquire_request, split_line

    request = acquire_request(split_line(rest))
    assert (request.fraction, request.memory, request.idle_timeout) == (0.5, 20 * 1024**3, 3600.0)


def test_the_acquire_dialogs_quoted_values_reach_the_magic_as_typed():
    """The Acquire dialog quotes a value with a space (``--memory "20 GB"``): the magic reads it, and a mistake in
    it is told under that field, without the quotes."""
    from types import SimpleNamespace

    from gpupool.magics.events import Requests

    ran = []
    requests = Requests(ran.append, SimpleNamespace(attachment=None), None, None)
    assert requests({"request": "acquire", "text": '0.5 --memory "20 GB" --model A100'})["ok"]
    assert ran == ['acquire 0.5 --memory "20 GB" --model A100']
    refused = requests({"request": "acquire", "text": '0.5 --memory "20 lots"'})
    assert not refused["ok"] and refused["message"].startswith("Memory: --memory: cannot read '20 lots' as a memory size"), \
        refused
    refused = requests({"request": "acquire", "text": '0.5 --idle-timeout "1h'})
    assert refused["message"].startswith("Idle timeout: --idle-timeout: cannot read"), refused
    assert len(ran) == 1


def test_push_of_a_name_not_defined_here_while_attached_sends_nothing(shell, monkeypatch):
    """Attached, ``%gpu push`` names what is not defined here before anything is sent (or resumed)."""
    magics = shell.magics_manager.registry["GPUMagics"]
    monkeypatch.setattr(magics.lifecycle, "_attachment", object())  # any attachment: the check comes first
    with pytest.raises(UsageError, match="not defined here: nothing_by_this_name; nothing was sent"):
        shell.run_line_magic("gpu", "push nothing_by_this_name")

@pytest.mark.parametrize("line, words", [("", "%gpu acquire 0.5"), ("help", "%gpu release [--discard]"),
                                         ("acquire --help", "--idle-timeout"), ("push --help", "%gpu push NAME")])
def test_help(shell, capsys, line, words):
    shell.run_line_magic("gpu", line)
    assert words in capsys.readouterr().out


def test_service_down_is_one_clear_line(shell):
    with pytest.raises(UsageError, match="cannot reach the gpupool service at http://127.0.0.1:"):
        shell.run_line_magic("gpu", "acquire 0.5")


def test_missing_configuration_names_the_variable(shell, monkeypatch):
    monkeypatch.delenv("GPUPOOL_URL")
    shell.magics_manager.registry["GPUMagics"].service._client = None
    with pytest.raises(UsageError, match="set GPUPOOL_URL"):
        shell.run_line_magic("gpu", "pool")


def test_pull_of_a_name_the_worker_lacks_is_a_usage_error_and_takes_nothing():
    """As ``%gpu push`` of a name not defined here: one UsageError, nothing moved (not 'ok, not moved: ...')."""
    from types import SimpleNamespace

    from gpupool.magics.transfers import Transfers
    taken = []
    answer = ({"y": 1}, [{"name": "y"}], {"x": "not defined on the worker"})
    attachment = SimpleNamespace(pull=lambda names: answer)
    transfers = Transfers(SimpleNamespace(take=lambda values, items: taken.append(values)), cap=lambda: 0)
    with pytest.raises(UsageError, match=r"not defined on the worker: x; nothing was pulled"):
        transfers.pull(attachment, ["x", "y"])
    assert taken == []
    answer = ({"y": 1}, [{"name": "y", "type": "int", "nbytes": 28}], {"z": "too large"})  # other reasons: a note
    transfers.pull(attachment, ["y", "z"])
    assert taken == [{"y": 1}]


@pytest.mark.parametrize("value", [-1, 17, True])
def test_transfer_streams_out_of_range_is_refused_and_keeps_the_setting(shell, value):
    from traitlets import TraitError

    magics = shell.magics_manager.registry["GPUMagics"]
    with pytest.raises(TraitError, match=f"transfer_streams must be 0 \\(by cores\\) to 16, not {value}"):
        magics.transfer_streams = value
    assert magics.transfer_streams == 0
    shell.run_line_magic("config", "GPUMagics.transfer_streams = 3")  # as a notebook's %%local cell sets it
    assert magics.transfer_streams == 3
    magics.transfer_streams = 0


@pytest.mark.parametrize("stage, words", [
    ("asking", "release interrupted while the worker packed the values; nothing came back"),
    ("moving", "release interrupted at 1.0 MiB of 4.0 MiB while the variables came back; nothing came back"),
])
def test_an_interrupted_release_says_where_in_one_clause(stage, words):
    from gpupool.magics.dataplane import TransferInterrupted
    from gpupool.magics.words import release_interrupted

    said = release_interrupted(TransferInterrupted(stage, ["x"], 2**20, 4 * 2**20), "L-1")
    assert said.startswith(words) and "L-1 is still attached" in said, said
