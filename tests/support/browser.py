"""Headless Chromium driven over the DevTools protocol, for page tests.

Debian's ``chromium`` package (``/usr/bin/chromium``); each :class:`Browser`
has a fresh profile, so each one is a new visitor with no cookies. Commands
go over the page target's websocket (``websocket-client``, which
jupyter_server brings); events are ignored.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket

from gpupool.demo_pool import free_port, stop_process, wait_for

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1200,1400"]


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless Chromium with one page. Use as a context manager."""

    def __init__(self) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="gpupool-chromium-")
        port = free_port()
        self.log = Path(self._profile.name) / "chromium.log"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([chromium_path(), *FLAGS, f"--user-data-dir={self._profile.name}",
                                          f"--remote-debugging-port={port}", "about:blank"],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            page = wait_for(lambda: self._page_target(port), 30, "chromium", self.proc, self.log)
            self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        except BaseException:
            self.close()
            raise
        self._ids = itertools.count(1)

    @staticmethod
    def _page_target(port: int) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as resp:
                targets = json.loads(resp.read())
        except OSError:
            return None
        return next((t for t in targets if t.get("type") == "page"), None)

    def send(self, method: str, **params: Any) -> dict:
        """One DevTools command; returns its result. Raises RuntimeError on a protocol error."""
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def goto(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def wait_until(self, expression: str, timeout: float = 30, what: str = "the page") -> Any:
        """Poll a JavaScript expression until it is truthy (a page may be mid-navigation: errors count as not yet)."""
        def check():
            try:
                return self.evaluate(expression)
            except RuntimeError:
                return None
        return wait_for(check, timeout, what, self.proc, self.log)

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        stop_process(self.proc, timeout=10)
        time.sleep(0.1)  # let chromium's helpers leave the profile before it is removed
        self._profile.cleanup()

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
