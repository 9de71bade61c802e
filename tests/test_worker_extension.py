"""The worker-side extension's pure parts: the import hook, the size cap, the variable filter."""

from __future__ import annotations

import sys
import types

from gpupool.provisioner.worker import _AfterImport, _cap, to_cpu, user_variables
from gpupool.transfer import dump_values


def test_after_import_hook_runs_once_the_module_is_imported(tmp_path, monkeypatch):
    (tmp_path / "fake_framework.py").write_text("READY = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hook = _AfterImport("fake_framework", lambda module: seen.append(module.READY))
    sys.meta_path.insert(0, hook)
    try:
        import fake_framework  # noqa: F401
    finally:
        sys.modules.pop("fake_framework", None)
    assert seen == [True] and hook not in sys.meta_path


def test_size_cap_keeps_items_in_order_and_lists_what_stays_behind():
    header, buffers = dump_values({"small": b"x" * 10, "big": b"y" * 10_000, "tiny": 1})
    kept, kept_buffers = _cap(header, buffers, 2_000)
    assert [i["name"] for i in kept["items"]] == ["small", "tiny"]
    assert len(kept_buffers) == sum(i["nbuffers"] for i in kept["items"])
    assert "over the transfer size cap" in kept["errors"]["big"]


def test_user_variables_leave_out_modules_private_and_hidden_names():
    shell = types.SimpleNamespace(user_ns={"x": 1, "_y": 2, "os": sys, "In": [], "f": len},
                                  user_ns_hidden={"In": []})
    assert user_variables(shell) == {"x": 1, "f": len}


def test_to_cpu_leaves_cpu_tensors_and_other_values_alone():
    import torch

    tensor = torch.ones(3)
    assert to_cpu(tensor) is tensor and to_cpu("text") == "text"
    model = torch.nn.Linear(2, 2)
    assert to_cpu(model) is model and next(model.parameters()).device.type == "cpu"
