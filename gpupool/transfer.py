"""Moving Python values between the notebook kernel and a worker.

Values are pickled one by one with cloudpickle (so functions and classes
defined in a notebook travel by value) using pickle protocol 5 with
out-of-band buffers, so a NumPy array's memory goes onto the wire as its own
ZeroMQ frame without an extra copy (PEP 574). One value that cannot be
pickled (a lock, a generator, an open file) is reported by name and type and
does not stop the others.

Wire shape (inside a Jupyter comm message): a JSON header
``{"items": [{"name", "type", "nbytes", "nbuffers"}], "errors": {name: why}}``
and a flat list of buffers; item *i* owns the next ``nbuffers`` buffers, the
first being the pickle stream and the rest its out-of-band buffers. Big
buffers travel on the data plane instead (:mod:`gpupool.dataplane`): the
header then says their sizes and the receiver allocates them up front.

PyTorch CPU tensors pickle their storage in-band (a copy of the whole
tensor inside the pickle stream); :class:`_Pickler` sends them as NumPy
arrays instead, whose memory goes out of band like any array's.

cloudpickle names the code of a function it sends ``<dynamic-code>``, so its
tracebacks had no source and ``??`` showed none. Code from a notebook cell
keeps its cell's file name, and the cell's lines go along into the
receiver's ``linecache`` (as IPython keeps them, :func:`_code_with_source`),
with the cell's number, so a traceback there reads ``Cell In[3]`` as here.
"""

from __future__ import annotations

import functools
import importlib
import io
import linecache
import pickle
import sys
import types
from typing import Any, Iterable

import cloudpickle

PROTOCOL = 5


def dump_values(values: dict[str, Any]) -> tuple[dict[str, Any], list[memoryview | bytes]]:
    """Pickle ``values`` (name -> object) into ``(header, buffers)``.

    Never raises for a value that cannot be pickled: it is listed in
    ``header["errors"]`` as ``"TypeName: reason"`` instead.
    """
    items: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    buffers: list[memoryview | bytes] = []
    for name, value in values.items():
        out_of_band: list[pickle.PickleBuffer] = []
        try:
            stream = _dumps(value, out_of_band.append)
        except Exception as exc:  # any failure of one value is that value's alone
            errors[name] = f"{_type_name(value)} cannot be sent: {_first_line(exc)}"
            continue
        raws = [buf.raw() for buf in out_of_band]
        items.append({"name": name, "type": _type_name(value), "nbuffers": 1 + len(raws),
                      "nbytes": len(stream) + sum(r.nbytes for r in raws)})
        buffers.append(stream)
        buffers.extend(raws)
    return {"items": items, "errors": errors}, buffers


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with plain PyTorch CPU tensors as NumPy arrays (see the module's docstring)."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor:
            reduced = _reduce_tensor(torch, obj)
            if reduced is not None:
                return reduced
        if type(obj) is types.CodeType:
            reduced = _reduce_cell_code(obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)


#: What cloudpickle names the code it sends.
_DYNAMIC = "<dynamic-code>"


def _reduce_cell_code(code: types.CodeType) -> tuple | None:
    """``code`` of a notebook cell as :func:`_code_with_source` rebuilds it (its
    own, renamed, as cloudpickle sends it, so this is not asked again); None for
    code of a file on disk or of no known source."""
    entry = linecache.cache.get(code.co_filename)
    if code.co_filename == _DYNAMIC or entry is None or len(entry) != 4 or entry[1] is not None:
        return None  # a file on disk (its mtime) travels by reference, or nothing is known
    return _code_with_source, (code.replace(co_filename=_DYNAMIC), code.co_filename, entry[2],
                               _cell_numbers().get(code.co_filename))


def _code_with_source(code: types.CodeType, filename: str, lines: list[str], number: int | None
                      ) -> types.CodeType:
    """``code`` named ``filename`` again, with that cell's ``lines`` in this
    process's ``linecache`` (kept, as IPython's cells are: no file to check)
    and its cell ``number`` in this IPython's, so tracebacks and ``??`` show
    the source. Called by pickle on the receiving side."""
    if filename not in linecache.cache:
        linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)
    if isinstance(number, int):
        _cell_numbers().setdefault(filename, number)
    return code.replace(co_filename=filename)


