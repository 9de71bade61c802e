"""A real JupyterLab server and a notebook in Debian's Chromium, driven by playwright.

:func:`missing` says why the browser tests cannot run here (or ``None``);
:func:`start_lab` starts ``jupyter lab`` on a free port with its own config,
data, runtime and settings directories (so no kernelspec or setting of the
person running the tests leaks in) and the kernelspecs under ``jupyter_path``
visible; :class:`Notebook` runs the cells of an open notebook as a person
would: click, Shift+Enter, wait for the prompt's number, read the output.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpupool.demo_pool import free_port, stop_process, wait_for

CHROMIUM = "/usr/bin/chromium"
#: How long one step in the page may take (ms): a cell, a widget, a popup.
STEP_MS = 20_000
DONE_PROMPT = re.compile(r"\[\d+\]:")

# JupyterLab user settings for the test: every cell stays in the DOM (no windowing, so a
# locator finds cell 20 without scrolling), no news or update toasts over the notebook.
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
}


def missing() -> str | None:
    """Why a browser test cannot run on this machine, in words; ``None`` when it can."""
    if not os.access(CHROMIUM, os.X_OK):
        return (f"{CHROMIUM} not found: install Debian's chromium (`apt-get install chromium`, "
                "which `make install` does as root)")
    for module, package in (("playwright", "playwright"), ("jupyterlab", "jupyterlab"),
                            ("ipywidgets", "ipywidgets"), ("tqdm", "tqdm")):
        try:
            __import__(module)
        except ImportError:
            return f"{package} is not installed: pip install -e '.[test]'"
    return None


@dataclass
class LabServer:
    """A running ``jupyter lab``: ``url`` (no trailing slash), its ``token`` and ``log``."""

    proc: subprocess.Popen
    url: str
    token: str
    root: Path
    log: Path

    def notebook_url(self, relpath: str) -> str:
        """The page that opens ``relpath`` (relative to the root dir) in a fresh workspace."""
        return f"{self.url}/lab/tree/{relpath}?token={self.token}&reset"

    def api(self, path: str) -> Any:
        req = urllib.request.Request(f"{self.url}{path}", headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def wait_ready(self, timeout: float = 60) -> None:
        """Until the server answers its REST API. Raises GPUPoolError ``start_failed``
        (with the log's tail) when it exits or does not answer within ``timeout`` s."""

        def answers() -> bool:
            try:
                self.api("/api/status")
            except OSError:
                return False
            return True

        wait_for(answers, timeout, "jupyter lab", self.proc, self.log)

    def stop(self) -> int:
        return stop_process(self.proc)


def start_lab(home: Path, root: Path, jupyter_path: Path | None, env: dict[str, str] | None = None) -> LabServer:
    """Launch ``jupyter lab`` serving ``root``; its config, data, runtime and settings under
    ``home``. Returns at once: call :meth:`LabServer.wait_ready` before using it (so the
    server starts while the caller starts other things).

    ``jupyter_path``: a ``share/jupyter`` folder whose ``kernels/`` it sees (besides this
    Python's own ``python3``); kernelspecs put there later are seen too.
    """
    for relpath, values in SETTINGS.items():
        target = home / "settings" / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(values))
    token = secrets.token_hex(16)
    port = free_port()
    env = {**os.environ, **(env or {}),
           "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_DATA_DIR": str(home / "data"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"), "JUPYTER_PLATFORM_DIRS": "1"}
    if jupyter_path is not None:
        env["JUPYTER_PATH"] = str(jupyter_path)
    log = home / "jupyter-lab.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
             f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={token}",
             # no PyPI look-ups for the extension manager; root in CI and containers
             "--LabApp.extension_manager=readonly", "--allow-root", "--debug"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=root)
    return LabServer(proc, f"http://127.0.0.1:{port}", token, root, log)


def write_notebook(path: Path, cells: list[str], kernel: str, display_name: str) -> None:
    """An nbformat 4 notebook with ``cells`` (code, not run) on kernelspec ``kernel``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": kernel, "display_name": display_name, "language": "python"},
                     "language_info": {"name": "python"}},
        "cells": [{"cell_type": "code", "id": f"cell-{i}", "metadata": {}, "execution_count": None,
                   "outputs": [], "source": source} for i, source in enumerate(cells)],
    }, indent=1))


def launch_chromium(playwright):
    """Debian's chromium under playwright (``playwright install`` cannot download here).

    Also sets playwright's ``expect`` to wait up to :data:`STEP_MS` (its default is 5 s).
    """
    from playwright.sync_api import expect

    expect.set_options(timeout=STEP_MS)
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                      args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])


class Notebook:
    """One open notebook page. Cells are found by index in the notebook, from 0."""

    def __init__(self, page) -> None:
        self.page = page
        #: What the page logged ("error: ..."), for the report when a step fails.
        self.console: list[str] = []
        page.on("console", lambda message: self.console.append(f"{message.type}: {message.text}"))

    def wait_ready(self, display_name: str, timeout_ms: float = 60_000) -> None:
        """Until the notebook shows its cells and its kernel (by display name) is idle."""
        from playwright.sync_api import expect

        expect(self.page.locator(".jp-Notebook .jp-Cell").first).to_be_visible(timeout=timeout_ms)
        expect(self.page.locator(".jp-KernelName").first).to_have_text(display_name, timeout=timeout_ms)
        expect(self.page.locator(".jp-Notebook-ExecutionIndicator").first).to_have_attribute(
            "data-status", "idle", timeout=timeout_ms)

    def cell(self, index: int):
        return self.page.locator(".jp-Notebook .jp-Cell").nth(index)

    def edit(self, index: int):
        """Click into cell ``index``'s editor (edit mode, cursor at the end); returns the editor."""
        editor = self.cell(index).locator(".cm-content")
        editor.click()
        self.page.keyboard.press("Control+End")
        return editor

    def run(self, index: int, timeout_ms: float = STEP_MS) -> str:
        """Run cell ``index`` with Shift+Enter and wait for its number; returns its output text."""
        from playwright.sync_api import expect

        self.edit(index)
        self.page.keyboard.press("Shift+Enter")
        expect(self.prompt_locator(index)).to_have_text(DONE_PROMPT, timeout=timeout_ms)
        return self.output(index)

    def start(self, index: int) -> None:
        """Shift+Enter on cell ``index`` without waiting for it to finish."""
        self.edit(index)
        self.page.keyboard.press("Shift+Enter")

    def prompt_locator(self, index: int):
        return self.cell(index).locator(".jp-InputPrompt")

    def prompt(self, index: int) -> int | None:
        """The execution count the prompt shows (``[7]:`` → 7), ``None`` for ``[ ]``/``[*]``."""
        found = re.search(r"\[(\d+)\]", self.prompt_locator(index).inner_text())
        return int(found.group(1)) if found else None

    def outputs(self, index: int):
        return self.cell(index).locator(".jp-OutputArea-output")

    def output(self, index: int) -> str:
        """All text the cell's output area shows, outputs joined by newlines."""
        return "\n".join(self.outputs(index).all_inner_texts())

    def wait_output(self, index: int, pattern: str | re.Pattern, timeout_ms: float = STEP_MS) -> str:
        """Until the cell's output area shows ``pattern``; returns the text."""
        from playwright.sync_api import expect

        expect(self.cell(index).locator(".jp-Cell-outputArea")).to_contain_text(pattern, timeout=timeout_ms)
        return self.output(index)

    def press_until_visible(self, key: str, popup, tries: int = 6, each_ms: float = 2_500) -> None:
        """Press ``key`` until ``popup`` (a locator) shows, as a person presses Tab again.

        Needed because JupyterLab binds the completer and tooltip to a cell a moment after
        the cell becomes active; a key pressed before then does nothing. Raises
        AssertionError after ``tries`` presses.
        """
        from playwright.sync_api import expect

        for attempt in range(tries):
            self.page.keyboard.press(key)
            try:
                expect(popup).to_be_visible(timeout=each_ms)
                return
            except AssertionError:
                if attempt == tries - 1:
                    raise

    def wait_widget(self, index: int, selector: str, timeout_ms: float = STEP_MS):
        """Until cell ``index`` shows a widget matching ``selector``; returns its locator.

        Raises AssertionError at once, with the output, when the cell says
        "Error displaying widget" instead (a model the front end never got).
        """
        from playwright.sync_api import expect

        widget = self.cell(index).locator(selector)
        broken = self.cell(index).get_by_text("Error displaying widget")
        expect(widget.or_(broken).first).to_be_visible(timeout=timeout_ms)
        if broken.count():
            raise AssertionError(f"cell {index} shows no widget: {self.output(index)!r}")
        return widget.first


class Steps:
    """Checks that go on after one fails: each failure is kept with a screenshot, and
    :meth:`check` raises once at the end with all of them.

    Use ``with steps("tqdm bar"):`` around each check; the page is screenshotted into
    ``shots`` (a folder) as ``NN-name.png`` when the block raises. ``with
    steps("name", known="why"):`` marks a failure already reported (an issue
    number in ``why``): it is printed, not raised, and the step passing is
    raised instead, so that the mark is taken off once fixed.
    """

    def __init__(self, page, shots: Path, lab: LabServer, console: list[str] | None = None) -> None:
        self.page, self.shots, self.lab = page, shots, lab
        self.console = console if console is not None else []
        self.failures: list[str] = []
        self.passed: list[str] = []
        self.known: list[str] = []
        self.seconds: dict[str, float] = {}
        self._name, self._known = "", None

    def __call__(self, name: str, known: str | None = None) -> "Steps":
        self._name, self._known = name, known
        return self

    def __enter__(self) -> "Steps":
        self._started = time.monotonic()
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        name = self._name
        self.seconds[name] = round(time.monotonic() - self._started, 1)
        if exc is None:
            if self._known:
                self.failures.append(f"{name}: passes now; take off its known failure mark ({self._known})")
            else:
                self.passed.append(name)
            return False
        if not isinstance(exc, Exception):
            return False
        shot = self.shots / f"{len(self.failures) + len(self.passed):02d}-{re.sub(r'[^a-z0-9]+', '-', name.lower())}.png"
        try:
            self.page.screenshot(path=str(shot), full_page=True)
        except Exception as err:  # the page itself is gone: say so instead of a picture
            shot = Path(f"(no screenshot: {err})")
        message = str(exc).strip().splitlines()
        words = f"{name}: {type(exc).__name__}: {' '.join(message[:6])[:600]} [screenshot {shot}]"
        if self._known:
            self.known.append(f"{words} (known: {self._known})")
            print(f"KNOWN FAILURE {name} ({self._known}); screenshot: {shot}", flush=True)
        else:
            self.failures.append(words)
            print(f"FAILED STEP {name}; screenshot: {shot}", flush=True)
        # Close whatever popup the failed step left open before the next one.
        self.page.keyboard.press("Escape")
        return True

    def check(self) -> None:
        """Raise AssertionError listing every failed step (with the server log's path)."""
        print("step seconds:", self.seconds, flush=True)
        for words in self.known:
            print("known failure:", words, flush=True)
        if self.failures:
            console = self.shots / "console.log"
            console.write_text("\n".join(self.console) + "\n")
            raise AssertionError(f"{len(self.failures)} of {len(self.failures) + len(self.passed)} checks failed "
                                 f"(jupyter lab log: {self.lab.log}; the page's console: {console}):\n- "
                                 + "\n- ".join(self.failures))

