"""gpupool's JupyterLab extension in a real JupyterLab 4 in Debian's
chromium, driven by playwright, on a real pool (a service with heartbeat TTL 3 s
and one agent with two simulated A100s).

The extension is the committed build, ``labextension/prebuilt``; the wheel
carries it (checked without a browser: ``jupyter labextension list`` finds it
installed from the wheel). In the browser: the status bar says "detached"; the
Kernel menu has the commands; "Acquire GPU…" from the palette with a bad size
shows the magic's refusal words in the dialog and changes nothing; with a good
one the status bar shows the share and GPU; a kernel restart shows the new
kernel detached; "Release" in the status popup detaches; a 4 s idle timeout
brings the idle warning and "parked" as notifications and the status "parked";
the next cell resumes and the status follows; "Release GPU" from the palette
detaches, as ``%gpu status`` then says, and the ended worker's widget shows
JupyterLab's disconnected mark (a parked one did not; a CPU kernel's never).
A python3 notebook gets no comm and no GPU item. Screenshots on failure under the test's tmp_path.

The browser is launched as tests/support/lab.py launches it (the browser test's).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import urllib.request
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from frontend import install_kernelspec
from lab import STEP_MS, launch_chromium
from gpupool import __version__
from gpupool.demo_pool import free_port, stop_process, wait_for
from procs import start_agent, start_service

ROOT = Path(__file__).resolve().parents[2]
PREBUILT = ROOT / "labextension" / "prebuilt"
CHROMIUM = "/usr/bin/chromium"
MODEL = "NVIDIA A100-SXM4-80GB"
NAME = "gpupool-lab"


def _missing() -> str | None:
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} not found: install Debian's chromium (`apt-get install chromium`, which `make install` does as root)"
    for module in ("playwright", "jupyterlab"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed: pip install -e '.[test]'"
    return None


def _labextension_list(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"], env=env,
                          capture_output=True, text=True, timeout=120)
    return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)


@pytest.mark.skipif(not PREBUILT.joinpath("package.json").exists(), reason="labextension/prebuilt is not built")
def test_the_wheel_carries_the_prebuilt_extension_and_jupyterlab_lists_it(tmp_path):
    pytest.importorskip("jupyterlab")
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(wheels)], check=True, capture_output=True, timeout=300)
    wheel, = wheels.glob("gpupool-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    root = f"gpupool-{__version__}.data/data/"
    data = f"{root}share/jupyter/labextensions/{NAME}/"
    built = {str(p.relative_to(PREBUILT)) for p in PREBUILT.rglob("*") if p.is_file()}
    assert {n[len(data):] for n in names if n.startswith(data)} == built | {"install.json"}, names
    # Install the wheel's data files as an installer does (into the prefix); `pip install --prefix`
    # would first uninstall this environment's own gpupool.
    prefix = tmp_path / "prefix"
    with zipfile.ZipFile(wheel) as archive:
        for name in names:
            if name.startswith(root):
                target = prefix / name[len(root):]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(name))
    env = {**os.environ, "JUPYTER_PATH": str(prefix / "share" / "jupyter"), "JUPYTER_PLATFORM_DIRS": "1",
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data")}
    listed = _labextension_list(env)
    assert re.search(rf"{NAME} v{re.escape(__version__)} enabled\s+OK \(python, gpupool\)", listed), listed


WHY = _missing()


class Lab:
    """``jupyter lab`` on a free port, its config, data, settings and workspaces under ``home``."""

    def __init__(self, home: Path, root: Path, jupyter_path: Path) -> None:
        settings = {
            # no news or update toasts over the page: the test reads gpupool's toasts
            "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                                 "checkForUpdates": False},
        }
        for relpath, values in settings.items():
            target = home / "settings" / relpath
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(values))
        self.token, port, self.root = secrets.token_hex(16), free_port(), root
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_DATA_DIR": str(home / "data"),
               "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
               "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"), "JUPYTER_PLATFORM_DIRS": "1",
               "JUPYTER_PATH": str(jupyter_path)}
        self.env, self.log = env, home / "jupyter-lab.log"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                 f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={self.token}",
                 "--LabApp.extension_manager=readonly", "--allow-root"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=root)

    def wait_ready(self, timeout: float = 90) -> None:
        def answers() -> bool:
            try:
                req = urllib.request.Request(f"{self.url}/api/status", headers={"Authorization": f"token {self.token}"})
                urllib.request.urlopen(req, timeout=5).read()
            except OSError:
                return False
            return True

        wait_for(answers, timeout, "jupyter lab", self.proc, self.log)

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab seeing the committed prebuilt extension and a gpupool kernelspec for a pool of its own."""
    home, root = tmp_path_factory.mktemp("labext-home"), tmp_path_factory.mktemp("labext-root")
    share = home / "prefix" / "share" / "jupyter"
    (share / "labextensions").mkdir(parents=True)
    (share / "labextensions" / NAME).symlink_to(PREBUILT)
    server = Lab(home, root, share)
    service = agent = None
    try:
        service = start_service(home, config={"heartbeat_ttl": 3.0})
        agent = start_agent(home, service)
        install_kernelspec(home / "prefix", service.url, service.user_token)
        server.wait_ready()
        server.service = service  # the tests' own requests: a pool filled, a lease parked
        yield server
    finally:
        server.stop()
        for proc in (agent, service):
            if proc is not None:
                proc.stop()


