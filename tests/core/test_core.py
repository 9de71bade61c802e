"""The shared core: units, request validation, transfer, tables."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gpupool.errors import GPUPoolError
from gpupool.schema import LeaseState
from gpupool.wire.leases import Lease, LeaseRequest
from gpupool.tables import holders_table, idle_countdown, lease_table, memory_words, share_words, table
from gpupool.transfer import describe, dump_values, load_values
from gpupool.units import format_bytes, format_duration, format_share, parse_bytes, parse_duration, parse_gpu_amount


@pytest.mark.parametrize("text, expected", [
    ("20GiB", 20 * 1024**3), ("512MiB", 512 * 1024**2), ("16GB", 16 * 10**9), ("1.5Gi", int(1.5 * 1024**3)),
    ("1024", 1024), (4096, 4096), ("2 tib", 2 * 1024**4),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "-1GiB", "0", "20 parsecs", "GiB", True, "nan", "1e400GiB"])
def test_parse_bytes_refuses_with_the_accepted_forms(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(text)


@pytest.mark.parametrize("text, expected", [("30m", 1800), ("90s", 90), ("1.5h", 5400), ("2d", 172800), ("45", 45), (3, 3)])
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["0", "-5m", "soon", "5 fortnights", False])
def test_parse_duration_refuses(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize("text, expected", [("0.5", (0.5, 1)), ("1", (1.0, 1)), ("2", (1.0, 2)), (0.25, (0.25, 1))])
def test_parse_gpu_amount(text, expected):
    assert parse_gpu_amount(text) == expected


@pytest.mark.parametrize("text, words", [("0", "more than 0"), ("-1", "more than 0"), ("1.5", "not whole"),
                                         ("half", "cannot read"), ("inf", "a finite number")])
def test_parse_gpu_amount_refuses(text, words):
    with pytest.raises(ValueError, match=words):
        parse_gpu_amount(text)


@pytest.mark.parametrize("seconds, words", [
    ((99 * 3600, 86400), ("99h", "24h")),  # not "4d 3h" against "1d"
    ((2 * 86400, 86400), ("2d", "1d")),
    ((5400, 3600), ("90m", "60m")),
    ((7200, 600), ("120m", "10m")),
    ((0.5, 60), ("0.5s", "1m")),  # no whole unit: each as format_duration says it
])
def test_durations_that_are_compared_are_said_in_one_unit(seconds, words):
    from gpupool.units import format_durations_alike
    assert format_durations_alike(*seconds) == words


def test_a_refusal_of_a_field_names_the_option_clients_type():
    from gpupool.errors import bad_request
    from gpupool.leaseargs import option_words

    refused = bad_request("idle_timeout 99h is above your maximum of 24h (max_idle_timeout: ...)",
                          field="idle_timeout", max_idle_timeout=86400)
    said = option_words(refused)
    assert said.message == "--idle-timeout 99h is above your maximum of 24h (max_idle_timeout: ...)"
    assert (said.code, said.status, said.extra) == (refused.code, 400, refused.extra)
    assert option_words(bad_request("wait 2h is above this pool's maximum of 1h", field="wait")).message \
        .startswith("--wait 2h is above")
    other = bad_request("nothing about a field")
    assert option_words(other) is other


def test_formatting():
    assert format_bytes(80 * 1024**3) == "80.0 GiB" and format_bytes(None) == "unknown"
    assert format_duration(1830) == "30m 30s" and format_duration(7200) == "2h" and format_duration(5) == "5s"
    assert format_duration(0.25) == "0.25s"  # a sub-second bound is not "0s"
    assert format_share(0.5) == "0.50" and format_share(0.25, 1, noun=True) == "0.25 of a GPU"
    assert format_share(1.0, 2) == "2 GPUs" and format_share(1.0, 2, noun=True, whole=True) == "2 whole GPUs"
    assert format_share(0.50001) == "0.50001" and format_share(0.125, noun=True) == "0.125 of a GPU"


def test_lease_request_round_trip():
    body = {"fraction": 0.5, "memory": 2**30, "model": "A100", "idle_timeout": 600, "kernel_id": "k"}
    assert LeaseRequest.from_json(body).to_json() == {**body, "fraction": 0.5, "gpu_count": 1}
    assert LeaseRequest.from_json({"gpu_count": 2}).fraction == 1.0


@pytest.mark.parametrize("body, words", [
    ([], "JSON object"), ({"fraction": 0}, "in \\(0, 1\\]"), ({"fraction": 1.5}, "gpu_count"),
    ({"fraction": "half"}, "must be a number"), ({"fraction": True}, "must be a number"),
    ({"gpu_count": 2.5}, "whole number"), ({"gpu_count": 2, "fraction": 0.5}, "whole GPUs"),
    ({"memory": -1}, "bytes"), ({"memory": 2**60}, "bytes"), ({"memory": 1024}, "1 MiB"),
    ({"fraction": 1e-9}, "at least 0.01"), ({"idle_timeout": 0}, "idle_timeout"),
    ({"model": ""}, "non-empty"), ({"colour": "red"}, "unknown field"),
])
def test_lease_request_refusals_name_the_field(body, words):
    with pytest.raises(GPUPoolError, match=words) as caught:
        LeaseRequest.from_json(body)
    assert caught.value.status == 400 and caught.value.code == "bad_request"


def test_lease_states():
    assert [s.value for s in LeaseState if s.ended] == ["released", "failed", "reclaimed"]
    assert [s.value for s in LeaseState if s.holds_capacity] == ["starting", "active", "parking", "releasing"]


def test_transfer_round_trip_is_zero_copy_for_arrays_and_isolates_bad_values():
    array = np.arange(1_000_000, dtype=np.float32)
    values = {"array": array, "square": lambda x: x * x, "lock": threading.Lock(), "text": "hi"}
    header, buffers = dump_values(values)
    assert [i["name"] for i in header["items"]] == ["array", "square", "text"]
    assert "lock" in header["errors"] and "cannot be sent" in header["errors"]["lock"]
    assert any(isinstance(b, memoryview) and b.nbytes == array.nbytes for b in buffers), "array sent out of band"
    loaded, errors = load_values(header, [bytes(b) for b in buffers])
    assert np.array_equal(loaded["array"], array) and loaded["square"](3) == 9 and loaded["text"] == "hi"
    assert set(errors) == {"lock"}
    assert "array (numpy.ndarray, 3.8 MiB)" in describe(header["items"])


def test_tables_text_and_html():
    text, html = table(["a", "b"], [["1", "<x>"]])
    assert text.splitlines()[0].startswith("a") and "&lt;x&gt;" in html
    _, html = table(["lease", "note"], [["L-58b0d1600c8c", "idle, parked in 5m"]])
    assert '<td style="white-space: nowrap">L-58b0d1600c8c</td><td>idle, parked in 5m</td>' in html
    lease = Lease.from_json({"id": "L-1", "owner": "u", "state": "active", "fraction": 0.5, "gpu_count": 1,
                             "memory": 1024**3, "gpus": [{"index": 0, "name": "GPU"}], "idle_timeout": 60,
                             "idle_since": "2026-01-01T00:00:00Z", "worker": {"execution_state": "busy"}})
    assert "busy" in idle_countdown(lease)
    text = lease_table([lease], {"GPU-x": 40.0})[0]
    assert "L-1" in text and "unknown / 1.0 GiB" in text and "busy" in text
    lease.gpus[0]["uuid"] = "GPU-x"
    assert "40%" in lease_table([lease], {"GPU-x": 40.0})[0]
    lease.cpus, lease.host_memory = 0.5, 1024**3 // 2  # reserved, and what the cgroup gets
    assert "  0.5 CPU, 512.0 MiB  " in lease_table([lease])[0]  # no limits said (an older service): as reserved
    lease.cpu_limit, lease.host_memory_limit = 1.0, 1024**3 // 2
    assert "0.5 CPU reserved, limited to 1 CPU; 512.0 MiB  " in lease_table([lease])[0]
    lease.state = LeaseState.reclaimed  # ended: it holds no host share any more, nor says one
    assert "reserved" not in lease_table([lease])[0] and "512.0 MiB" not in lease_table([lease])[0]
    queued = Lease.from_json({"id": "L-2", "owner": "u", "state": "queued", "fraction": 0.5, "gpu_count": 1,
                              "memory": 0, "gpus": [], "idle_timeout": 60, "queue_position": 2,
                              "queue_estimate_s": 300.0})
    assert "queued: 2nd in line, about 5m" in lease_table([queued])[0]


def test_two_gpus_memory_is_said_as_two_times_the_limit_everywhere():
    lease = Lease.from_json({"id": "L-3", "owner": "u", "state": "active", "fraction": 1.0, "gpu_count": 2,
                             "memory": 80 * 1024**3, "gpus": [{"index": 0, "name": "A100"}, {"index": 1, "name": "A100"}],
                             "idle_timeout": 60, "worker": {"execution_state": "idle", "memory_used": 1024**3}})
    # The same words in the attach line and the table: the limit on each of the two GPUs
    assert memory_words(lease) == "2 x 80.0 GiB" and share_words(lease) == "2 x A100"
    assert "1.0 GiB / 2 x 80.0 GiB" in lease_table([lease])[0]  # used on both GPUs against both limits
    assert "2 x 80.0 GiB" in lease_table([lease])[1]  # the HTML %gpu status shows
    lease.gpu_count, lease.fraction, lease.gpus = 1, 0.125, lease.gpus[:1]
    assert memory_words(lease) == "80.0 GiB" and share_words(lease) == "0.125 of A100"


def test_the_holders_table_lists_sizes_shares_and_what_is_left_out():
    MiB = 1024**2
    answer = {"holders": [{"name": "model", "bytes": 96 * MiB, "devices": ["cuda:0"], "type": "Linear", "shares": []},
                          {"name": "batch", "bytes": 8 * MiB, "devices": ["cuda:0", "cuda:1"], "type": "list",
                           "shares": ["model"]},
                          {"name": "w", "bytes": 0, "devices": ["cuda:0"], "type": "Parameter", "shares": ["model"]}],
              "more": {"count": 3, "bytes": 3 * 1024**3}, "complete": False}
    text, markup = holders_table(answer)
    lines = text.splitlines()
    assert lines[0].split() == ["holds", "GPU", "memory", "size", "on", "type"]
    assert lines[2].split() == ["model", "96.0", "MiB", "cuda:0", "Linear"]
    assert lines[3].split() == ["batch", "8.0", "MiB,", "and", "model's", "cuda:0,", "cuda:1", "list"]
    assert lines[4].split() == ["w", "in", "model", "cuda:0", "Parameter"]
    assert lines[5] == "and 3 more, 3.0 GiB" and lines[6].startswith("(looked at in part")
    assert "<td>in model</td>" in markup and "<p>and 3 more, 3.0 GiB</p>" in markup
    assert holders_table({"holders": [], "more": {"count": 0, "bytes": 0}, "complete": True})[0] == \
        "no names hold GPU memory on the worker"


def test_a_queued_lease_shows_no_memory_rather_than_0_bytes():
    queued = Lease.from_json({"id": "L-2", "owner": "u", "state": "queued", "fraction": 0.5, "gpu_count": 1,
                              "memory": 0})
    row = lease_table([queued])[0].splitlines()[2]
    assert "0 B" not in row and row.split()[:3] == ["L-2", "queued", "-"]


def test_gpupool_pool_help_says_environments_show_only_where_there_is_a_choice():
    from gpupool.cli import _usage
    assert "nodes and GPUs as a table (and worker environments where a node offers a choice)" in _usage()
