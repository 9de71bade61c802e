"""The wheel the deploy tests install, built once per test run from a copy of the checkout's
files (``git ls-files``), without build isolation, against the lowest setuptools that
pyproject.toml allows (``make install`` puts it in ``.venv/setuptools-floor``): the way a
distribution builds it, and the way ``make wheel`` builds it for the images."""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLOOR = Path(sys.prefix) / "setuptools-floor"


def tracked_files() -> list[str]:
    """The checkout's files as a clone has them (tracked, and new ones not ignored)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout: nothing to build the wheel from")
    return [name for name in files if (ROOT / name).is_file()]


def copy_tree(dest: Path) -> Path:
    """A copy of :func:`tracked_files` under ``dest`` (the build writes egg-info and build/ there)."""
    for name in tracked_files():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    return dest


def floor_version() -> str:
    """The setuptools version in ``.venv/setuptools-floor``; skipped, saying why, when it is missing."""
    found = sorted(FLOOR.glob("setuptools-*.dist-info"))
    if not found:
        pytest.skip(f"no setuptools floor at {FLOOR} (make install puts it there)")
    return found[-1].name[len("setuptools-"):-len(".dist-info")]


@functools.lru_cache(maxsize=None)
def _build() -> tuple[Path, str]:
    work = Path(tempfile.mkdtemp(prefix="gpupool-wheel-"))
    atexit.register(shutil.rmtree, work, True)
    tree = copy_tree(work / "src")
    code = ("import sys, setuptools; from setuptools import build_meta; print('setuptools', setuptools.__version__);"
            "print(build_meta.build_wheel(sys.argv[1]))")
    env = {**os.environ, "PYTHONPATH": str(FLOOR)}  # first on sys.path: the floor, not the venv's own setuptools
    done = subprocess.run([sys.executable, "-c", code, str(work / "dist")], cwd=tree, capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work / "dist" / done.stdout.strip().splitlines()[-1], done.stdout + done.stderr


def build_wheel() -> tuple[Path, str]:
    """``(wheel, build log)``; the log's first line names the setuptools that built it."""
    floor_version()
    return _build()


def used_setuptools(log: str) -> str:
    return re.search(r"^setuptools (\S+)$", log, re.M).group(1)