@pytest.fixture(scope="module")
def pressure_lab(tmp_path_factory):
    """JupyterLab as ``lab``, on a pool of one simulated GPU under pressure: 3 s grace, a 10 s preemption
    notice (time to read the status bar), and ann, who asks for the GPU through the API."""
    home, root = tmp_path_factory.mktemp("labext-pressure-home"), tmp_path_factory.mktemp("labext-pressure-root")
    share = home / "prefix" / "share" / "jupyter"
    (share / "labextensions").mkdir(parents=True)
    (share / "labextensions" / NAME).symlink_to(PREBUILT)
    server = Lab(home, root, share)
    service = agent = None
    try:
        service = start_service(home, tokens={"ann": "ann-token-" + "7" * 16},
                                config={"heartbeat_ttl": 3.0, "idle_warning": 0, "pressure_grace": 3.0,
                                        "preemption_notice": 10.0})
        agent = start_agent(home, service, simulate="1xA100-80GB")
        install_kernelspec(home / "prefix", service.url, service.user_token)
        server.wait_ready()
        server.service = service
        yield server
    finally:
        server.stop()
        for proc in (agent, service):
            if proc is not None:
                proc.stop()


def _notebook(path: Path, cells: list[str]) -> None:
    path.write_text(json.dumps({
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "gpupool", "display_name": "Python 3 (gpupool)", "language": "python"},
                     "language_info": {"name": "python"}},
        "cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None, "outputs": [],
                   "source": source} for i, source in enumerate(cells)]}))


#: The vertical middle of the text in the first element of each selector (a Range over its text: where
#: the letters are drawn, which the element's own box does not show).
TEXT_MIDDLES = """selectors => selectors.map(selector => {
    const range = document.createRange();
    range.selectNodeContents(document.querySelector(selector));
    const box = range.getBoundingClientRect();
    return box.top + box.height / 2;
})"""


