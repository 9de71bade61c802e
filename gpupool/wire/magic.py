"""``%gpu`` in a cell on the worker, on the wire: the worker asks the
notebook's gpupool kernel to run the line over its stdin channel, the one
channel that works while its shell is busy with that very cell (docs/api.md, "The
forwarding kernel": "%gpu on the worker").

- The worker sends an ``input_request`` whose prompt is :func:`ask_prompt`;
  the gpupool kernel reads the line back with :func:`asked_line`, runs it
  and answers the request with :func:`answer_text`, never showing any of it
  to the user; the worker reads that with :func:`read_answer`.
- A forwarded ``execute_request`` always allows stdin (for the prompt above);
  its metadata key :data:`STDIN_KEY` carries the front end's own
  ``allow_stdin``, which the worker applies to the user's ``input()``.

Pure (no ipykernel import): the worker's extension imports it.
"""

from __future__ import annotations

import json

#: The start of a prompt that asks the notebook kernel to run a ``%gpu`` line.
MAGIC_PROMPT = "\x00gpupool-magic:"
#: Metadata key of a forwarded ``execute_request``: the front end's own ``allow_stdin``.
STDIN_KEY = "gpupool_allow_stdin"


def ask_prompt(line: str) -> str:
    """The prompt asking for ``%gpu LINE``: MAGIC_PROMPT and ``{"line": LINE}``."""
    return MAGIC_PROMPT + json.dumps({"line": line})


def asked_line(prompt: str) -> str | None:
    """The line a prompt of :func:`ask_prompt` asks for; None for any other
    prompt (the user's own ``input()``). ValueError when its JSON is broken."""
    if not prompt.startswith(MAGIC_PROMPT):
        return None
    return json.loads(prompt[len(MAGIC_PROMPT):]).get("line", "")


def answer_text(ok: bool, message: str) -> str:
    """The gpupool kernel's answer: ``{"ok": bool, "message": words}`` as JSON."""
    return json.dumps({"ok": ok, "message": message})


def read_answer(text: str) -> tuple[bool, str]:
    """``(ok, message)`` of an :func:`answer_text`; ValueError when ``text``
    is not JSON (no gpupool kernel answered: the front end's ``input()`` did)."""
    result = json.loads(text)
    return bool(result.get("ok")), result.get("message") or ""
