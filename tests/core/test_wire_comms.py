"""The notebook <-> worker and front end <-> kernel comms, as gpupool.wire
declares them: the status comm's TypeScript side names what the Python
declaration names, the worker's %gpu prompt reads back, and every transfer op
reads back as it was written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpupool.wire import magic, status, transfer
from gpupool.wire.transfer import (Attach, Fetch, ForgetTraceback, GpuMemory, Have, LoadSpill, Op, ParkGpu, Pull,
                                   PullAll, Push, ResumeGpu, Spill, Versions, read_request)

SOURCES = Path(__file__).resolve().parents[2] / "labextension" / "src"


def _typescript() -> str:
    return "\n".join(path.read_text() for path in sorted(SOURCES.glob("*.ts")))


def _interface_keys(source: str, name: str) -> set[str]:
    """The top-level keys of ``export interface NAME { ... }`` in ``source``."""
    start = source.find(f"export interface {name} {{")
    assert start >= 0, f"labextension/src declares no interface {name}"
    depth, position = 0, source.index("{", start)
    for end in range(position, len(source)):
        depth += {"{": 1, "}": -1}.get(source[end], 0)
        if depth == 0:
            break
    body = source[position + 1:end]
    lines = [line for line in body.splitlines() if not re.match(r"\s*(\*|/)", line)]
    return {m.group(1) for line in lines if (m := re.match(r"\s{2}(\w+)\??:", line))}


@pytest.mark.parametrize("interface, keys", [("ILeaseState", status.STATE_KEYS), ("IReply", status.REPLY_KEYS),
                                             ("IDefaults", status.DEFAULTS_KEYS)])
def test_the_extensions_status_messages_have_the_declared_keys(interface, keys):
    found = _interface_keys(_typescript(), interface)
    assert not set(keys) - found, f"{interface} in labextension/src lacks {sorted(set(keys) - found)}"
    assert not found - set(keys), f"{interface} in labextension/src has {sorted(found - set(keys))}, " \
                                  "which gpupool.wire.status does not declare"


def test_the_extension_opens_the_declared_target_and_knows_every_phase_and_request():
    source = _typescript()
    assert f"export const TARGET = '{status.TARGET}';" in source, f"labextension/src does not target {status.TARGET}"
    phase = re.search(r"phase: ([^;]+);", source).group(1)
    missing = [p for p in status.PHASES if f"'{p}'" not in phase]
    assert not missing, f"ILeaseState.phase in labextension/src lacks {missing}"
    unasked = [r for r in status.REQUESTS if f"request('{r}'" not in source]
    assert not unasked, f"labextension/src never sends the requests {unasked}"
    holders = re.search(r"holders\?: \{([^}]*)\}", source).group(1)
    missing = [k for k in status.HOLDERS_KEYS if f"{k}?:" not in holders]
    assert not missing, f"IReply.holders in labextension/src lacks {missing}"


TICKET = {"id": "00", "key": "11", "cipher": "none"}
REQUESTS = [Push(header={"items": [], "errors": {}}, devices={"x": "cuda:0"}, stream={**TICKET, "sizes": [3]}),
            Pull(names=["x"], stream=TICKET), PullAll(max_bytes=10, stream=TICKET, stream_all=True),
            Fetch(source={"ip": "10.0.0.2", "transfer_port": 9000}, stream={**TICKET, "sizes": []}, header={}),
            Have(names=["x", "y"]), Versions(), Attach(execution_count=3, cwd="/home/u/nb", home="/home/u", user="u"),
            GpuMemory(top=3), ForgetTraceback(), ParkGpu(), ResumeGpu(), Spill(path="/spill/x"),
            LoadSpill(path="/spill/x")]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.OP.value)
def test_every_transfer_request_reads_back_as_written(request_):
    assert read_request(request_.to_json()) == request_


def test_the_transfer_requests_are_the_ops_the_worker_answers():
    from gpupool.node.worker_extension.comm import PARKING_OPS, REMOTING_OPS

    assert {r.OP for r in REQUESTS} == set(Op)
    assert {Op.push, Op.pull, Op.pull_all, *REMOTING_OPS, *PARKING_OPS} == set(Op)


def test_a_transfer_request_leaves_out_what_it_does_not_say():
    assert PullAll().to_json() == {"op": "pull_all"}
    assert Pull(names=["a"]).to_json() == {"op": "pull", "names": ["a"]}
    assert Push(header={}, devices={}).to_json() == {"op": "push", "header": {}, "devices": {}}
    assert read_request({"op": "pull"}) == Pull(names=[]) and read_request({"op": "gpu_memory"}).top == 10


def test_an_unknown_op_or_a_missing_field_is_named():
    assert read_request({"op": "teleport"}) is None and read_request({}) is None and read_request({"op": []}) is None
    with pytest.raises(KeyError, match="path"):
        read_request({"op": "spill"})
    assert transfer.TARGET == "gpupool.transfer"


def test_the_workers_gpu_line_reads_back():
    prompt = magic.ask_prompt("status --json")
    assert prompt.startswith(magic.MAGIC_PROMPT) and magic.asked_line(prompt) == "status --json"
    assert magic.asked_line("Your name? ") is None
    assert magic.read_answer(magic.answer_text(False, "no")) == (False, "no")
    with pytest.raises(ValueError):
        magic.read_answer("\x04")