@contextmanager
def opened(lab, tmp_path: Path, notebook: str) -> Iterator["Page"]:
    """``notebook`` (a path under ``lab``'s root) open in a fresh chromium: its :class:`Page`. A failure
    is raised naming the step the test was at (``Page.step``), with a screenshot of the page and the lab's
    log; the browser is closed after."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        page = browser.new_page(viewport={"width": 1500, "height": 900})
        page.set_default_timeout(STEP_MS)
        nb = Page(page)
        try:
            page.goto(f"{lab.url}/lab/tree/{notebook}?token={lab.token}&reset")
            yield nb
        except Exception as exc:
            shot = tmp_path / "failure.png"
            page.screenshot(path=str(shot), full_page=True)
            raise AssertionError(f"step {nb.step!r} failed: {exc}\n(screenshot {shot}, jupyter lab log {lab.log})"
                                 ) from exc
        finally:
            browser.close()


class Page:
    """The open notebook and the extension's parts of the page."""

    def __init__(self, page) -> None:
        self.page = page
        #: The step the test is at, named in its failure.
        self.step = "open the notebook"
        self.status = page.locator(".jp-gpupool-status")
        self.dialog = page.locator(".jp-Dialog")
        self.toasts = page.locator(".Toastify__toast", has_text="GPU:")

    def cell(self, index: int):
        return self.page.locator(".jp-Notebook .jp-Cell").nth(index)

    def run(self, index: int) -> str:
        from playwright.sync_api import expect

        cell = self.cell(index)
        cell.locator(".cm-content").click()
        self.page.keyboard.press("Shift+Enter")
        expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"))
        return "\n".join(cell.locator(".jp-OutputArea-output").all_inner_texts())

    def command(self, label: str) -> None:
        """Run ``label`` from the command palette, as a person would."""
        self.page.keyboard.press("Control+Shift+C")
        palette = self.page.locator(".lm-CommandPalette-input")
        palette.fill(label)
        self.page.locator(".lm-CommandPalette-item", has_text=label).first.click()

    def acquire(self, amount: str, idle: str = "") -> None:
        self.command("Acquire GPU…")
        self.dialog.locator("input[name=amount]").fill(amount)
        self.dialog.locator("input[name=idle-timeout]").fill(idle)
        self.dialog.locator(".jp-Dialog-footer button", has_text="Acquire").click()

    def release_from_popup(self) -> str:
        """Click the status item, read the details, click Release; returns the details' text."""
        from playwright.sync_api import expect

        self.status.click()
        expect(self.dialog.locator(".jp-gpupool-details")).to_be_visible()
        text = self.dialog.inner_text()
        self.dialog.locator(".jp-Dialog-footer button", has_text="Release").click()
        return text

    def toast(self, pattern: str):
        return self.page.get_by_text(re.compile(pattern)).first


