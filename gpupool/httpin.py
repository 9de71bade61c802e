"""What the service and the agent take from the network before their handlers
decide anything: :func:`server_options` (bodies of at most :data:`MAX_BODY`
bytes, header and body timeouts), :class:`BoundedBody` (a body read only
after the token was checked, never buffered past the cap) and :func:`loads`
(JSON with bounded depth and numbers, only valid Unicode); docs/security.md,
"Requests that cost the service".
"""

from __future__ import annotations

import json
import sys
from typing import Any

from .schema import is_unicode

#: Largest request body accepted, in bytes (a registration of 64 GPUs is a few KiB).
MAX_BODY = 1024 * 1024
#: Largest body a known caller may send to be told it is too large (read and dropped, not kept).
DISCARD_LIMIT = 16 * MAX_BODY
#: Deepest nesting of arrays and objects in a body (the API's own bodies nest 3 deep).
MAX_DEPTH = 32
#: Longest number literal in a body, in characters (the API's numbers have at most 20 digits).
MAX_NUMBER_CHARS = 100
#: Seconds a connection may take to send a request's headers, and may sit idle between requests.
HEADER_TIMEOUT = 60.0
#: Seconds a request may take to send its body.
BODY_TIMEOUT = 30.0


def server_options(header_timeout: float = HEADER_TIMEOUT, body_timeout: float = BODY_TIMEOUT) -> dict[str, Any]:
    """Keyword arguments for ``HTTPServer``: bodies of at most :data:`MAX_BODY`
    bytes, headers within ``header_timeout`` seconds (also the longest a
    kept-alive connection may sit idle), a body within ``body_timeout``; a
    connection that stalls is closed (tornado applies each timeout to the whole
    of the headers or the body)."""
    return {"max_body_size": MAX_BODY, "max_buffer_size": 2 * MAX_BODY,
            "idle_connection_timeout": header_timeout, "body_timeout": body_timeout}


class TooLarge(ValueError):
    """A body over :data:`MAX_BODY` bytes."""


class BoundedBody:
    """Mixin for a ``@stream_request_body`` tornado handler: call
    :meth:`start_body` at the end of ``prepare`` (after the token was
    checked); :meth:`body` is then the request body, at most :data:`MAX_BODY`
    bytes, or raises :class:`TooLarge`."""

    _parts: list[bytes]
    _size: int = 0

    def start_body(self) -> None:
        """Get ready for the body (the caller is known now); :class:`TooLarge`
        at once when its declared length is over :data:`DISCARD_LIMIT`. A body
        between :data:`MAX_BODY` and that is read and dropped, then refused with
        400 by :meth:`body`: a client that sends its whole body before reading
        the answer (most do) then reads the 400 instead of a broken pipe."""
        self._parts, self._size = [], 0
        declared = self.request.headers.get("Content-Length")  # type: ignore[attr-defined]
        if declared is not None and declared.strip().isdigit() and int(declared) > DISCARD_LIMIT:
            raise TooLarge(f"the request body is larger than {MAX_BODY} bytes")
        self.request.connection.set_max_body_size(DISCARD_LIMIT)  # type: ignore[attr-defined]

    def data_received(self, chunk: bytes) -> None:
        """Tornado's call for each piece of the body: kept up to :data:`MAX_BODY`, counted beyond."""
        self._size += len(chunk)
        if self._size <= MAX_BODY:
            self.__dict__.setdefault("_parts", []).append(chunk)

    def body(self) -> bytes:
        """The whole body; :class:`TooLarge` when it was larger than :data:`MAX_BODY` bytes."""
        if self._size > MAX_BODY:
            raise TooLarge(f"the request body is larger than {MAX_BODY} bytes")
        return b"".join(getattr(self, "_parts", ()))

    def on_finish(self) -> None:
        # Answered before the body was read (refused in prepare): let tornado drop
        # the rest unread instead of answering a second time that it is too long;
        # it closes the connection once the answer is sent.
        future = getattr(self.request, "_body_future", None)  # type: ignore[attr-defined]
        if future is not None and not future.done():
            self.request.connection.set_max_body_size(sys.maxsize)  # type: ignore[attr-defined]
        super().on_finish()  # type: ignore[misc]


def loads(raw: bytes | str) -> Any:
    """``raw`` as JSON; ValueError in words for ``NaN``/``Infinity``, number
    literals longer than :data:`MAX_NUMBER_CHARS` (a 400-digit integer would
    overflow ``float()`` later), nesting deeper than :data:`MAX_DEPTH`
    (200,000 nested arrays would hit the recursion limit) and strings holding
    lone surrogates (``"\\ud800"``: no store can write them)."""
    try:
        value = json.loads(raw, parse_constant=_not_json, parse_int=_int, parse_float=_float)
    except RecursionError:
        raise ValueError(f"it nests arrays or objects more than {MAX_DEPTH} levels deep") from None
    _check(value)
    return value


def _check(value: Any) -> None:
    """ValueError if ``value`` nests deeper than :data:`MAX_DEPTH` or holds a string that is not valid Unicode."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not is_unicode(item):
                raise ValueError("a string in it is not valid Unicode (it holds a lone surrogate such as \\ud800)")
        elif isinstance(item, (list, dict)):
            if depth >= MAX_DEPTH:
                raise ValueError(f"it nests arrays or objects more than {MAX_DEPTH} levels deep")
            if isinstance(item, dict):
                stack.extend((key, depth + 1) for key in item)
                stack.extend((child, depth + 1) for child in item.values())
            else:
                stack.extend((child, depth + 1) for child in item)


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"it has a number of more than {MAX_NUMBER_CHARS} digits")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"it has a number of more than {MAX_NUMBER_CHARS} characters")
    return float(text)


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not a JSON number")
