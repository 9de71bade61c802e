"""The worker-side extension's pure parts: the import hook, the size cap, the variable filter."""

from __future__ import annotations

import sys
import types

from gpupool.node.worker_extension.devices import to_cpu_with_device
from gpupool.node.worker_extension.namespace import _cap, user_variables
from gpupool.node.worker_extension.torch_cap import AfterImport
from gpupool.transfer import dump_values


def test_after_import_hook_runs_once_the_module_is_imported(tmp_path, monkeypatch):
    (tmp_path / "fake_framework.py").write_text("READY = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hook = AfterImport("fake_framework", lambda module: seen.append(module.READY))
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
    assert to_cpu_with_device(tensor) == (tensor, None) and to_cpu_with_device("text") == ("text", None)
    model = torch.nn.Linear(2, 2)
    assert to_cpu_with_device(model)[0] is model and next(model.parameters()).device.type == "cpu"


class _Device:
    def __init__(self, platform: str, index: int) -> None:
        self.platform, self.id = platform, index


class _CupyArray:
    """Stands in for a CuPy array on GPU 1 (CuPy needs a GPU; the names are CuPy's)."""

    __module__ = "cupy"

    def __init__(self, data) -> None:
        self.data, self.device = data, _Device("cuda", 1)

    def get(self):
        import numpy

        return numpy.asarray(self.data)


class _JaxArray:
    """Stands in for a JAX array on a GPU (the method names are JAX's)."""

    __module__ = "jaxlib.xla_extension"

    def __init__(self, data) -> None:
        self.data = data

    def devices(self):
        return {_Device("gpu", 0)}

    def __array__(self, dtype=None, copy=None):
        import numpy

        return numpy.asarray(self.data, dtype=dtype)


def test_cupy_and_jax_arrays_come_to_the_cpu_and_go_back_to_their_device(monkeypatch):
    import contextlib

    import numpy

    from gpupool.node.worker_extension.devices import place_on_devices, to_cpu_with_device

    placed = []
    cupy = types.SimpleNamespace(
        asarray=lambda arr: ("cupy", placed[-1], list(arr)),
        cuda=types.SimpleNamespace(Device=lambda index: (placed.append(index), contextlib.nullcontext())[1]))
    jax = types.SimpleNamespace(devices=lambda platform: [_Device(platform, 0)],
                                device_put=lambda arr, device: ("jax", device.platform, list(arr)))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "jax", jax)

    host, device = to_cpu_with_device(_CupyArray([1, 2]))
    assert isinstance(host, numpy.ndarray) and device == "cupy:cuda:1"
    jhost, jdevice = to_cpu_with_device(_JaxArray([3.0]))
    assert isinstance(jhost, numpy.ndarray) and jdevice == "jax:gpu:0"

    values = {"c": host, "j": jhost}
    assert place_on_devices(values, {"c": device, "j": jdevice}) == {}
    assert values == {"c": ("cupy", 1, [1, 2]), "j": ("jax", "gpu", [3.0])}


def test_values_surely_over_the_cap_are_left_before_they_are_copied():
    import numpy
    import torch

    from gpupool.node.worker_extension.namespace import _within, known_nbytes

    big, small = numpy.zeros(1000, dtype=numpy.float64), torch.zeros(10)
    assert known_nbytes(big) == 8000 and known_nbytes(small) == 40 and known_nbytes("text") is None
    assert known_nbytes(torch.nn.Linear(2, 2)) == 6 * 4
    kept, errors = _within({"small": small, "big": big, "text": "t"}, 1000, {"gone": "not defined"})
    assert list(kept) == ["small", "text"]
    assert "over the transfer size cap" in errors["big"] and errors["gone"] == "not defined"
