"""The notebook <-> worker and front end <-> kernel comms, as gpupool.wire
declares them: the status comm's TypeScript side names what the Python
declaration names, the worker's %gpu prompt reads back, and every transfer op
reads back as it was written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpupool.wire import status

SOURCES = Path(__file__).resolve().parent.parent / "labextension" / "src"


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
