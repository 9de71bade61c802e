"""An HTTP server that is not gpupool, for the wrong URLs people plausibly give: it answers
every call as JupyterHub answers a path it does not serve (404 with ``{"status": 404,
"message": null}``), or, for paths under ``/page``, with a 200 web page (a hub's login page).
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

#: The body JupyterHub answers a 404 of its API with.
HUB_404 = {"status": 404, "message": None}


class _NotGPUPool(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        if self.path.startswith("/page"):
            status, kind, body = 200, "text/html", b"<!DOCTYPE html><html><body>Sign in</body></html>"
        else:
            status, kind, body = 404, "application/json", json.dumps(HUB_404).encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, format: str, *args: object) -> None:  # quiet: the test's output is the client's
        pass


@contextmanager
def not_gpupool() -> Iterator[str]:
    """Serve :class:`_NotGPUPool` on a free port of 127.0.0.1; yields its URL, stops it afterwards."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotGPUPool)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
