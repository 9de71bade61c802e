"""``gpupool health URL``: ask a health endpoint (an agent's ``/health``, the service's
``/api/v1/health``) what it answers, for probes and scripts.

Exit 0 on HTTP 200, printing the status; 1 otherwise, printing the reason the endpoint
gives in words (a refusing agent's ``message``: ``c.AgentEnforcement.require_containment``) or
why it could not be reached. Kubernetes shows an exec probe's output in the pod's events,
so an agent pod that is not ready says why in ``kubectl describe pod``.

    gpupool health http://127.0.0.1:8766/health
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request

from .tls import client_context


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpupool health", description=(
        "Ask a gpupool health endpoint what it answers: exit 0 on 200, else 1 with the reason it gives."))
    parser.add_argument("url", help="the endpoint, e.g. http://127.0.0.1:8766/health (an agent)")
    parser.add_argument("--timeout", type=float, default=5, help="seconds to wait (default: %(default)s)")
    parser.add_argument("--ca-file", help="CA bundle for an https:// URL (default: GPUPOOL_CA_FILE)")
    return parser


def _words(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip()[:500]
    return str(data.get("message") or data.get("status") or data) if isinstance(data, dict) else str(data)


def _is_http_url(url: str) -> bool:
    """Whether urllib can call ``url``: ``http(s)://`` and a host (urllib
    raises ValueError, "unknown url type", for the rest)."""
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # raises ValueError for a port that is not a number
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def main(argv: list[str] | None = None) -> int:
    """``gpupool health URL``; returns 0 when it answered 200."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not _is_http_url(args.url):  # a usage error (exit 2), not a probe's "not ready" (exit 1)
        parser.error(f"{args.url!r} is not a URL; it should look like http://HOST:PORT/health")
    context = client_context(args.ca_file) if args.url.startswith("https:") else None
    try:
        with urllib.request.urlopen(args.url, timeout=args.timeout, context=context) as response:
            print(_words(response.read()))
            return 0
    except urllib.error.HTTPError as exc:
        print(f"{args.url} answered {exc.code}: {_words(exc.read())}")
    except (urllib.error.URLError, OSError) as exc:
        print(f"{args.url} cannot be reached: {getattr(exc, 'reason', None) or exc}")
    sys.stdout.flush()
    return 1