@pytest.mark.skipif(WHY is not None, reason=f"no browser test: {WHY}")
@pytest.mark.timeout(240)
def test_status_bar_dialog_popup_and_notifications_follow_the_lease(lab, tmp_path):
    from playwright.sync_api import expect

    _notebook(lab.root / "gpu.ipynb", ["import os", "x = 41", "x + 1", "%gpu status",
                                       'import ipywidgets\nipywidgets.Label("on the CPU kernel")',
                                       'import ipywidgets\nipywidgets.IntSlider(description="on the worker")'])
    dead = ".jupyter-widgets-disconnected"
    with opened(lab, tmp_path, "gpu.ipynb") as nb:
        page = nb.page
        nb.step = "open the notebook"
        expect(page.locator(".jp-KernelName").first).to_have_text("Python 3 (gpupool)", timeout=60_000)
        nb.step = "status bar says detached"
        expect(nb.status).to_have_text("GPU: detached", timeout=60_000)
        nb.step = "the status item sits in line with its neighbours"
        mine, other = page.evaluate(TEXT_MIDDLES, [".jp-gpupool-status",
                                                   ".jp-StatusBar-TextItem:not(.jp-gpupool-status)"])
        assert abs(mine - other) <= 1, (mine, other)
        assert "Traceback" not in nb.run(0)

        nb.step = "the Kernel menu has the commands"
        page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").click()
        menu = page.locator(".lm-Menu")
        for label in ("Acquire GPU…", "Release GPU", "GPU status"):
            expect(menu.locator(".lm-Menu-itemLabel", has_text=label)).to_be_visible()
        page.keyboard.press("Escape")

        nb.step = "a bad size shows the magic's words in the dialog and changes nothing"
        nb.acquire("1.5")
        error = nb.dialog.locator(".jp-gpupool-error")
        expect(error).to_have_text(re.compile(r"GPU amount '1\.5' is above 1 but not whole"))
        expect(nb.dialog).to_be_visible()
        expect(nb.status).to_have_text("GPU: detached")

        nb.step = "Acquire from the dialog attaches: the status bar shows the share and GPU"
        nb.dialog.locator("input[name=amount]").fill("0.5")
        nb.dialog.locator(".jp-Dialog-footer button", has_text="Acquire").click()
        expect(nb.dialog).to_have_count(0, timeout=60_000)
        expect(nb.status).to_contain_text(f"GPU: 0.50 of {MODEL} on node-1")
        expect(nb.status).to_contain_text("idle, parked in")
        # no cell shows what %gpu acquire said: its words come as a notification, the worker's folder too
        expect(nb.toast(r"GPU: attached L-\S+: 0\.50 of")).to_be_visible()
        nb.toasts.locator("button", has_text="Details").click()
        expect(nb.dialog).to_contain_text("The worker runs in this notebook's folder")
        nb.dialog.locator(".jp-Dialog-footer button", has_text="Close").click()
        expect(nb.dialog).to_have_count(0)
        out = nb.run(1)
        assert "Traceback" not in out, out

        nb.step = "a restarted kernel is a new one: detached"
        nb.command("Restart Kernel…")
        nb.dialog.locator(".jp-Dialog-footer button", has_text="Restart").click()
        expect(nb.status).to_have_text("GPU: detached", timeout=60_000)
        assert "Traceback" not in nb.run(0)
        expect(page.locator(".jp-Notebook .jp-Cell").nth(0).locator(".jp-InputPrompt")).to_have_text("[1]:")
        assert "Traceback" not in nb.run(1)  # x = 41 again, in the new kernel

        nb.step = "Release in the status popup detaches"
        nb.run(4)
        expect(nb.cell(4).locator(".widget-label")).to_have_text("on the CPU kernel")
        nb.acquire("0.5")
        expect(nb.dialog).to_have_count(0, timeout=60_000)
        expect(nb.status).to_contain_text(f"GPU: 0.50 of {MODEL} on node-1")
        details = nb.release_from_popup()
        assert MODEL in details and "L-" in details, details
        expect(nb.status).to_have_text("GPU: detached", timeout=60_000)

        nb.step = "idle warning and parked come as notifications; the status says parked"
        nb.acquire("0.25", idle="12s")  # warned 4 s (a third) before the park: time to see the toast
        expect(nb.dialog).to_have_count(0, timeout=60_000)
        nb.run(5)
        expect(nb.cell(5).locator(".widget-slider")).to_be_visible()
        expect(nb.toast(r"GPU: lease L-\S+ has been idle")).to_be_visible()
        expect(nb.toast(r"GPU: lease L-\S+ was parked, idle for")).to_be_visible()
        # the warning closes once it came true: one notification about the lease, none stale
        expect(page.get_by_text(re.compile(r"GPU: lease L-\S+ has been idle"))).to_have_count(0)
        expect(nb.toasts).to_have_count(1)  # the lease's one toast, updated in place
        expect(nb.status).to_contain_text("GPU: parked")
        expect(nb.cell(5).locator(dead)).to_have_count(0)  # the frozen worker keeps its widgets
        # JupyterLab cuts a toast at 140 characters: the park's whole words are one click away
        nb.toasts.locator("button", has_text="Details").click()
        expect(nb.dialog).to_contain_text("the next cell resumes it where it was")
        nb.dialog.locator(".jp-Dialog-footer button", has_text="Close").click()
        expect(nb.dialog).to_have_count(0)

        nb.step = "the user back at the notebook (a click into a cell) resumes it before any cell runs"
        page.locator(".jp-Notebook .jp-Cell").nth(2).click()
        expect(nb.status).to_contain_text(f"GPU: 0.25 of {MODEL}", timeout=60_000)
        # README: "resumed" comes as a notification, in place of "parked", and the next cell says it first
        expect(nb.toast(r"GPU: resumed L-\S+ on node-1 GPU \d+ in [\d.]+s")).to_be_visible()
        expect(nb.toasts).to_have_count(1)
        out = nb.run(2)
        assert re.match(r"gpupool: resumed L-\S+ on node-1", out) and "42" in out and "Traceback" not in out, out

        nb.step = "Release GPU from the palette detaches"
        nb.command("Release GPU")
        expect(nb.status).to_have_text("GPU: detached", timeout=60_000)
        out = nb.run(3)
        assert "not attached" in out, out

        nb.step = "the ended worker's widget is marked disconnected, as JupyterLab marks a dead kernel's"
        expect(nb.cell(5).locator(dead)).to_have_count(1)
        expect(nb.cell(4).locator(dead)).to_have_count(0)  # the CPU kernel's own lives on