def _cell_numbers() -> dict:
    """This process's IPython's cell file name -> cell number (what its tracebacks read as
    ``Cell In[n]``; a private name of IPython's compiler); a throwaway dict outside IPython."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    numbers = getattr(getattr(shell, "compile", None), "_filename_map", None)
    return numbers if isinstance(numbers, dict) else {}


def _dumps(value: Any, buffer_callback) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=PROTOCOL, buffer_callback=buffer_callback).dump(value)
    return out.getvalue()


#: PyTorch dtypes NumPy lacks, sent as the same bits in an integer type of their width.
_BITS_AS = {"bfloat16": "int16", "float8_e4m3fn": "int8", "float8_e5m2": "int8"}


def _reduce_tensor(torch, tensor) -> tuple | None:
    """``(rebuild, args)`` for a dense CPU tensor; None for the rest (sparse,
    quantized, meta, other devices: PyTorch's own pickling)."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
        return None
    dtype = str(tensor.dtype).removeprefix("torch.")
    data = tensor.detach()
    if dtype in _BITS_AS:
        data = data.view(getattr(torch, _BITS_AS[dtype]))
    try:
        array = data.numpy()
    except (TypeError, RuntimeError):  # a dtype NumPy cannot hold (complex32, say)
        return None
    return _tensor_from_numpy, (array, dtype, tensor.requires_grad)


def _tensor_from_numpy(array, dtype: str, requires_grad: bool):
    """Inverse of :func:`_reduce_tensor`: shares the array's memory."""
    import torch

    if not array.flags.writeable:  # a read-only ZeroMQ frame (small values come in the comm message)
        array = array.copy()
    tensor = torch.from_numpy(array)
    if dtype in _BITS_AS:
        tensor = tensor.view(getattr(torch, dtype))
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def load_values(header: dict[str, Any], buffers: Iterable[memoryview | bytes]) -> tuple[dict[str, Any], dict[str, str]]:
    """Inverse of :func:`dump_values`: returns ``(values, errors)``.

    A value whose unpickling fails (a module missing on this side, say) is
    reported in ``errors`` by name with the reason; the others still load.
    """
    queue = list(buffers)
    values: dict[str, Any] = {}
    errors: dict[str, str] = dict(header.get("errors", {}))
    position = 0
    for item in header.get("items", []):
        count = int(item["nbuffers"])
        stream, extra = queue[position], queue[position + 1:position + count]
        position += count
        try:
            values[item["name"]] = pickle.loads(stream, buffers=extra)
        except Exception as exc:
            errors[item["name"]] = f"{item.get('type', 'value')} cannot be loaded here: {_first_line(exc)}"
    return values, errors


def load_pulled(header: dict[str, Any], buffers: Iterable[memoryview | bytes]
                ) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, str]]:
    """A pull's answer unpacked: ``(values, items that loaded, errors by name)``.
    The modules the worker's namespace held (``header["modules"]``, name ->
    module name) are imported here and come back as the same names, with
    items of type ``module``; one that is not installed here is an error."""
    values, errors = load_values(header, buffers)
    items = [i for i in header.get("items", []) if i["name"] in values]
    for name, module in header.get("modules", {}).items():
        try:
            values[name] = importlib.import_module(module)
        except Exception as exc:  # not installed in this kernel's environment
            errors[name] = f"module {module} cannot be imported here: {_first_line(exc)}"
            continue
        items.append({"name": name, "type": "module", "module": module, "nbytes": 0})
    return values, items, errors


#: Types that pickle but arrive as something else: cloudpickle sends an open file as an in-memory
#: copy of its contents (an io.StringIO or BytesIO), no longer open.
def output_count(name: str) -> int | None:
    """The cell count of a result as IPython binds it (``_3`` -> 3: ``Out[3]``); None for another name."""
    return int(name[1:]) if name[:1] == "_" and name[1:].isdigit() else None


def shown_name(name: str) -> str:
    """A pulled name as the user knows it: a cell's result ``_3`` is ``Out[3]``, another as it is."""
    count = output_count(name)
    return name if count is None else f"Out[{count}]"


COPIED_AS_CONTENTS = frozenset({"_io.TextIOWrapper", "_io.BufferedReader", "_io.BufferedWriter",
                                "_io.BufferedRandom", "_io.FileIO"})


def describe(items: list[dict[str, Any]]) -> str:
    """``"x (ndarray, 1.0 MiB), y (int, 5 B)"`` for a one-line note."""
    from .units import format_bytes

    return ", ".join(f"{i['name']} ({i['type']}, {format_bytes(i['nbytes'])}{_was_on(i)})" for i in items)


def _was_on(item: dict[str, Any]) -> str:
    return f", was on {item['device']}" if item.get("device") else ""


def _type_name(value: Any) -> str:
    kind = type(value)
    module = kind.__module__
    return kind.__qualname__ if module in ("builtins", "__main__") else f"{module.split('.')[0]}.{kind.__qualname__}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# Packages whose versions decide whether a pickled value loads on the other side.
KEY_PACKAGES = ("cloudpickle", "numpy", "torch", "pandas", "cupy", "jax")


@functools.cache
def package_versions() -> dict[str, str]:
    """``{"python": "3.11.9", "numpy": "2.4.6", ...}`` for this process: the
    installed version of each of KEY_PACKAGES that is installed (by
    distribution metadata; nothing is imported)."""
    import platform
    from importlib import metadata

    found = {"python": platform.python_version()}
    for name in KEY_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def version_mismatches(here: dict[str, str], there: dict[str, str]) -> list[str]:
    """Differences that can break moving values, as ``"numpy 2.4.6 here, 1.26.4
    on the worker"``: Python and packages by major.minor, cloudpickle exactly
    (it does not promise compatibility across versions). Packages installed
    on one side only are not listed (a value of them cannot exist on the
    other side to be sent)."""
    out = []
    for name in ("python", *KEY_PACKAGES):
        mine, theirs = here.get(name), there.get(name)
        if mine is None or theirs is None:
            continue
        same = mine == theirs if name == "cloudpickle" else _minor(mine) == _minor(theirs)
        if not same:
            out.append(f"{name} {mine} here, {theirs} on the worker")
    return out


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])
