"""Table tests of the fragmentation measure extended to every dimension (rules/fragmentation.py).

One node per row: free cores (milli), free memory (MiB), free milli per GPU (-1: no such GPU); one task type
(cpu, memory, num, milli) weighted 1; the fragment it sees, in milli-GPUs."""

import numpy as np
import pytest

from gpupool.hub_plugin.rules.fragmentation import TaskTypes, node_fragmentation, task_types

ROWS = [
    # (why, cpu_free, mem_free, gpus_free, type (cpu, mem, num, milli), fragment)
    ("slice fits: only GPUs with less free than it count", 8000, 4096, [300, 600, 1000], (1000, 1024, 1, 500), 300),
    ("slice fits exactly: a GPU with just its share free is none", 8000, 4096, [500, 200], (1000, 1024, 1, 500), 200),
    ("slice: no GPU has room: every free milli counts", 8000, 4096, [300, 400], (1000, 1024, 1, 500), 700),
    ("slice: GPUs have room, cores not: all free milli count", 500, 4096, [300, 1000], (1000, 1024, 1, 500), 1300),
    ("slice: GPUs have room, memory not: all free milli count", 8000, 512, [300, 1000], (1000, 1024, 1, 500), 1300),
    ("one whole GPU fits: partly used GPUs count", 8000, 4096, [300, 1000, 999], (1000, 1024, 1, 1000), 1299),
    ("two whole GPUs fit: partly used GPUs count", 8000, 4096, [1000, 1000, 700], (1000, 1024, 2, 1000), 700),
    ("two whole GPUs, one idle: all free milli count", 8000, 4096, [1000, 900, 700], (1000, 1024, 2, 1000), 2600),
    ("CPU-only type that fits: it uses no GPU, all count", 8000, 4096, [300, 1000], (1000, 1024, 0, 0), 1300),
    ("CPU-only type that does not fit: all free milli count", 500, 4096, [300, 1000], (1000, 1024, 0, 0), 1300),
    ("padding (-1) is no GPU", 8000, 4096, [300, -1, -1], (1000, 1024, 1, 500), 300),
    ("a full node has no fragment", 0, 0, [0, 0], (1000, 1024, 1, 500), 0),
]


@pytest.mark.parametrize("why, cpu, mem, gpus, kind, fragment", ROWS, ids=[r[0] for r in ROWS])
def test_fragment_per_task_type(why, cpu, mem, gpus, kind, fragment):
    types = TaskTypes(*(np.array([v]) for v in kind), np.array([1]))
    got = node_fragmentation(np.array([cpu]), np.array([mem]), np.array([gpus]), types)
    assert got.tolist() == [fragment]


def test_weights_are_every_type_counted_exactly():
    """task_types keeps every type (not only the most frequent), weighted by integer counts, most frequent first."""
    types = task_types([1, 2, 1, 3, 1], [0] * 5, [1, 1, 1, 0, 1], [500, 250, 500, 0, 500])
    assert list(zip(types.cpu.tolist(), types.milli.tolist(), types.weight.tolist())) == [
        (1, 500, 3), (2, 250, 1), (3, 0, 1)]
    assert types.weight.dtype.kind == "i"
    assert len(task_types([1, 2, 3], [0] * 3, [1, 1, 1], [1, 2, 3], top=2).weight) == 2


def test_equal_growths_tie_exactly():
    """With count weights the measure is an integer: two placements that grow it equally compare equal (with
    shares such as 1/3 the float sums differ in the last bit and decide ties by rounding)."""
    types = task_types([100, 200, 300] * 3, [0] * 9, [1] * 9, [130, 270, 410] * 3)
    before = np.array([[1000, 1000, 1000], [1000, 1000, -1]])
    after = np.array([[870, 1000, 1000], [870, 1000, -1]])
    cpu, mem = np.array([8000, 8000]), np.array([0, 0])
    growth = node_fragmentation(cpu, mem, after, types) - node_fragmentation(cpu, mem, before, types)
    assert growth[0] == growth[1]