@pytest.mark.skipif(WHY is not None, reason=f"no browser test: {WHY}")
def test_other_kernels_get_no_comm_and_no_status_item(lab, tmp_path):
    from playwright.sync_api import expect

    path = lab.root / "plain.ipynb"
    _notebook(path, ["print('plain', 6 * 7)"])
    spec = json.loads(path.read_text())
    spec["metadata"]["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    path.write_text(json.dumps(spec))
    with opened(lab, tmp_path, "plain.ipynb") as nb:
        page = nb.page
        expect(page.locator(".jp-KernelName").first).to_have_text("Python 3 (ipykernel)", timeout=60_000)
        assert "plain 42" in nb.run(0)
        expect(nb.status).to_be_hidden()
    assert "gpupool.status" not in lab.log.read_text(errors="replace"), "a comm was opened to a python3 kernel"


def _popup_layout(page) -> dict:
    """The status popup as the browser laid it out: the facts' rows, the GPU memory holders' rows (header
    first), whether it overflows the dialog."""
    return page.evaluate("""() => {
        const body = document.querySelector('.jp-Dialog .jp-gpupool-details');
        const content = body.closest('.jp-Dialog-content');
        const table = body.querySelector('table').getBoundingClientRect();
        const cells = rows => [...rows].map(r => [...r.cells].map(c => c.textContent));
        return {rows: cells(body.querySelector('table').rows),
                holders: cells(body.querySelectorAll('.jp-gpupool-holders tr')),
                pre: body.querySelectorAll('pre').length, scroll: content.scrollWidth, client: content.clientWidth,
                tableRight: table.right, contentRight: content.getBoundingClientRect().right};
    }""")


#: Bytes pushed and interrupted: over a second on this machine's data plane, so the progress line shows first.
BULK = 3 * 2**30


@pytest.mark.skipif(WHY is not None, reason=f"no browser test: {WHY}")
@pytest.mark.timeout(300)
def test_the_popup_says_each_fact_once_and_fits_and_an_interrupted_push_is_one_line(lab, tmp_path):
    from playwright.sync_api import expect

    _notebook(lab.root / "facts.ipynb", ["%gpu help", f"import numpy as np\nbulk = np.ones({BULK}, np.uint8)",
                                         "%gpu push bulk", "print('bulk' in globals())",
                                         "from gpupool.node import simgpu\nheld = simgpu.zeros(8 << 20, 'uint8')"])
    with opened(lab, tmp_path, "facts.ipynb") as nb:
        page = nb.page
        nb.step = "open the notebook"
        expect(nb.status).to_have_text("GPU: detached", timeout=60_000)

        nb.step = "%gpu help names each command once"
        helped = nb.run(0)
        for line in ("%gpu restart", "%gpu acquire 2 ", "%gpu push NAME", "%gpu status "):
            assert helped.count(line) == 1, f"{line!r} {helped.count(line)} times in:\n{helped}"
        assert "Traceback" not in nb.run(1)

        nb.step = "the popup: one table, each fact once, within the dialog"
        nb.acquire("0.5")
        expect(nb.dialog).to_have_count(0, timeout=60_000)
        expect(nb.status).to_contain_text(f"GPU: 0.50 of {MODEL} on node-1")
        assert "Traceback" not in nb.run(4)
        nb.status.click()
        expect(nb.dialog.locator(".jp-gpupool-details")).to_be_visible()
        expect(nb.dialog.locator(".jp-gpupool-details")).to_contain_text("environment")
        expect(nb.dialog.locator(".jp-gpupool-holders")).to_contain_text("held")
        layout = _popup_layout(page)
        names = [row[0] for row in layout["rows"]]
        assert len(names) == len(set(names)) and layout["pre"] == 0, layout
        assert {"lease", "GPU", "node", "memory", "environment", "host", "worker"} <= set(names), names
        assert layout["holders"] == [["holds GPU memory", "size", "on", "type"],
                                     ["held", "8.0 MiB", "simgpu:0", "ndarray"]], layout["holders"]
        lease = dict(layout["rows"])["lease"]
        assert nb.dialog.locator(".jp-Dialog-body").inner_text().count(lease) == 1, "the lease is said once"
        assert layout["scroll"] <= layout["client"] and layout["tableRight"] <= layout["contentRight"] + 1, layout
        nb.dialog.locator(".jp-Dialog-footer button", has_text="Close").click()
        expect(nb.dialog).to_have_count(0)

        nb.step = "an interrupted push prints one line of what changed"
        cell = page.locator(".jp-Notebook .jp-Cell").nth(2)
        cell.locator(".cm-content").click()
        page.keyboard.press("Shift+Enter")
        expect(cell.locator(".jp-OutputArea-output")).to_contain_text("gpupool: pushing", timeout=60_000)
        nb.command("Interrupt Kernel")
        expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"), timeout=60_000)
        lines = [line for text in cell.locator(".jp-OutputArea-output").all_inner_texts()
                 for line in text.splitlines() if line.strip()]
        assert len(lines) == 1 and re.fullmatch(r"UsageError: push interrupted at [\d.]+ [KMG]iB of 3\.0 GiB; "
                                                r"nothing was defined on the worker", lines[0]), lines
        assert "False" in nb.run(3), "the worker holds nothing of it"
        nb.command("Release GPU")
        expect(nb.status).to_have_text("GPU: detached", timeout=60_000)


@pytest.mark.skipif(WHY is not None, reason=f"no browser test: {WHY}")
@pytest.mark.timeout(180)
def test_release_gives_up_a_parked_lease_whose_resume_waits_for_room(lab, tmp_path):
    """A cell resuming a parked lease in a full pool: the status bar says the resume waits (it said
    ``queued``, and Release GPU was greyed out); Release GPU asks first (the variables are discarded, the
    waiting cell interrupted), then detaches."""
    from playwright.sync_api import expect

    from gpupool.heartbeat import LeaseHeartbeat
    from gpupool.wire.leases import LeaseRequest

    _notebook(lab.root / "waits.ipynb", ["%gpu acquire 0.25", "x = 41", "x + 1"])
    client = lab.service.client()
    hog = beat = None
    try:
        with opened(lab, tmp_path, "waits.ipynb") as nb:
            page = nb.page
            nb.step = "attach"
            expect(nb.status).to_have_text("GPU: detached", timeout=60_000)
            assert "Traceback" not in nb.run(0)
            expect(nb.status).to_contain_text(f"GPU: 0.25 of {MODEL}")
            assert "Traceback" not in nb.run(1)

            nb.step = "parked by the pool (no key or click here since: nothing asks its resume), then the pool filled"
            lease, = [one for one in client.list_leases(active=True)]
            client.park(lease.id)
            expect(nb.status).to_contain_text("GPU: parked (0.25 of a GPU); a click", timeout=30_000)
            hog = client.create_lease(LeaseRequest(fraction=1.0, gpu_count=2))
            beat = LeaseHeartbeat(client, hog.id, 1.0)
            beat.start()

            nb.step = "a cell resumes it: the resume waits in line, and the status bar says so"
            nb.cell(2).locator(".cm-content").click()
            page.keyboard.press("Shift+Enter")
            expect(nb.status).to_have_text(re.compile(r"GPU: parked \(0\.25 of a GPU\); resume waiting for room #1"))

            nb.step = "Release GPU is enabled in the Kernel menu"
            page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").click()
            item = page.locator(".lm-Menu-item", has=page.locator(".lm-Menu-itemLabel", has_text="Release GPU"))
            expect(item).to_be_visible()
            expect(item).not_to_have_class(re.compile(r"lm-mod-disabled"))
            item.click()

            nb.step = "it asks first: the variables are discarded, the waiting cell interrupted"
            expect(nb.dialog).to_contain_text(f"{lease.id} is parked and its resume waits for room (place 1 in line")
            expect(nb.dialog).to_contain_text("releasing it now discards them, and interrupts the cell waiting for it")
            nb.dialog.locator(".jp-Dialog-footer button", has_text="Release without variables").click()
            expect(nb.status).to_have_text("GPU: detached", timeout=30_000)
            expect(nb.cell(2).locator(".jp-OutputArea")).to_contain_text(
                f"interrupted while waiting for {lease.id} to resume")
            # the status bar may say detached a beat before the service's answer: the kernel let the lease go first
            wait_for(lambda: client.get_lease(lease.id).state.ended, 30, "the lease released")
    finally:
        if beat is not None:
            beat.stop()
        if hog is not None:
            client.release(hog.id)


@pytest.mark.skipif(WHY is not None, reason=f"no browser test: {WHY}")
@pytest.mark.timeout(180)
def test_the_status_bar_says_a_coming_preemption_until_the_park(pressure_lab, tmp_path):
    """A preemptible lease whose running cell a waiting person's request will park: the status item says
    'preempted in …' in the warning colour, with the notice's words as its tooltip, until the park."""
    from playwright.sync_api import expect

    from gpupool.wire.leases import LeaseRequest

    lab = pressure_lab
    _notebook(lab.root / "preempted.ipynb", ["%gpu acquire 1 --batch --preemptible",
                                             "import time\nfor _ in range(200): time.sleep(0.1)"])
    client, ann = lab.service.client(), lab.service.client("ann")
    waiter = None
    try:
        with opened(lab, tmp_path, "preempted.ipynb") as nb:
            page = nb.page
            nb.step = "attach"
            expect(nb.status).to_have_text("GPU: detached", timeout=60_000)
            assert "Traceback" not in nb.run(0)
            expect(nb.status).to_contain_text(f"of {MODEL} on node-1")
            expect(nb.status).not_to_contain_text("preempted")

            nb.step = "a cell runs; ann asks for the GPU: the notice comes, and the status item says it"
            nb.cell(1).locator(".cm-content").click()
            page.keyboard.press("Shift+Enter")
            mine, = client.list_leases(active=True)
            wait_for(lambda: client.get_lease(mine.id).worker["execution_state"] == "busy", 30, "the cell running")
            waiter = ann.create_lease(LeaseRequest(fraction=1.0, wait=120))
            expect(nb.status).to_contain_text(re.compile(r" · preempted (in \d+s|now)$"), timeout=30_000)
            expect(nb.status).to_have_class(re.compile(r"jp-gpupool-preempted"))
            expect(nb.status).to_have_attribute("title", re.compile(
                rf"^GPU: lease {mine.id} is preemptible and 1 person is waiting for a GPU: in about \d+s it is "
                r"parked, the running cell frozen where it is \(or interrupted where the node cannot freeze a "
                r"running cell\); it goes on when the pool resumes the lease \(click for details\)$"))

            nb.step = "the park clears it"
            expect(nb.status).to_contain_text("GPU: parked", timeout=30_000)
            expect(nb.status).not_to_contain_text("preempted")
            expect(nb.status).not_to_have_class(re.compile(r"jp-gpupool-preempted"))
            expect(nb.status).to_have_attribute("title", "GPU lease of this notebook (click for details)")
    finally:
        if waiter is not None:
            ann.release(waiter.id)
