"""Calls to a real node agent's HTTP API as the tests make them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


TOKEN = "agent-token-for-tests"


def call(url: str, method: str = "GET", body: Any = None, token: str | None = TOKEN) -> tuple[int, Any]:
    """One HTTP call; returns (status, decoded JSON)."""
    request = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode())
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read() or b"null")
