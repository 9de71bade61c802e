"""The documentation site (docs/conf.py: Sphinx + MyST) builds with warnings as errors and
gathers README.md, every page of docs/ and the deploy READMEs; a link to a repository file
goes to its page of the site, or to the file in the repository; a broken link fails the build."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def build(source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(source),
                           str(out)], capture_output=True, text=True, timeout=300)


def test_the_site_builds_with_warnings_as_errors_and_gathers_every_page(tmp_path):
    pytest.importorskip("myst_parser", reason="the docs extra (sphinx, myst-parser) is not installed")
    done = build(ROOT / "docs", tmp_path / "html")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    html = tmp_path / "html"
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert (html / page.with_suffix(".html").name).is_file(), page.name
    pages = {"site/readme.html": "Deploying", "site/kubernetes.html": "What was verified here",
             "site/systemd.html": "Three GPU hosts and a hub", "site/jupyterhub.html": "JupyterHub",
             "site/changelog.html": "Changelog", "runbooks.html": "GPUPoolServiceAbsent"}
    for name, text in pages.items():
        assert text in (html / name).read_text(), name
    readme = (html / "site" / "readme.html").read_text()
    assert 'href="kubernetes.html"' in readme and 'href="../api.html"' in readme  # pages of the site
    assert 'href="https://github.com/gpupool/gpupool/blob/main/LICENSE"' in readme  # a file of the repository


def test_a_broken_link_fails_the_build(tmp_path):
    pytest.importorskip("myst_parser", reason="the docs extra (sphinx, myst-parser) is not installed")
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "conf.py", tmp_path / "docs" / "conf.py")
    (tmp_path / "gpupool").mkdir()
    (tmp_path / "gpupool" / "__init__.py").write_text('__version__ = "0.0.0"\n')
    (tmp_path / "docs" / "index.md").write_text("# Broken\n\nSee [the missing page](missing.md).\n")
    done = build(tmp_path / "docs", tmp_path / "html")
    assert done.returncode != 0 and "missing.md" in done.stderr, done.stderr
