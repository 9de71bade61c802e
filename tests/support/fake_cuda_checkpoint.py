#!/usr/bin/env python3
"""A stand-in for NVIDIA's ``cuda-checkpoint`` that keeps its command line (as
its ``--help`` documents it, r550 to r580) and its per-process state machine
(running -> locked -> checkpointed -> locked -> running), for tests on hosts
without a GPU. It checkpoints nothing: only a run on a GPU host checks the
real utility.

Environment: ``FAKE_CUDA_CHECKPOINT_DIR`` (required): where each pid's state
and ``calls.jsonl`` (one JSON argv per invocation) go;
``FAKE_CUDA_CHECKPOINT_VERSION``: ``580`` (default: ``--action`` and
``--device-map``), ``555`` (``--action``), ``550`` (``--toggle`` only);
``FAKE_CUDA_CHECKPOINT_FAIL``: an action that fails, in the driver's words;
``FAKE_CUDA_CHECKPOINT_PIDS``: the pids that have CUDA state (default: every one).
"""

import json
import os
import sys
from pathlib import Path

VERSION = os.environ.get("FAKE_CUDA_CHECKPOINT_VERSION", "580")
STATE_DIR = Path(os.environ["FAKE_CUDA_CHECKPOINT_DIR"])
HELP = f"""CUDA checkpoint and restore utility.
Version {VERSION}.00.00. Copyright (C) 2025 NVIDIA Corporation. All rights reserved.

Operations:
--get-state --pid <pid>
\tPrints the current checkpoint state of the process specified by <pid>
"""
if VERSION >= "555":
    HELP += """
--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>]""" + (
        " [--device-map <uuids>]" if VERSION >= "580" else "") + """
\tPerforms the specified action on <pid>.
"""
HELP += """
--toggle --pid <pid>
\tToggles the CUDA state in the specified process between the running and checkpointed states

--get-restore-tid --pid <pid>
\tRetrieves the CUDA restore thread ID of the process specified by <pid>

Options:
--pid|-p <pid>
--timeout|-t <timeout>
""" + ("--device-map|-d <device-map>\n" if VERSION >= "580" else "") + "--help|-h\n"
#: action -> (the state it needs, the state it leaves)
ACTIONS = {"lock": ("running", "locked"), "checkpoint": ("locked", "checkpointed"),
           "restore": ("checkpointed", "locked"), "unlock": ("locked", "running")}


def fail(words: str) -> None:
    print(words, file=sys.stderr)
    sys.exit(1)


def main(argv: list[str]) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "calls.jsonl", "a") as calls:
        calls.write(json.dumps(argv) + "\n")
    if argv in (["--help"], ["-h"]):
        print(HELP)
        return
    options, operation, i = {}, None, 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--get-state", "--toggle", "--get-restore-tid"):
            operation = arg
        elif arg == "--action" and VERSION >= "555":
            operation, i = ("--action", argv[i + 1]), i + 1
        elif arg in ("--pid", "-p", "--timeout", "-t") or (arg in ("--device-map", "-d") and VERSION >= "580"):
            if i + 1 >= len(argv):
                fail(f"Missing value for {arg}")
            options[arg.lstrip("-")[0]], i = argv[i + 1], i + 1
        else:
            fail(f"Unrecognized option '{arg}'\n{HELP}")
        i += 1
    pid = options.get("p")
    if operation is None or pid is None or not pid.isdigit():
        fail(f"An operation and --pid are required\n{HELP}")
    if not Path(f"/proc/{pid}").exists():
        fail(f"Could not find process {pid}: CUDA_ERROR_INVALID_VALUE")
    with_cuda = os.environ.get("FAKE_CUDA_CHECKPOINT_PIDS")
    if with_cuda is not None and pid not in with_cuda.split(","):
        fail(f"Process {pid} has no CUDA state: CUDA_ERROR_NOT_INITIALIZED")
    state_file = STATE_DIR / pid
    state = state_file.read_text() if state_file.exists() else "running"
    if operation == "--get-state":
        print(state)
        return
    if operation == "--get-restore-tid":
        print(pid)
        return
    if operation == "--toggle":
        if state not in ("running", "checkpointed"):
            fail(f"Process {pid} is {state}: CUDA_ERROR_ILLEGAL_STATE")
        state_file.write_text("checkpointed" if state == "running" else "running")
        return
    action = operation[1]
    if action not in ACTIONS:
        fail(f"Unknown action '{action}'")
    needs, leaves = ACTIONS[action]
    if os.environ.get("FAKE_CUDA_CHECKPOINT_FAIL") == action:
        fail(f"Failed to {action} process {pid}: CUDA_ERROR_NOT_SUPPORTED")
    if state != needs:
        fail(f"Could not {action} process {pid} in state {state}: CUDA_ERROR_ILLEGAL_STATE")
    device_map = options.get("d")
    if device_map is not None:
        if action != "restore" or not all(p.count("=") == 1 and p.startswith("GPU-") for p in device_map.split(",")):
            fail(f"Invalid device map '{device_map}': CUDA_ERROR_INVALID_VALUE")
    state_file.write_text(leaves)


if __name__ == "__main__":
    main(sys.argv[1:])
